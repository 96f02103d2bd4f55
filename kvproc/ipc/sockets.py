"""Socket options every kvproc socket gets, and endpoint naming."""

from __future__ import annotations

import os
import secrets
from typing import Any

import zmq

# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
MAX_IPC_PATH = 107


def configure_socket(sock: zmq.Socket[Any], *, hwm: int) -> None:
    # Explicit high-water marks: no unbounded queues. LINGER 0: closing never blocks on an unreachable peer.
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)


# How long a closing client socket keeps its `Goodbye` queued for a reachable server (zmq_close never blocks on it).
GOODBYE_LINGER_MS = 100


def new_session() -> int:
    """A connection's session id (`messages.Hello.session`): random, nonzero, a msgpack int64. Every later message
    on that connection carries it, so a socket that takes over an authenticated routing id without saying Hello
    (a reconnect with a chosen ZMQ_ROUTING_ID) is not served: it cannot know the id."""
    return secrets.randbits(63) | 1


def ipc_endpoint(runtime_dir: str, name: str) -> str:
    path = os.path.join(runtime_dir, f"{name}.sock")
    if len(path.encode()) > MAX_IPC_PATH:
        raise ValueError(
            f"ipc socket path {path!r} is {len(path.encode())} bytes, over the {MAX_IPC_PATH}-byte Unix limit; "
            "use a shorter runtime dir (e.g. under /tmp)"
        )
    return f"ipc://{path}"


# pyzmq's constants are enum.IntFlag members: `events & zmq.POLLIN` goes through IntFlag.__rand__ and the enum
# machinery (~2 us a time, far more on a cold cache) and `zmq.SNDMORE | zmq.NOBLOCK` likewise. The per-message paths
# (the server socket thread, the loop's client) use these plain ints instead. (getsockopt itself still
# builds a SocketOption per call in pyzmq 27, ~2 us: hot paths read `Frame.more` instead of RCVMORE.)
POLLIN = int(zmq.POLLIN)
NOBLOCK = int(zmq.NOBLOCK)
SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
EVENTS = int(zmq.EVENTS)
RCVMORE = int(zmq.RCVMORE)
