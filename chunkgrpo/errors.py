"""User-facing errors: the CLI prints these as one line (no traceback) and exits 2."""


class UserError(ValueError):
    """Bad input that the user can fix (a path, a value, a combination of settings)."""


class Terminated(BaseException):
    """The process was asked to stop (SIGTERM, e.g. a pod eviction). A BaseException, like
    KeyboardInterrupt, so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int = 15):
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum
