"""kvproc's wire and shared memory: typed messages, RPC over ZeroMQ, POSIX shared-memory segments.

See `messages.py` for the wire types and their tag table, and docs/architecture.md for how the pieces fit.
"""

from kvproc.ipc.cancel import CancelToken, new_token
from kvproc.ipc.client import RpcClient
from kvproc.ipc.context import CallContext
from kvproc.ipc.errors import CallCancelled, DeadlineExceeded, HandlerError, IpcError, PeerDeadError, RemoteError
from kvproc.ipc.segment import Segment, SegmentBusyError, SegmentError, sweep_dead_segments
from kvproc.ipc.server import RpcServer
from kvproc.ipc.service import Service, handles

__all__ = [
    "CallCancelled", "CallContext", "CancelToken", "DeadlineExceeded", "HandlerError", "IpcError", "PeerDeadError",
    "RemoteError", "RpcClient", "RpcServer", "Segment", "SegmentBusyError", "SegmentError", "Service", "handles",
    "new_token", "sweep_dead_segments",
]  # fmt: skip
