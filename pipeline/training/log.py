"""The trainer's log lines: `[pipeline] 2026-12-03 14:02:11 INFO r0 message` on stdout, through
`logging`, from rank 0 only unless a message is about one rank (`every_rank`).

Each line is one write, so ranks sharing a log file never interleave within a line. Tests and the
Slurm scripts match the stable message prefixes (`done: step`, `resumed from`, ...), not whole lines.
"""

from __future__ import annotations

import logging
import sys

from pipeline import distributed

PREFIX = "[pipeline]"
_LOGGER = logging.getLogger("pipeline")


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rank = distributed.rank() if distributed.is_initialized() else distributed.launch_rank()
        record.rank = rank
        return rank == 0 or getattr(record, "every_rank", False)


def setup() -> logging.Logger:
    """Install the handler once per process (idempotent)."""
    if not any(getattr(h, "_tokencl", False) for h in _LOGGER.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler._tokencl = True  # type: ignore[attr-defined]
        handler.setFormatter(
            logging.Formatter(f"{PREFIX} %(asctime)s %(levelname)s r%(rank)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
        )
        handler.addFilter(_RankFilter())
        _LOGGER.addHandler(handler)
        _LOGGER.setLevel(logging.INFO)
        _LOGGER.propagate = False
    return _LOGGER


def info(msg: str) -> None:
    """A line from rank 0."""
    setup().info(msg)


def warning(msg: str) -> None:
    """A warning from rank 0."""
    setup().warning(msg)


def every_rank(msg: str) -> None:
    """A line from every rank (facts about this rank: its place in the world, its host)."""
    setup().info(msg, extra={"every_rank": True})
