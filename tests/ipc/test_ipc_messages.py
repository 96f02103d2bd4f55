"""The wire types: unique tags, typed round trips, and typed rejection of anything else (no processes needed)."""

from __future__ import annotations

import re
from typing import get_args

import msgspec
import pytest

from kvproc.ipc import messages as m
from kvproc.ipc.errors import CallCancelled, PeerDeadError, RemoteError


def test_every_wire_type_has_a_unique_int_tag() -> None:
    tags = [m.tag_of(cls) for cls in m.ALL_TYPES]
    assert len(tags) == len(set(tags))


def test_module_docstring_tag_table_matches_the_types() -> None:
    table = dict(re.findall(r"^\| (\d+)\s+\| (\w+)", m.__doc__ or "", re.M))
    assert {int(k): v for k, v in table.items()} == {m.tag_of(c): c.__name__ for c in m.ALL_TYPES}


def test_unions_and_type_tuples_agree() -> None:
    assert set(get_args(m.RequestBody)) == set(m.REQUEST_TYPES)
    assert set(get_args(m.PayloadBody)) == set(m.PAYLOAD_TYPES)


@pytest.mark.parametrize(
    "msg",
    [
        m.Hello(m.PROTOCOL_VERSION, "tok", "c"),
        m.Call(7, 123, m.Sleep(1.5, 0.01), token=99),
        m.Call(8, 1, m.Ping(b"\x00\xff")),
        m.Cancel(99),
        m.Heartbeat(3),
    ],
)
def test_client_messages_round_trip_through_the_server_decoder(msg: m.Wire) -> None:
    assert m.server_decoder().decode(m.encode(msg)) == msg


@pytest.mark.parametrize(
    "msg",
    [
        m.Ok(1, m.StatsReport("host_tier", 0, 1, 0.5, 10, 2, 0, 0, 0, 1, 1, 0, {"a": 1}, ["seg"])),
        m.Ok(2, m.Done()),
        m.Failed(3, "internal", "ValueError", "x"),
        m.Cancelled(4, 5),
        m.Goodbye("bye"),
        m.Refused("protocol_mismatch", "m"),
    ],
)
def test_server_messages_round_trip_through_the_client_decoder(msg: m.Wire) -> None:
    assert m.client_decoder().decode(m.encode(msg)) == msg


def test_unknown_tag_and_wrong_direction_are_typed_decode_errors() -> None:
    with pytest.raises(msgspec.ValidationError):
        m.server_decoder().decode(msgspec.msgpack.encode([9999, 1]))
    with pytest.raises(msgspec.ValidationError):  # a reply is not something a server accepts
        m.server_decoder().decode(m.encode(m.Ok(1, m.Done())))
    with pytest.raises(msgspec.DecodeError):
        m.client_decoder().decode(m.encode(m.Ok(1, m.Done()))[:-1])


def test_terminal_replies_unwrap_to_payload_or_typed_exceptions() -> None:
    assert m.Ok(1, m.Pong(b"x")).unwrap() == m.Pong(b"x")
    with pytest.raises(RemoteError) as err:
        m.Failed(1, "c", "KeyError", "k").unwrap()
    assert (err.value.code, err.value.exc_type) == ("c", "KeyError")
    with pytest.raises(CallCancelled):
        m.Cancelled(1, 5).unwrap()
    with pytest.raises(PeerDeadError):
        m.PeerDead(1, "gone").unwrap()


def test_version_mismatch_message_names_both_versions() -> None:
    text = m.version_mismatch_message(3, 4)
    assert "3" in text and "4" in text
