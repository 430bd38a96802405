"""Errors that cross module boundaries. Each carries one human sentence."""


class PrimeNodeError(Exception):
    """Base class: a failure with a clear, user-facing reason (no traceback needed)."""


class KeyFileError(PrimeNodeError):
    pass


class UsageError(PrimeNodeError):
    """A bad command-line argument. `prime-node` prints `error: <sentence>` (one line) and exits 2."""


class SignatureError(PrimeNodeError):
    """A signed request or document did not verify. `code` is a short machine-readable reason."""

    def __init__(self, code: str, detail: str):
        super().__init__(detail)
        self.code = code
        self.detail = detail
