"""The SGLang backend's typed errors: each says what was wrong and what the caller can do."""

from __future__ import annotations


class SglangBackendError(Exception):
    """Base of the backend's errors."""


class SglangConfigError(SglangBackendError, ValueError):
    """The backend's extra config or SGLang's storage config cannot be served (raised when SGLang creates the
    backend or registers its host pool: the engine fails at start, not on its first request)."""


class SglangInputError(SglangBackendError, ValueError):
    """A call's arguments break the interface (a key that is not a string, indices that are not whole pages, a
    value of the wrong size): a bug in the caller, raised rather than answered as a miss."""


class SglangNotReadyError(SglangBackendError, RuntimeError):
    """A data call before SGLang registered its host pool (`register_mem_pool_host`): the page layout, and so the
    tier's fingerprint, is not known yet."""
