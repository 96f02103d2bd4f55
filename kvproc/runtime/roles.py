"""The table that maps a role name to its class, by import path.

Classes are named by import path so the launcher never imports a role (or torch) it does not start:
- `host_tier`: `kvproc.tiers.host:HostTierRole` (the host-memory tier: index, leases, waiters; no torch);
- `copy_worker`: `kvproc.workers.worker:CopyWorkerRole` (moves KV bytes between arena segments; torch).
Both also accept `options["segment_bytes"]`, a scratch segment created at start (the runtime's tests use it to
check that segments are cleaned up on every exit path).
`kvproc.runtime.roles.HostTierRole` / `.CopyWorkerRole` still resolve (lazily) for older class paths.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvproc.runtime.role import Role

ROLE_CLASSES: dict[str, str] = {
    "host_tier": "kvproc.tiers.host:HostTierRole",
    "copy_worker": "kvproc.workers.worker:CopyWorkerRole",
}

_COMPAT = {"HostTierRole": ROLE_CLASSES["host_tier"], "CopyWorkerRole": ROLE_CLASSES["copy_worker"]}


def resolve_role_class(path: str) -> type[Role]:
    module, _, attr = path.partition(":")
    cls: Any = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, Role)):
        raise TypeError(f"{path} is not a kvproc Role subclass")
    return cls


def __getattr__(name: str) -> Any:
    # Lazy, so importing this table never imports a role's module (the copy worker's pulls in torch).
    if name in _COMPAT:
        return resolve_role_class(_COMPAT[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
