"""kvproc's process runtime: launch and supervise the cluster's processes (see docs/architecture.md)."""

from kvproc.runtime.config import ClusterStartError, PeerEvent, RoleConfig
from kvproc.runtime.launcher import Cluster, launch

__all__ = ["Cluster", "ClusterStartError", "PeerEvent", "RoleConfig", "launch"]
