"""`kvproc.workers.cma`: cross-memory attach between two real processes (the way a copy worker reaches KV tensors an
engine such as vLLM allocated in its own private memory). No vLLM needed, but it is the vLLM connector's mover."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import numpy as np
import pytest

from kvproc.workers.cma import CmaError, CmaMover, block_spans

BLOCK = 4096
N = 64


def _owner(conn: Any) -> None:
    """The 'engine': private (not shared) memory with a known pattern; reports its address, then serves checks."""
    arr = np.arange(N * BLOCK, dtype=np.uint32).astype(np.uint8).reshape(N, BLOCK)
    arr[:] = (np.arange(N)[:, None] * 7 + np.arange(BLOCK)[None, :]) % 251
    conn.send(arr.ctypes.data)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        conn.send(arr[msg].copy())


@pytest.fixture()
def owner() -> Any:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_owner, args=(child,), daemon=True)
    p.start()
    addr = parent.recv()
    yield p.pid, addr, parent
    parent.send(None)
    p.join(10)
    if p.is_alive():
        p.kill()


def test_read_and_write_scattered_blocks_of_another_process(owner: Any) -> None:
    if not CmaMover.available():
        pytest.skip("no process_vm_readv in this libc")
    pid, addr, conn = owner
    mover = CmaMover(pid)
    local = np.zeros((8, BLOCK), dtype=np.uint8)
    remote_ids = [3, 4, 5, 10, 11, 40, 2, 63]  # runs and scattered blocks
    spans = block_spans(addr, remote_ids, local.ctypes.data, list(range(8)), BLOCK)
    assert len(spans) == 5  # 3-5 and 10-11 coalesced (local ids are consecutive too)
    assert mover.read(spans) == 8 * BLOCK
    for i, b in enumerate(remote_ids):
        expect = (b * 7 + np.arange(BLOCK)) % 251
        assert np.array_equal(local[i], expect.astype(np.uint8))
    # Write them back, negated, into other blocks of the owner; the owner sees them.
    local[:] = 255 - local
    assert mover.write(block_spans(addr, [20, 21, 22, 23, 24, 25, 26, 27], local.ctypes.data, list(range(8)),
                                   BLOCK)) == 8 * BLOCK
    for i in range(8):
        conn.send(20 + i)
        assert np.array_equal(conn.recv(), local[i])


def test_a_bad_address_raises_with_the_errno_and_no_silent_partial_copy(owner: Any) -> None:
    pid, addr, _ = owner
    local = np.zeros(BLOCK, dtype=np.uint8)
    with pytest.raises(CmaError) as e:
        CmaMover(pid).read([(8, local.ctypes.data, BLOCK)])  # page 0 is never mapped
    assert "EFAULT" in str(e.value)
