"""User-facing errors and the exit status each one maps to.

A user's mistake, or a run that cannot go on, is never a traceback: ``python -m fedddp``
catches these, prints the message as one line on stderr and exits with ``exit_code`` (the table
of exit statuses is in docs/running.md). Everything else (our own bugs) keeps its traceback.
"""


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


# What fedddp.run raises for a user's mistake or a run that cannot go on (exported by fedddp).
ERRORS = (ConfigError, DataError, DivergenceError, DiskFullError, StalledError)
