"""Typed exceptions of the IPC layer: what a caller sees when a call does not end in `Ok`.

A remote exception keeps its type name and a stable error code (`RemoteError.code`), never a bare string, so that a
caller can branch on it. `Failed.unwrap()`, `Cancelled.unwrap()` and `PeerDead.unwrap()` raise these.
"""

from __future__ import annotations


class IpcError(Exception):
    """Base class of every kvproc IPC error."""


class RemoteError(IpcError):
    """The remote handler raised: `code` is stable (e.g. "internal", "deadline_exceeded"), `exc_type` its type."""

    def __init__(self, code: str, exc_type: str, message: str) -> None:
        super().__init__(f"[{code}] {exc_type}: {message}")
        self.code = code
        self.exc_type = exc_type
        self.message = message


class PeerDeadError(IpcError):
    """The peer died, said goodbye, or stopped answering heartbeats; every pending call fails with this at once."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class CallCancelled(IpcError):
    """The call's cancel token was cancelled before the work finished."""

    def __init__(self, token: int, message: str = "cancelled") -> None:
        super().__init__(f"{message} (token {token:#x})")
        self.token = token


# The name the issue text uses; distinct from asyncio.CancelledError and concurrent.futures.CancelledError.
CancelledError = CallCancelled


class DeadlineExceeded(IpcError):
    """The call's absolute deadline passed (raised remotely between operations, or locally as a backstop)."""


class HandlerError(IpcError):
    """Raise from a handler to choose the error code the caller sees (other exceptions map to "internal")."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class HandshakeRefused(IpcError):
    """The server refused the handshake (protocol version mismatch, bad token); the message names both sides."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code


def reason_of(e: BaseException) -> str:
    """The word an outcome records for a failure: a remote handler's stable code (e.g. "repack_failed",
    "copy_error") where the peer gave one, else the exception's type name."""
    return e.code if isinstance(e, RemoteError) else type(e).__name__
