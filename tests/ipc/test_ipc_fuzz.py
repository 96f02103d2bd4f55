"""Hostile frames at every socket of a running cluster: every process stays up and keeps serving valid requests."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproc.ipc import messages as m
from kvproc.ipc.client import RpcClient
from kvproc.runtime import Cluster, RoleConfig, launch
from kvproc.runtime import manifest as mf

MAX_FRAME = 16 * 1024


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    roles = [RoleConfig("host_tier", max_frame_bytes=MAX_FRAME), RoleConfig("copy_worker", max_frame_bytes=MAX_FRAME)]
    c = launch(roles, cluster_name="fz", runtime_dir=f"/tmp/kvfz-{os.getpid()}")
    try:
        yield c
    finally:
        c.shutdown()


class Target:
    """A raw DEALER that said Hello properly (so its calls reach dispatch) and one that never did."""

    def __init__(self, endpoint: str, token: str) -> None:
        ctx = zmq.Context.instance()
        self.authed, self.anon = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for s in (self.authed, self.anon):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
        self.authed.send(m.encode(m.Hello(m.PROTOCOL_VERSION, token, "fuzz")))
        assert self.authed.poll(5000) and isinstance(m.client_decoder().decode(self.authed.recv()), m.Welcome)
        self.client = RpcClient(endpoint, token=token, peer=endpoint)
        self.client.connect(5)

    def drain_replies(self) -> list[Any]:
        out = []
        for s in (self.authed, self.anon):
            while s.poll(0):
                out.append(m.client_decoder().decode(s.recv()))  # every reply is a well-formed typed message
        return out

    def close(self) -> None:
        self.client.close()
        self.authed.close()
        self.anon.close()


@pytest.fixture(scope="module")
def targets(cluster: Cluster) -> Iterator[list[Target]]:
    manifest = mf.read_manifest(cluster.runtime_dir)
    endpoints = [p.endpoint for p in manifest.processes] + [manifest.control_endpoint]
    ts = [Target(ep, cluster.token) for ep in endpoints]
    yield ts
    for t in ts:
        t.close()


def _valid_frames() -> list[bytes]:
    return [
        m.encode(m.Call(1, time.monotonic_ns() + 10**9, m.Stats())),
        m.encode(m.Call(2, time.monotonic_ns() + 10**9, m.Sleep(0.001), token=5)),
        m.encode(m.Cancel(5)),
        m.encode(m.Heartbeat(1)),
    ]


_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=20,
)
frames = st.one_of(
    st.binary(max_size=256),  # random bytes
    st.builds(
        lambda f, cut: f[: max(0, len(f) - cut)], st.sampled_from(_valid_frames()), st.integers(1, 30)
    ),  # truncated
    st.builds(
        lambda tag, rest: msgspec.msgpack.encode([tag, *rest]),
        st.integers(0, 1000),
        st.lists(_msgpack_values, max_size=5),
    ),
    st.builds(lambda n: b"\x91" + b"x" * n, st.integers(MAX_FRAME, 2 * MAX_FRAME)),  # oversized
    st.lists(st.binary(max_size=16), min_size=2, max_size=4).map(tuple),  # multipart
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frame=frames, authed=st.booleans())
def test_random_truncated_and_oversized_frames_never_stop_a_process(
    targets: list[Target], frame: bytes | tuple[bytes, ...], authed: bool
) -> None:
    for t in targets:
        sock = t.authed if authed else t.anon
        if isinstance(frame, tuple):
            sock.send_multipart(frame)
        else:
            sock.send(frame)
    for t in targets:
        assert t.client.request(m.Ping(b"still here"), timeout=5).data == b"still here"
        t.drain_replies()


def test_bad_frames_get_typed_error_replies(targets: list[Target]) -> None:
    t = targets[0]
    t.drain_replies()
    t.anon.send(b"\xc1garbage")
    t.anon.send(b"\x91" + b"x" * (MAX_FRAME + 10))
    t.anon.send(m.encode(m.Call(9, time.monotonic_ns() + 10**9, m.Stats())))
    t.authed.send(msgspec.msgpack.encode([4, 1, 2, [999]]))  # a Call whose body has an unknown tag
    replies: list[Any] = []
    deadline = time.monotonic() + 5
    while len(replies) < 4 and time.monotonic() < deadline:
        t.anon.poll(100)
        replies += t.drain_replies()
    codes = sorted(r.code for r in replies)
    assert codes == ["malformed", "malformed", "not_authenticated", "oversized"], replies
    assert t.client.request(m.Stats(), timeout=5).errors >= 4


def test_client_survives_garbage_from_its_server() -> None:
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = RpcClient(f"tcp://127.0.0.1:{port}", token="t", peer="fake", heartbeat_s=None)

    def fake_server() -> None:
        answered = 0
        while answered < 2:  # two calls, each answered with garbage first
            ident, data = router.recv_multipart()
            msg = m.server_decoder().decode(data)
            if isinstance(msg, m.Hello):
                router.send_multipart([ident, m.encode(m.Welcome(m.PROTOCOL_VERSION, "fake", 0, 1))])
                continue
            for junk in (b"", b"\xc1", msgspec.msgpack.encode([77, 1]), m.encode(m.Ok(12345, m.Done()))):
                router.send_multipart([ident, junk])
            router.send_multipart([ident, m.encode(m.Ok(msg.call_id, m.Pong(b"ok")))])
            answered += 1

    server = threading.Thread(target=fake_server, daemon=True)
    server.start()
    try:
        client.connect(5)
        assert client.call(m.Ping(), timeout=5).result(5).unwrap() == m.Pong(b"ok")
        assert client.request(m.Ping(), timeout=5) == m.Pong(b"ok")
        assert client.frame_errors >= 2 and client.alive
    finally:
        server.join(5)
        client.close()
        router.close()
