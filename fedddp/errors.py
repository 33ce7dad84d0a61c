"""User-facing errors and the exit status each one maps to.

A user's mistake is never a traceback: ``python -m fedddp`` catches these, prints the message
as one line on stderr and exits with ``exit_code``. Everything else (our own bugs) keeps its
traceback.
"""


class UserError(Exception):
    exit_code = 1


class ConfigError(UserError, ValueError):
    """Bad configuration: unknown key, wrong type, impossible value. Exit status 2."""

    exit_code = 2


class DataError(UserError):
    """A data set is missing or unreadable. Exit status 3. Name the path and how to get it."""

    exit_code = 3
