"""Rank 0's stderr: the progress line, rewritten in place on a terminal ("\\r"), and every other
message, which first ends that line so that it never lands in the middle of it."""

from __future__ import annotations

import sys

_open = False  # a progress line is on the terminal without its newline


def rewrite(line: str) -> None:
    """The progress line in place of the last one (a terminal)."""
    global _open
    sys.stderr.write("\r" + line)
    sys.stderr.flush()
    _open = True


def end_line() -> None:
    """The open progress line ended, so the next message starts on a line of its own."""
    global _open
    if _open:
        sys.stderr.write("\n")
        sys.stderr.flush()
        _open = False


def say(message: str) -> None:
    """One message on stderr, on its own line."""
    end_line()
    print(message, file=sys.stderr, flush=True)
