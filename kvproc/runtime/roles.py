"""The runtime's built-in roles, and the table that maps a role name to its class.

In this issue the host tier and copy worker only answer the runtime's own requests (ping, stats, profile, shutdown,
cancel, and the debug Sleep/Fail); the next issue adds their real requests. Both optionally create a shared-memory
segment (`options["segment_bytes"]`) so that the tests can check it is cleaned up on every exit path.
Classes are named by import path so the launcher never imports a role (or torch) it does not start.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvproc.runtime.role import Role, RoleEnv

ROLE_CLASSES: dict[str, str] = {
    "host_tier": "kvproc.runtime.roles:HostTierRole",
    "copy_worker": "kvproc.runtime.roles:CopyWorkerRole",
}


def resolve_role_class(path: str) -> type[Role]:
    module, _, attr = path.partition(":")
    cls: Any = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, Role)):
        raise TypeError(f"{path} is not a kvproc Role subclass")
    return cls


class HostTierRole(Role):
    name = "host_tier"

    def __init__(self, env: RoleEnv) -> None:
        super().__init__(env)
        if nbytes := int(env.options.get("segment_bytes", 0)):
            self.create_segment(nbytes)


class CopyWorkerRole(Role):
    name = "copy_worker"
    needs_torch = True  # the next issue's copies use torch; preloading it keeps restarts at fork speed
    restartable = True

    def __init__(self, env: RoleEnv) -> None:
        super().__init__(env)
        if nbytes := int(env.options.get("segment_bytes", 0)):
            self.create_segment(nbytes)
