"""Errors that cross layers: any module may raise them, the command line and ``elasticrun.run()``
turn them into an exit code and one paragraph for the user."""

from __future__ import annotations


class JobFailed(Exception):
    """The job ended unsuccessfully (or could not start); the message is the paragraph shown to
    the user, ``exit_code`` what the ``elasticrun`` command exits with (2: a usage error)."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code
