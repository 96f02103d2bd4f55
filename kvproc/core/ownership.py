"""Who a handle belongs to, and the one typed error for a handle given back to another owner.

Every handle the API hands out (a `PrefixHold`, a `Reservation`, a `Pin`, a bounded `CopyOrder`, a `SealCursor`, a
hand-off envelope) names the owner it came from: the pool (one rank of one store) that holds its references, or the
request whose pages it counts. Where a handle comes back, the owner is checked before anything is consumed: a hold of
rank 0 adopted by rank 1's request would make that request compute over blocks holding another prompt's bytes, with
no error until a refcount underflows at release, or none at all with two stores in one process. Hashes cannot catch
it: every rank of a store, and every store of the same model, hashes the same prompt the same way.
"""

from __future__ import annotations

import itertools
from typing import Any

# Process-wide serials, never reused: an `id()` can be reused once its object is gone, a serial cannot.
_POOL_SERIALS = itertools.count(1)


def next_pool_serial() -> int:
    return next(_POOL_SERIALS)


class ForeignHandleError(ValueError):
    """A handle came back to an owner other than the one that handed it out (another rank's pool, another store's,
    another request's), or an argument is not of the type the API names. Raised before anything is consumed: the
    handle is still its owner's, to use there or release."""

    def __init__(self, what: str, belongs_to: str, used_with: str) -> None:
        super().__init__(f"{what} belongs to {belongs_to}, not to {used_with}: refused (a handle is used only with "
                         "the owner that handed it out)")
        self.what, self.belongs_to, self.used_with = what, belongs_to, used_with


def require_type(value: Any, expected: type, what: str) -> None:
    """Refuse an argument of another type than the one the API names (a plain string for an enum, a dict for a
    scope): silently accepted, it would compare unequal to every member and take a default path."""
    if not isinstance(value, expected):
        raise TypeError(f"{what} must be a {expected.__module__}.{expected.__qualname__}, got "
                        f"{type(value).__name__} {value!r}")
