"""The builder's user-error type: the CLI turns it into exit code 2 with its message."""


class UsageError(ValueError):
    """Bad input or flags; the message names the path, flag or value and what to do."""
