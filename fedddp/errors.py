"""User-facing errors and the exit status each one maps to.

A user's mistake, or a run that cannot go on, is never a traceback: ``python -m fedddp``
catches these, prints the message as one line on stderr and exits with ``exit_code`` (the table
of exit statuses is in docs/running.md). Everything else (our own bugs) keeps its traceback.
"""

import difflib


def os_error_in(exc: BaseException | None) -> OSError | None:
    """The first OSError in an exception's chain (torch.save reports a failed write as a
    RuntimeError with the OSError as its cause), or None."""
    while exc is not None and not isinstance(exc, OSError):
        exc = exc.__cause__ or exc.__context__
    return exc


class UserError(Exception):
    exit_code = 1


class ConfigError(UserError, ValueError):
    """Bad configuration: unknown key, wrong type, impossible value. Exit status 2."""

    exit_code = 2


class DataError(UserError):
    """A data set is missing or unreadable. Exit status 3. Name the path and how to get it."""

    exit_code = 3


class DivergenceError(UserError):
    """The global model or the round's training loss is not finite: the run stopped before
    writing anything of that round. Exit status 4. Name the round and the likely cause."""

    exit_code = 4


class DiskFullError(UserError):
    """No space left (or quota exceeded) while writing the run's output. Exit status 5. Name the
    file system and the last complete checkpoint, from which ``run.resume=true`` continues."""

    exit_code = 5


class StalledError(UserError):
    """A rank stopped answering for run.collective_timeout_s seconds, or the ranks did not all
    meet within it. Exit status 6. Name the rank; ``run.resume=true`` continues from the last
    complete checkpoint."""

    exit_code = 6


class PluginError(UserError):
    """The user's own code (a data or model callable, a plugin rule's aggregate or hooks) raised:
    one line naming the callable and the exception, exit status 7, since status 1 means a bug in
    fedddp. The user's traceback is the cause (``__cause__``); ``python -m fedddp`` prints it with
    FEDDDP_TRACEBACK=1."""

    exit_code = 7


def close_match(word, candidates) -> str | None:
    """The candidate a misspelt ``word`` most likely meant, for a "did you mean" (None: none close)."""
    found = difflib.get_close_matches(str(word), [str(c) for c in candidates], n=1)
    return found[0] if found else None


# What fedddp.run raises for a user's mistake or a run that cannot go on (exported by fedddp).
ERRORS = (ConfigError, DataError, DivergenceError, DiskFullError, StalledError, PluginError)
