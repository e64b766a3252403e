"""The builder's user-error type (the CLI turns it into exit code 2 with its message) and its notes
(one line on stderr for something the user should know but that does not stop the build)."""

import sys


class UsageError(ValueError):
    """Bad input or flags; the message names the path, flag or value and what to do."""


def note(message: str) -> None:
    """Tell the user something the build decided for them (a worker cap, a stale lock taken over)."""
    print(f"build_shards.py: note: {message}", file=sys.stderr, flush=True)
