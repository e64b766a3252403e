"""Reading the trainer's log lines (`[pipeline] DATE TIME LEVEL rN message`) by their stable message
prefixes, never by whole lines."""

from __future__ import annotations

import re

# The part of a line before the message; compose with a message pattern.
HEAD = r"\[pipeline\] \d{4}-\d\d-\d\d \d\d:\d\d:\d\d [A-Z]+ r\d+ "
_LINE = re.compile(r"^" + HEAD + r"(.*)$", re.M)


def messages(text: str) -> list[str]:
    """The messages of every trainer log line in `text`, in order."""
    return _LINE.findall(text)


def has(text: str, prefix: str) -> bool:
    return any(m.startswith(prefix) for m in messages(text))


def count(text: str, prefix: str) -> int:
    return sum(m.startswith(prefix) for m in messages(text))


def pattern(message: str) -> re.Pattern:
    """A regex over whole log text for lines whose message matches `message` (a regex)."""
    return re.compile(HEAD + message)
