"""The engine fence on the wire (issue 19): `SaveOrder.after_event` and `DeviceCopy.after_event`, a CUDA IPC event
handle, round trip with and without one, and stay compatible both ways with a peer that predates them (the field is
last, with a default)."""

from __future__ import annotations

import msgspec

from kvproc.ipc import messages as m
from kvproc.ipc.orders import BoundedCopy, SaveOrder, SlotCopy

HANDLE = bytes(range(64))  # the size of a cudaIpcEventHandle_t


class _SaveOrderBeforeFence(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """`SaveOrder` as an older peer has it (test only): everything up to the save fence, no `after_event`."""

    req_id: str
    device_blocks: list[int]
    host_slots: list[int]
    bounded: list[BoundedCopy] = []
    fence: int = -1
    fence_token: int = 0


def _through_the_server(body: m.RequestBody) -> m.RequestBody:
    got = m.server_decoder().decode(m.encode(m.Call(1, 0, body)))
    assert isinstance(got, m.Call)
    return got.body


def test_a_save_order_round_trips_with_and_without_an_engine_event() -> None:
    plain = SaveOrder("r", [1, 2], [5, 6], [BoundedCopy("state", 0, 3)], 4, 77)
    fenced = msgspec.structs.replace(plain, after_event=HANDLE)
    for order in (plain, fenced):
        assert _through_the_server(m.Save(order)) == m.Save(order)
    assert plain.after_event is None
    got = _through_the_server(m.Save(fenced))
    assert isinstance(got, m.Save) and got.order.after_event == HANDLE


def test_a_device_copy_round_trips_with_and_without_an_engine_event() -> None:
    copies = [SlotCopy("state", 0, 4), SlotCopy("state", 1, 5)]
    plain = m.DeviceCopy(copies, 3, 9)
    fenced = m.DeviceCopy(copies, 3, 9, HANDLE)
    assert plain.after_event is None
    for msg in (plain, fenced):
        assert _through_the_server(msg) == msg


def test_an_older_peers_save_order_decodes_and_a_newer_one_is_read_by_it() -> None:
    old = _SaveOrderBeforeFence("r", [1], [2], [], 4, 77)
    # an older store's order: no trailing item, so no fence
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=SaveOrder) == SaveOrder("r", [1], [2], [], 4, 77)
    # an older worker reading a newer order: the trailing item is ignored, every other field intact
    new = SaveOrder("r", [1], [2], [], 4, 77, HANDLE)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=_SaveOrderBeforeFence) == old
    # what no fence costs on the wire: one msgpack nil
    assert len(msgspec.msgpack.encode(SaveOrder("r", [1], [2], [], 4, 77))) == len(msgspec.msgpack.encode(old)) + 1
