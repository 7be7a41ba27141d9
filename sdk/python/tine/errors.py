"""Typed exceptions: every error tined answers is `{code, message}`; each
code has its class, and the message is the server's, unchanged."""

from __future__ import annotations

from typing import Optional


class TineError(Exception):
    """An error tined answered (or the connection to it failed)."""

    code: str = "error"

    def __init__(self, message: str, *, code: Optional[str] = None, status: Optional[int] = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.status = status

    def __str__(self) -> str:
        return f"{self.message} ({self.code})"


class InvalidInput(TineError):
    """The request was wrong (a bad name, size, path, contract...): fix it."""

    code = "invalid_input"


class NotFound(TineError):
    """No such vm, branch, checkpoint, operation or guest file."""

    code = "not_found"


class Conflict(TineError):
    """The target exists already, or is not in a state that allows this."""

    code = "conflict"


class Busy(TineError):
    """Another operation holds the vm; try again."""

    code = "busy"


class Failed(TineError):
    """The engine tried and failed (a guest that did not answer, a VMM that died)."""

    code = "failed"


class Unauthorized(TineError):
    """The token is missing or wrong (TCP listeners need `Authorization: Bearer`)."""

    code = "unauthorized"


class Forbidden(TineError):
    """The token is valid but may not do this (an API key managing keys)."""

    code = "forbidden"


class Unavailable(TineError):
    """tined is not reachable, or is restarting."""

    code = "unavailable"


class Internal(TineError):
    """A defect in tined: please report it with the message."""

    code = "internal"


_BY_CODE = {
    c.code: c
    for c in (InvalidInput, NotFound, Conflict, Busy, Failed, Unauthorized, Forbidden, Internal)
}
_BY_CODE["restarting"] = Unavailable
_BY_CODE["method_not_allowed"] = InvalidInput
_BY_CODE["too_large"] = InvalidInput


def from_answer(status: int, body: object, fallback: str) -> TineError:
    """The exception for an error answer (JSON `{code, message}` or not)."""
    code, message = None, fallback
    if isinstance(body, dict):
        code = body.get("code") if isinstance(body.get("code"), str) else None
        if isinstance(body.get("message"), str):
            message = body["message"]
    cls = _BY_CODE.get(code or "", TineError)
    return cls(message, code=code or f"http_{status}", status=status)
