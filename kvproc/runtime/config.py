"""What a cluster is made of: one `RoleConfig` per child process, and the events the launcher reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from kvproc.runtime.roles import ROLE_CLASSES


class ClusterStartError(RuntimeError):
    """A child did not come up; the message names it and says why (timeout, exit status, or its traceback)."""


@dataclass(frozen=True)
class RoleConfig:
    role: str  # a key of ROLE_CLASSES, or any name when role_class is given
    rank: int = 0
    role_class: str | None = None  # "module:Class"; default ROLE_CLASSES[role]
    options: Mapping[str, Any] = field(default_factory=dict)  # handed to the role as env.options
    restart: bool | None = None  # None: the role class's `restartable`
    # The restart budget is a rate: at most `max_restarts` automatic restarts within any `restart_window_s` (a
    # lifetime count made the 4th crash in a long-lived cluster's life final, however far apart the crashes were).
    max_restarts: int = 3
    restart_window_s: float = 300.0
    tcp: str | None = None  # also bind here, e.g. "tcp://127.0.0.1:0"; the auth token is required there too
    workers: int = 4  # handler threads
    max_in_flight: int = 256
    max_frame_bytes: int = 1 << 20
    log_level: str = "info"  # the child's structlog level (its JSON lines go to the inherited stderr)
    cpus: tuple[int, ...] | None = None  # run the child (all its threads) on these CPUs only; None: wherever

    @property
    def class_path(self) -> str:
        if self.role_class:
            return self.role_class
        if self.role not in ROLE_CLASSES:
            raise ValueError(f"unknown role {self.role!r}: known {sorted(ROLE_CLASSES)}, or pass role_class")
        return ROLE_CLASSES[self.role]


@dataclass(frozen=True)
class PeerEvent:
    role: str
    rank: int
    pid: int
    what: str  # crashed | restarted | unavailable | unresponsive | reconnected
    detail: str
    at: float
