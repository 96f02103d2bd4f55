"""Tensor parallel: vLLM's model in one worker process per rank, kvproc's store beside vLLM's scheduler.

With `tensor_parallel_size=N` vLLM runs the scheduler-side connector in the engine-core process and one worker-side
connector in each rank's worker process (spawned, daemonic: it can start no process of its own). Each rank's KV is
its own shard (its heads), so each rank has its own host tier (`kvproc up --ranks N`, or the N tiers the connector
starts), and a page is in the cache when every rank's tier has its shard.

The store and every message to the tiers stay on the scheduler's side; a worker only copies bytes between its
vLLM blocks and its rank's tier segment, which it maps (`kvproc/store/tier_slots.py`), one copy per page each way:

- **lookup**: the scheduler leases the prefix on every rank's tier (`RankedTier.lookup`) and keeps the shortest:
  every rank restores the same pages. The load job names each rank's slots and their generations; each worker
  copies its own and checks them after the copy (`TierSlots.intact`).
- **save**: the scheduler reserves the pages' slots on every rank's tier when it plans the save, before the forward
  that computes them; each worker writes its rank's slots holding that save's fence, after the forward; the
  scheduler commits each rank's save when that rank's worker reports it written.
- **bounded groups**: a sliding window gives blocks back, and vLLM may give an offered state's block to another
  request, from the next step's scheduling on: each rank lands the step's saves before its next forward (the step's
  metadata names them: `flush_jobs`). A state group's checkpoint is saved with the pages it closes, in the same job:
  the scheduler reserves the pages and the checkpoint's slots on every rank's tier where vLLM offered the state in
  this step (`boundary_state_offloads`), and each rank copies its shard of the state after the forward. A lookup hits
  only where every rank's tier has the checkpoint at the same depth.
- workers report each job's end (`KvprocWorkerMeta`, vLLM's worker -> scheduler channel, aggregated over the ranks
  by vLLM); a job is settled when every rank reported it, and ok only if every rank's part was.

Everything a rank needs from the store travels in the step's metadata (`TierAttach`, the jobs' slots and fences);
nothing of the store is shared in memory but the tiers' segments. A tier replaced under the engine (`kvproc up`
restarted on its runtime dir, re-attached by the store) is named anew in the next step's `TierAttach` (its segment
and epoch), and each worker maps it before its next copy; a load leased from the old tier is refused by its epoch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from kvproc.tiers.host_index import Hit, SaveClass, SaveTicket
from kvproc.tiers.layout import HostLayout

if TYPE_CHECKING:
    from kvproc.store.host_direct import HostDirect


# The longest vLLM's scheduler waits for a save's reservations on the ranks' tiers (each usually answers in well under
# a millisecond): past it the save is skipped (a future miss), rather than hold every request's step for a stalled
# tier until its call deadline.
RESERVE_WAIT_S = 0.25


@dataclass(frozen=True)
class TierAttach:
    """Where each rank's host tier keeps its slots: sent in every step's metadata (a few names), mapped by each worker
    before its first copy, and again when a rank's epoch changes (its tier was replaced: `kvproc up` restarted on its
    runtime dir, re-attached by the store), in place of the old mapping."""

    segments: tuple[str, ...]
    layouts: tuple[HostLayout, ...]
    # Each rank's tier attachment (`RemoteTier.epoch`): a load job carries its leases' (`CopyJob.rank_epochs`), and a
    # worker mapped to another epoch refuses it (the slots are another tier's). A save needs none: its fence token
    # is random per tier, so it claims nothing in another tier's segment (`save_fence.claim`).
    epochs: tuple[int, ...] = ()


@dataclass(frozen=True)
class RankSave:
    """One rank's part of a save: its slots (None: that rank's tier has the page already), the state groups' slots of
    the checkpoint at its last page (those that rank's tier does not have yet) and the save's fence."""

    slots: tuple[int | None, ...]
    fence: int
    token: int
    bounded: dict[str, int | None] = field(default_factory=dict)  # None: that rank's tier has it already


class KvprocWorkerMeta(KVConnectorWorkerMetadata):
    """The jobs each rank's worker finished since its last report: (rank, job id) -> ok. vLLM merges the ranks'."""

    def __init__(self, done: dict[tuple[int, int], bool]) -> None:
        self.done = done

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvprocWorkerMeta)
        return KvprocWorkerMeta({**self.done, **other.done})


@dataclass
class _Pending:
    ranks: int
    saves: list[SaveTicket] | None  # a save's tickets, one per rank (None: a load)
    reported: dict[int, bool] = field(default_factory=dict)


class RankedTier:
    """The scheduler side: one `HostDirect` per rank's tier (their calls run on the store's loop), and the jobs whose
    ranks have not all reported. A REPLICATED model (every rank holds the same KV: an MLA latent) has one tier for all
    `ranks`: rank 0 writes its saves, every rank loads from it."""

    def __init__(self, directs: Sequence["HostDirect"], ranks: int) -> None:
        self.directs = list(directs)
        self.ranks = ranks
        self.replicated = len(self.directs) == 1 < ranks
        if len(self.directs) not in (1, ranks):
            raise ValueError(f"{len(self.directs)} host tiers for {ranks} ranks: one per rank, or one (REPLICATED)")
        self._pending: dict[int, _Pending] = {}
        self._reports: dict[tuple[int, int], bool] = {}
        self._lock = threading.Lock()  # reports arrive on vLLM's output path, settle on its scheduler path

    def per_rank(self, items: list[Any]) -> list[Any]:
        """One item per tier -> one per rank (a REPLICATED model's ranks all use its one tier's)."""
        return items * self.ranks if self.replicated else items

    @property
    def attach(self) -> TierAttach:
        return TierAttach(tuple(self.per_rank([d.segment for d in self.directs])),
                          tuple(self.per_rank([d.layout for d in self.directs])),
                          tuple(self.per_rank([d.epoch for d in self.directs])))

    def follow_replaced(self) -> bool:
        """A rank's tier replaced under the engine (the store re-attached it: another `RemoteTier.epoch`): this side's
        mapping of it moves to the new segment (the old one let go of), so that the next `attach` names it to the
        workers. True when one moved. On the scheduler's thread: nothing on this side copies through the views."""
        moved = False
        for d in self.directs:
            old = d.remap_if_replaced()
            if old is not None:
                old.close()
                moved = True
        return moved

    # ---- loads ----
    def lookup(self, req_id: str, hashes: list[bytes]) -> concurrent.futures.Future[list[Hit] | None]:
        """Lease the prefix on every rank's tier; the hit is the shortest one (each rank's lease covers at least its
        pages), None when one rank has none of it (every lease released)."""
        return self.directs[0].store.submit(self._lookup(req_id, hashes))

    async def _lookup(self, req_id: str, hashes: list[bytes]) -> list[Hit] | None:
        got = await asyncio.gather(*(d.lease_prefix(req_id, hashes) for d in self.directs))
        hits = [h for h in got if h is not None]
        pages = min((h.pages for h in hits), default=0) if len(hits) == len(self.directs) else 0
        # A model with state groups restores only where a checkpoint is, on every rank: each rank's hit ends at its
        # deepest one, so ranks that disagree (one rank's save failed) have no common checkpoint to trust. Their
        # saves commit together, so this is rare: a miss, not a second round of queries.
        if pages and any(h.bounded_slots for h in hits) and any(h.pages != pages for h in hits):
            self.directs[0].store.outcomes.record("resolve", req_id, "degraded", "ranks_checkpoints_differ")
            pages = 0
        if not pages:
            for d, h in zip(self.directs, got):
                if h is not None:
                    d.tier.release_lease(h.lease_id)
            return None
        # Trimmed to the common prefix (a paged model: any page boundary will do); one per rank.
        return self.per_rank([Hit(pages, h.lease_id, h.page_slots[:pages], h.bounded_slots, h.page_gens[:pages],
                                   h.epoch) for h in hits])

    def release(self, leases: Sequence[Hit]) -> None:
        for d, h in zip(self.directs, leases):  # a REPLICATED model's: its one tier's lease, once
            d.release(h.lease_id)

    def expect_load(self, job_id: int) -> None:
        with self._lock:
            self._pending[job_id] = _Pending(self.ranks, None)

    # ---- saves ----
    def reserve(self, job_id: int, req_id: str, keys: list[bytes], parent: bytes | None,
                tokens: list[int] | None, save_class: SaveClass = SaveClass.CACHEABLE,
                bounded_groups: Sequence[str] = ()) -> list[RankSave] | None:
        """Reserve the pages' slots on every rank's tier at once (None, and whatever was reserved given back, when
        one cannot take them: the save is lost, recorded per rank). vLLM's scheduler thread waits for this, so at
        most `RESERVE_WAIT_S`: a slower tier (stalled) loses the save, and the reservations that land later are
        given back as they land."""
        async def every_rank() -> list[SaveTicket | None]:
            return list(await asyncio.gather(*(
                d.reserve_async(req_id, keys, bounded_groups=bounded_groups, save_class=save_class, parent=parent,
                                tokens=tokens)
                for d in self.directs)))

        fut = self.directs[0].store.submit(every_rank())
        try:
            got = fut.result(RESERVE_WAIT_S)
        except concurrent.futures.TimeoutError:
            fut.add_done_callback(functools.partial(self._give_back, "reserve_too_slow"))
            return None
        if any(t is None for t in got):
            self._give_back("another_rank_refused", fut)
            return None
        tickets = [t for t in got if t is not None]
        with self._lock:
            self._pending[job_id] = _Pending(self.ranks, tickets)
        saves = [RankSave(tuple(t.page_slots), t.fence, t.fence_token, dict(t.bounded_slots)) for t in tickets]
        if self.replicated:  # rank 0 writes the one copy; the others have nothing to write (and report it)
            saves += [RankSave((None,) * len(keys), 0, 0)] * (self.ranks - 1)
        return saves

    def _give_back(self, reason: str, fut: concurrent.futures.Future[list[SaveTicket | None]]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        for d, t in zip(self.directs, fut.result()):
            if t is not None:
                d.abort(t, reason)

    # ---- reports ----
    def report(self, meta: KVConnectorWorkerMetadata | None) -> None:
        """A step's worker reports (vLLM's output path): kept until the scheduler side settles them."""
        if isinstance(meta, KvprocWorkerMeta) and meta.done:
            with self._lock:
                self._reports.update(meta.done)

    def settled(self) -> list[tuple[int, bool]]:
        """Jobs every rank has reported since the last call: (job id, ok). A rank's save is committed (or its slots
        given back) as soon as that rank reported it."""
        with self._lock:
            reports, self._reports = self._reports, {}
        out = []
        for (rank, job_id), ok in sorted(reports.items()):
            with self._lock:
                p = self._pending.get(job_id)
            if p is None or rank in p.reported:
                continue
            if p.saves is not None and rank < len(p.saves):  # (a REPLICATED model's other ranks saved nothing)
                d, t = self.directs[rank], p.saves[rank]
                if ok:
                    ok = d.commit(t)
                else:
                    d.abort(t, "write_failed")
            p.reported[rank] = ok
            if len(p.reported) == p.ranks:
                with self._lock:
                    self._pending.pop(job_id, None)
                out.append((job_id, all(p.reported.values())))
        return out

    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        """Saves no rank will report any more (shutdown): their slots go back now rather than at the tier's TTL."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for p in pending.values():
            for rank, t in enumerate(p.saves or ()):
                if rank not in p.reported:
                    self.directs[rank].abort(t, "shutdown")


@dataclass
class WorkerRuntime:
    """A TP worker's share of the runtime: its moves and counters (the store is in the scheduler's process)."""

    counters: dict[str, int] = field(default_factory=dict)
    moves: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n
