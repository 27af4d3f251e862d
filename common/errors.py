"""Exceptions shared by every part of the project."""


class NmtError(Exception):
    """An error the user can fix (bad input, missing file, refused overwrite).

    The ``nmt`` command prints its message without a traceback and exits with status 2.
    """
