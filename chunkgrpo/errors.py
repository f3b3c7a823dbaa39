"""User-facing errors: the CLI prints these as one line (no traceback) and exits 2."""


class UserError(ValueError):
    """Bad input that the user can fix (a path, a value, a combination of settings)."""
