"""The copy worker's attach over CUDA IPC arena references: what runs on CPU (the wire form, the handle it names,
the device and geometry checks and the refusals, in a real copy worker process) and the GPU round trip, skipped
without CUDA (it has never run: no GPU where it was written)."""

from __future__ import annotations

import pytest
import torch

from kvproc.ipc import messages as m
from kvproc.ipc.cuda_ipc import CudaArenaHandle
from kvproc.ipc.errors import RemoteError
from kvproc.store.cluster import ClusterStore
from kvproc.workers.device_attach import cuda_handle
from tests.conftest import churn, cluster_store, compute

pytestmark = pytest.mark.timeout(60)
CUDA = torch.cuda.is_available()


def _cuda_ref(**kw: object) -> m.ArenaRef:
    ipc = m.CudaIpcRef(0, b"\x01handle", 1000, 0, b"\x02rc", 8, b"\x03ev", True)
    base: dict[str, object] = {"group": "kv", "kind": "paged", "name": "k0", "segment": "", "offset": 100,
                               "num_blocks": 4, "bytes_per_block": 200, "block_stride": 220, "cuda": ipc}
    base.update(kw)
    return m.ArenaRef(**base)  # type: ignore[arg-type]


def test_a_cuda_arena_reference_crosses_the_wire_and_names_its_handle() -> None:
    msg = m.AttachArenas([_cuda_ref()], "", mover="torch")
    got = m.server_decoder().decode(m.encode(m.Call(1, 0, msg)))
    assert got.body == msg and got.body.arenas[0].cuda.storage_handle == b"\x01handle"
    assert cuda_handle(got.body.arenas[0]) == CudaArenaHandle(
        "k0", m.CudaIpcRef(0, b"\x01handle", 1000, 0, b"\x02rc", 8, b"\x03ev", True), 100, 4, 200, 220)
    # an old peer's ArenaRef (no cuda field) still decodes: the field is last and defaults to None
    plain = m.AttachArenas([m.ArenaRef("kv", "paged", "k0", "seg", 0, 4, 200, 200)], "")
    assert m.server_decoder().decode(m.encode(m.Call(2, 0, plain))).body.arenas[0].cuda is None


def _attach(cs: ClusterStore, msg: m.AttachArenas) -> None:
    cs.cluster.client("copy_worker").request(msg, timeout=10)


@pytest.mark.skipif(CUDA, reason="the CPU-side refusals (with CUDA the good handle would be opened)")
def test_a_copy_worker_checks_a_cuda_arena_on_cpu_and_refuses_it_clearly() -> None:
    """In a real copy worker (rank 0, so bound to cuda:0): the device and geometry are checked before anything is
    opened; a handle that passes them is refused because this worker has no CUDA device; mixing CUDA and
    shared-memory arenas, an unknown mover kind, a CUDA mover for shared-memory arenas and a CPU one for CUDA arenas
    are refused at attach."""
    with ClusterStore.start(0) as cs:
        with pytest.raises(RemoteError, match=r"bad_request.*bound to cuda:0"):
            _attach(cs, m.AttachArenas([_cuda_ref(cuda=m.CudaIpcRef(1, b"h", 1000, 0, b"", 0, b"", False))], ""))
        with pytest.raises(RemoteError, match=r"bad_request.*outside the shared storage"):
            _attach(cs, m.AttachArenas([_cuda_ref(offset=141)], ""))  # 141 + 3 * 220 + 200 = 1001 > 1000
        with pytest.raises(RemoteError, match=r"no_cuda.*k0"):
            _attach(cs, m.AttachArenas([_cuda_ref()], ""))
        shm = m.ArenaRef("kv", "paged", "k1", "nosuchsegment", 0, 4, 200, 200)
        with pytest.raises(RemoteError, match=r"bad_request.*mixes"):
            _attach(cs, m.AttachArenas([_cuda_ref(), shm], ""))
        with pytest.raises(RemoteError, match=r"bad_request.*no mover kind 'bogus'"):
            _attach(cs, m.AttachArenas([shm], "", mover="bogus"))
        with pytest.raises(RemoteError, match=r"bad_request.*cuda_mapped mover moves between a CUDA device"):
            _attach(cs, m.AttachArenas([shm], "", mover="cuda_mapped"))  # shared-memory arenas: not a CUDA mover's
        with pytest.raises(RemoteError, match=r"bad_request.*GPU arenas move with the cuda or cuda_mapped mover"):
            _attach(cs, m.AttachArenas([_cuda_ref()], "", mover="memmove"))
        stats = cs.cluster.client("copy_worker").request(m.Stats(), timeout=5).counters
        assert "attaches" not in stats  # none of them attached anything


@pytest.mark.skipif(not CUDA, reason="no CUDA device (torch.cuda.is_available() is False): the GPU attach has "
                                     "never run")
@pytest.mark.parametrize("copy_mover", ["", "cuda_mapped"])
def test_gpu_arenas_round_trip_through_cuda_ipc_and_the_cuda_mover(copy_mover: str) -> None:
    """NEVER RUN. The model's arenas are CUDA tensors: the store exports them by CUDA IPC, the worker opens them on
    its device, pins the host segment and moves with the cuda mover (or, asked, the cuda_mapped one); save, evict,
    restore are bit-exact."""
    def gpu(name: str, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.uint8, device="cuda:0")

    with cluster_store(bounded=True, allocator=gpu, copy_mover=copy_mover) as (cs, store, model):
        toks = list(range(1, 17))
        kv, cur, _, written = compute(store, model, "a", toks)
        store.retire(0, kv, cur)
        store.flush_saves(0, 10)
        churn(store)
        model.zero()
        pre = store.resolve_prefix_sync(0, "b", toks + [1])
        assert pre.host_tokens == 16
        for i, b in enumerate(pre.hold.block_ids):
            exp = written[pre.hold.hashes[i]]
            assert torch.equal(model.block(0, b), exp[0]) and torch.equal(model.block(1, b), exp[1])
        pre.hold.release()
        worker = cs.cluster.client("copy_worker").request(m.Stats(), timeout=5).counters
        name = copy_mover or "cuda"
        assert worker[f"mover_orders.{name}"] == worker["orders_save"] + worker["orders_load"] >= 2


def test_pin_host_turns_a_pin_failure_into_a_clear_attach_error_with_a_stub_register(monkeypatch) -> None:
    """One side of the contract (`pinning.register` stubbed to fail as cudaHostRegister would): the attach is refused
    with `pin_failed` and CUDA's message, never a silent pageable copy. The real register has never run on a GPU."""
    from kvproc.ipc import pinning
    from kvproc.ipc.errors import HandlerError
    from kvproc.ipc.segment import Segment
    from kvproc.workers.device_attach import pin_host

    def failing(seg: Segment) -> bool:
        raise pinning.PinError(f"cudaHostRegister({seg.name}, {seg.nbytes} B) failed: CUDA error 1 (invalid argument)")

    monkeypatch.setattr(pinning, "register", failing)
    with Segment.create("pintest", "copy_worker", 1 << 12) as seg:
        with pytest.raises(HandlerError, match="cudaHostRegister.*invalid argument") as e:
            pin_host(seg)
        assert e.value.code == "pin_failed"
