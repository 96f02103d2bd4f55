"""The reference engine: a continuous-batching loop over kvproc (reference design section 5).

A request moves linearly and is always in exactly one container ("the container is the state"):
    submit -> `_resolving` (a resolve runs on the store's loop) -> `_inbox` (ready requests only, FIFO)
           -> `_running` (admitted: prefill chunks, then decode steps) -> retired (store.retire) / rejected.
A request waiting for a restore sits in `_resolving`, so it never blocks the head of the inbox.

Per step: collect finished resolves, admit from the inbox head (full-lifetime, honour-or-reject, credited by the
prefix; restore copies executed and fenced before the first step), build one batch of decode tokens plus prefill
chunks under a token budget, run the model, apply the sampled tokens, then at checkpoint boundaries seal bounded state
by copy (fenced here, before the next step writes the live slots) and hand sealed pages to the store. Greedy decoding,
so two runs of the same requests are comparable token for token.

Everything about KV (blocks, slots, checkpoints, cursors, saves) is kvproc's; the engine only calls it.

Tensor parallel (`ranks=N`): N ranks in lock step, each with its own device pool (and tier, copy worker) in the
store and its own model step (`RankedEngineModel.rank_model(r)`, `kvproc/engine/model_protocol.py`). Every request
has one `RequestKv`, prefix and seal cursor per rank: each rank resolves, seals and retires its own shard; the
ranks' holds are trimmed to their common prefix (`align_holds`) before admission, admission takes every rank or
none, and each step runs every rank on the same tokens. Rank 0's logits are sampled; another rank's that differ mean
its KV differs (a wrong restore): an error.

P/D hand-off (reference design section 6): a `handoff_out` request is prefilled only: its first sampled token is the
anchor, the partial last page is padded, every group checkpointed and everything sealed with `SaveClass.HANDOFF`, and
the request finishes with an `envelope`. A `handoff_in` request is checked against this engine's fingerprint at
intake, resolves the producer's padded chain in full-hit mode, is rejected before admission when the hit is short,
and adopts the chain with copy-on-restore of the padded page; it then only decodes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kvproc.contract import validate_layout
from kvproc.core.bounded import CopyOrder
from kvproc.core.hashing import DEFAULT_SCOPE, HashScope
from kvproc.core.holds import align_holds
from kvproc.core.request_kv import RequestKv
from kvproc.engine.checkpoints import CheckpointPolicy
from kvproc.engine.model_protocol import EngineModel, RankedEngineModel, rank_steps
from kvproc.engine.models import SeqBatchItem
from kvproc.engine.request import Request
from kvproc.store.handoff import (
    HandoffEnvelope,
    chain_key,
    check_envelope,
    check_fingerprint,
    fingerprint,
    handoff_resolve_policy,
    model_label,
    padded_chain,
)
from kvproc.store.kv_store import KvStore
from kvproc.store.types import KvPrefix, SaveClass, SealCursor


# How far a rank's logits may be from rank 0's, relative to their largest, before the engine calls its KV wrong:
# float rounding between two computations of the same pages is ~1e-6 relative; a restore of another prompt's bytes
# (or zeros, `tests/engine/test_engine_ranks.py`) is ~1e-1.
LOCK_STEP_TOLERANCE = 1e-4


@dataclass(eq=False)  # identity: entries are removed from the inbox by identity
class _Ready:
    """An inbox entry: resolved (or not resolving at all), waiting for admission."""

    req: Request
    prefixes: list[KvPrefix] | None  # one per rank, aligned to the common prefix; None: compute everything
    kvs: list[RequestKv] | None = None  # one per rank, built on the first admission attempt, reused while it waits
    # Its restore failed: admitted again without a prefix, to compute everything (a hand-off too: not rejected as
    # a short hit; its anchor is already in its output).
    recompute: bool = False

    @property
    def prefix(self) -> KvPrefix | None:
        """Rank 0's prefix (every rank's hold has its length once aligned)."""
        return self.prefixes[0] if self.prefixes is not None else None


@dataclass(eq=False)
class _Active:
    req: Request
    kvs: list[RequestKv]  # one per rank, in lock step
    cursors: list[SealCursor] | None  # one per rank; None with prefix caching off (nothing is ever saved)
    turn_end_pages: int

    @property
    def kv(self) -> RequestKv:
        """Rank 0's request: what scheduling reads (every rank's has the same tokens and computed count)."""
        return self.kvs[0]


class Engine:
    def __init__(self, model: EngineModel | RankedEngineModel, store: KvStore, *, ranks: int = 1, max_batch: int = 16,
                 chunk_tokens: int = 512, checkpoint_every_pages: int = 8, prefix_cache: bool = True,
                 scope: HashScope = DEFAULT_SCOPE, clock: Callable[[], float] = time.perf_counter,
                 handoff_barrier: bool = False, handoff_deadline_s: float = 15.0,
                 short_handoff: str = "recompute") -> None:
        if max_batch <= 0 or chunk_tokens < max_batch:
            raise ValueError(f"need max_batch > 0 and chunk_tokens >= max_batch, got {max_batch}, {chunk_tokens}")
        self.model, self.store = model, store
        if ranks < 1 or len(store.pools) != ranks:
            raise ValueError(f"ranks={ranks} needs a store of {ranks} rank(s); got a {len(store.pools)}-rank store")
        # what the engine calls on each rank (kvproc.EngineModel / kvproc.RankedEngineModel: model_protocol.py)
        self.models = rank_steps(model, ranks)
        self.ranks = range(ranks)
        self.pool = store.pools[0]
        self.max_batch, self.chunk_tokens = max_batch, chunk_tokens
        self.prefix_cache = prefix_cache and store.spec.prefix_caching
        self.scope, self.clock = scope, clock
        self.page_tokens = self.pool.page_tokens
        self.policy = CheckpointPolicy(self.page_tokens, checkpoint_every_pages)
        self._bounded = bool(store.spec.restorable_bounded_groups) and self.prefix_cache
        self._live_groups = [g.name for g in store.spec.bounded_groups]
        self._resolving: dict[str, tuple[Request, list[concurrent.futures.Future[KvPrefix]]]] = {}
        self._inbox: deque[_Ready] = deque()
        self._running: dict[str, _Active] = {}
        self.counters: Counter[str] = Counter()
        # P/D: equal fingerprints mean the other engine's KV can be restored here (shape, layout, page, hashing).
        self.fingerprint = fingerprint(model_label(model), validate_layout(model.spec(), model.arenas(0)),
                                       self.pool.hasher.algorithm)
        # "KV ready" barrier: emit a hand-off only once its Handoff saves are visible in the tier (else at once, and
        # the decode side waits for them in full-hit mode).
        self.handoff_barrier = handoff_barrier
        self.handoff_deadline_s = handoff_deadline_s
        # A hand-off whose KV the store does not hold whole by the deadline (the tier stalled, a save was lost):
        # "recompute" (the decode side computes the committed prompt itself: a slower turn, never a failed one) or
        # "reject" (the request fails as a short hit; a router may retry it through prefill).
        if short_handoff not in ("recompute", "reject"):
            raise ValueError(f"short_handoff must be 'recompute' or 'reject', got {short_handoff!r}")
        self.short_handoff = short_handoff
        self._handing_off: list[tuple[Request, list[SealCursor]]] = []
        self._checkpointing: list[_Active] = []  # hand-offs waiting for a staging slot for their boundary copy
        self._emitted: list[Request] = []
        self._finished_at_intake: list[Request] = []

    # -- intake ---------------------------------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Hand a request to the engine; its TTFT clock starts now."""
        if req.req_id in self._resolving or req.req_id in self._running:
            raise ValueError(f"request {req.req_id!r} is already in the engine")
        req.submitted_at = self.clock()
        if req.handoff_out:
            why = next((w for r in self.ranks if (w := self.store.handoff_unavailable_reason(r)) is not None), None)
            if why is None and not self.prefix_cache:
                why = "prefix caching is turned off in this engine"
            if why is not None:  # fail the turn now, with the reason: no KV computed that nobody could receive
                req.failed = f"handoff: {why}"
                req.finished_at = req.submitted_at
                self.counters["handoffs_refused"] += 1
                self._finished_at_intake.append(req)
                return
        if req.handoff_in is not None:
            self._submit_handoff(req, req.handoff_in)
            return
        if self.prefix_cache:
            self._resolve(req)
        else:
            req.ready_at = req.submitted_at
            self._inbox.append(_Ready(req, None))

    def _submit_handoff(self, req: Request, env: HandoffEnvelope) -> None:
        """Decode side: reject a producer we cannot restore (both fingerprints in the error, no fallback to
        recompute), finish at once when the anchor was EOS, else resolve the padded chain in full-hit mode."""
        if not self.prefix_cache:
            raise ValueError(f"request {req.req_id!r}: a hand-off needs prefix caching (this engine has it off)")
        check_fingerprint(self.fingerprint, env.fingerprint)
        check_envelope(env, req.req_id, self.store.pools[0].hasher, req.prompt, self.scope)
        if env.anchor_token_id is None or req.max_output_tokens <= 1:
            self.store.revoke_handoff(env.producer_req_id)  # nobody will read it
            if env.anchor_token_id is not None:
                req.output.append(env.anchor_token_id)
            req.first_token_at = req.finished_at = self.clock()
            self._finished_at_intake.append(req)
            return
        self._resolve(req)

    def _resolve(self, req: Request) -> None:
        """Start (or restart) a request's resolve: its prompt, or for a hand-off the producer's padded chain in
        full-hit mode."""
        env = req.handoff_in
        if env is None:
            futs = [self.store.submit_resolve(r, req.req_id, req.prompt, self.scope) for r in self.ranks]
        else:
            chain = padded_chain(req.prompt, env.committed_len, self.page_tokens)
            policy = handoff_resolve_policy(env.producer_req_id, self.handoff_deadline_s)
            futs = [self.store.submit_resolve(r, req.req_id, chain, self.scope, policy) for r in self.ranks]
        self._resolving[req.req_id] = (req, futs)

    @property
    def has_work(self) -> bool:
        return bool(self._resolving or self._inbox or self._running or self._handing_off or self._finished_at_intake
                    or self._checkpointing or self._emitted)

    def run(self, requests: Iterable[Request]) -> list[Request]:
        """Submit every request now and step until all are done (tests and simple drivers)."""
        reqs = list(requests)
        for r in reqs:
            self.submit(r)
        while self.has_work:
            self.step()
        return reqs

    # -- the loop -------------------------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One iteration; returns the requests that finished (completed or rejected) in it."""
        self._collect_resolved()
        self._retry_checkpoints()
        done = self._admit() + self._emit_handoffs()
        for waiting in (self._finished_at_intake, self._emitted):
            done += waiting
            waiting.clear()
        plan = self._plan()
        if not plan:
            self._idle_wait()
            return done
        batches: list[list[SeqBatchItem]] = [[] for _ in self.ranks]
        for a, n in plan:
            c = a.kv.num_computed
            toks = torch.from_numpy(a.kv.token_array()[c : c + n].copy())
            for r, kv in enumerate(a.kvs):
                batches[r].append(SeqBatchItem(toks, c, kv.schedule(n), kv.live_slots))
        logits = self.models[0].forward(batches[0])
        for r in self.ranks[1:]:
            # Lock step: every rank computed the same tokens over its own KV; its logits differ from rank 0's only
            # if its KV does (a restore that brought other bytes, a prefix of another length), or by float rounding
            # where the ranks' caches hold two computations of one page (`rank_rounding_apart`).
            theirs = self.models[r].forward(batches[r])
            if not torch.equal(theirs, logits):
                self._check_lock_step(r, plan, theirs, logits)
        self.counters["steps"] += 1
        return done + self._after_step(plan, logits)

    def _check_lock_step(self, rank: int, plan: list[tuple[_Active, int]], theirs: torch.Tensor,
                         logits: torch.Tensor) -> None:
        """Rank `rank`'s logits are not bit-equal to rank 0's. Two computations of the same tokens can be: a page one
        rank kept in its host tier from an earlier batch (its save of a later recompute found the key there and kept
        the first bytes) while the other rank, whose cache lacked it, recomputed it in another batch, and the ranks
        then restore different versions (measured: |diff| 1.2e-6 on values of 4, `bench/rank_divergence_probe.py`;
        issue 39). That is rounding, as any prefix cache's, and is counted. Another prompt's KV, or a prefix of
        another length, moves the logits by orders of magnitude more: that raises."""
        scale = float(logits.abs().max()) or 1.0
        close = torch.isclose(theirs, logits, rtol=0.0, atol=LOCK_STEP_TOLERANCE * scale).all(dim=-1)
        bad = [p[0].req.req_id for i, p in enumerate(plan) if not bool(close[i])]
        if bad:
            raise RuntimeError(f"rank {rank} diverged from rank 0 on requests {bad}: its KV differs (ranks must "
                               "restore the same prefix, each from its own shard)")
        self.counters["rank_rounding_apart"] += 1

    def _collect_resolved(self) -> None:
        for req_id in [r for r, (_, fs) in self._resolving.items() if all(f.done() for f in fs)]:
            req, futs = self._resolving.pop(req_id)
            got: list[KvPrefix] = []
            for fut in futs:
                try:
                    got.append(fut.result())
                except Exception:  # noqa: BLE001 - resolve never raises for a degrade; anything else: compute it all
                    self.counters["resolve_errors"] += 1
            prefixes: list[KvPrefix] | None = got
            if len(got) < len(futs):
                for p in got:
                    p.hold.release()
                prefixes = None
            elif len(got) > 1:
                before = got[0].hold.num_blocks
                # Each rank's pool (and tier) may hold a prefix of another length: all restore the common one.
                if align_holds([p.hold for p in got]) != before or any(p.hold.num_blocks != before for p in got):
                    self.counters["rank_holds_trimmed"] += 1
            req.ready_at = self.clock()
            self._inbox.append(_Ready(req, prefixes))

    def _admit(self) -> list[Request]:
        rejected: list[Request] = []
        while self._inbox and len(self._running) < self.max_batch:
            head = self._inbox[0]
            req = head.req
            if req.handoff_in is not None and head.kvs is None and not head.recompute and \
                    not self._handoff_hit_is_full(head):
                # Short hit, before a slot is taken: nobody will read the producer's pages now.
                got = head.prefix.hold.num_tokens if head.prefix is not None else 0
                self._inbox.popleft()
                self._drop(head)
                self.store.revoke_handoff(req.handoff_in.producer_req_id)
                if self.short_handoff == "recompute":
                    # Computed here from the prompt (the committed tokens and the anchor, whose KV the producer never
                    # wrote), as after a failed restore; the anchor is the turn's first output token already.
                    assert req.handoff_in.anchor_token_id is not None  # an EOS anchor finished at intake
                    req.output.append(req.handoff_in.anchor_token_id)
                    req.handoff_recomputed = req.handoff_in.committed_len - got
                    self.counters["handoffs_recomputed"] += 1
                    self._inbox.appendleft(_Ready(req, None, recompute=True))
                    continue
                req.failed = (f"handoff: short hit ({got} of {req.handoff_in.committed_len} tokens in the store):"
                              " retry through prefill")
                req.finished_at = self.clock()
                self.counters["handoffs_rejected"] += 1
                rejected.append(req)
                continue
            if head.kvs is None:
                head.kvs = [self._request_kv(r, req, head.prefixes[r] if head.prefixes is not None else None)
                            for r in self.ranks]
            if not self._admit_all(head):
                self.counters["admission_waits"] += 1
                if self._unblock_admission():
                    continue
                if self._never_fits():
                    self._inbox.popleft()
                    self._drop(head)
                    req.failed = "admission: the lifetime does not fit the device pool"
                    req.finished_at = self.clock()
                    self.counters["rejected"] += 1
                    rejected.append(req)
                    continue
                break
            self._inbox.popleft()
            self._start(head)
        return rejected

    def _admit_all(self, head: _Ready) -> bool:
        """Admit the request on every rank or on none, each credited by its own hold: a rank whose pool has no room
        undoes the others' admission (their requests are rebuilt at the next attempt)."""
        assert head.kvs is not None
        for i, kv in enumerate(head.kvs):
            credit = head.prefixes[i].hold.num_blocks if head.prefixes is not None else 0
            if head.prefixes is not None and head.req.handoff_in is not None and \
                    head.req.handoff_in.committed_len % self.page_tokens:
                credit -= 1  # the padded page is replaced by a private copy: one block of slack for it
            if not kv.try_admit(credit):
                if i:
                    for k in head.kvs:
                        k.release()
                    head.kvs = None
                return False
        return True

    def _handoff_hit_is_full(self, r: _Ready) -> bool:
        assert r.req.handoff_in is not None
        need = -(-r.req.handoff_in.committed_len // self.page_tokens)
        return r.prefixes is not None and all(p.hold.num_blocks == need for p in r.prefixes)

    def _request_kv(self, rank: int, req: Request, prefix: KvPrefix | None) -> RequestKv:
        pool = self.store.pools[rank]
        if req.handoff_in is None:  # the resolve hashed this very prompt in this scope: no second pass over it
            return RequestKv(pool, req.req_id, req.prompt, req.max_output_tokens, scope=self.scope,
                             prompt_hashes=prefix.page_hashes if prefix is not None else None)
        env = req.handoff_in
        assert env.anchor_token_id is not None
        # The decode side's request: the committed prompt plus the anchor (sampled by prefill, its KV not yet
        # computed); it generates the rest of the output.
        tokens = list(req.prompt[: env.committed_len]) + [env.anchor_token_id]
        return RequestKv(pool, req.req_id, tokens, req.max_output_tokens - 1, scope=self.scope)

    def _start(self, r: _Ready) -> None:
        kvs, req = r.kvs, r.req
        assert kvs is not None
        orders: list[list[CopyOrder]] = [[] for _ in self.ranks]
        if r.prefixes is not None and req.handoff_in is not None:
            env = req.handoff_in
            orders = [kv.adopt_handoff_prefix(p.hold, env.committed_len) for kv, p in zip(kvs, r.prefixes)]
            assert env.anchor_token_id is not None
            req.output.append(env.anchor_token_id)
            if any(p.host_tokens == 0 for p in r.prefixes):  # no load consumed the producer's lease: release it
                self.store.release_handoff(env.producer_req_id)
            self.counters["handoffs_adopted"] += 1
        elif r.prefixes is not None:
            orders = [kv.match_and_add_prefix(p.hold) for kv, p in zip(kvs, r.prefixes)]
        ok = True
        for rank, kv in enumerate(kvs):
            # Zeros are every model's initial bounded state; a restore then overwrites the slot with the checkpoint.
            for group, slot in kv.live_slots.items():
                self.models[rank].reset_slot(group, slot)
            ok = self.store.execute_copies(rank, orders[rank]) and ok  # fenced before the first step writes them
        if not ok:
            self._recompute_after_failed_restore(r)
            return
        hit = kvs[0].num_computed
        if any(kv.num_computed != hit for kv in kvs):
            raise RuntimeError(f"request {req.req_id!r}: ranks adopted prefixes of {[k.num_computed for k in kvs]} "
                               "tokens (aligned holds must have one length)")
        if r.prefixes is not None:
            req.device_hit_tokens = min(hit, min(p.device_tokens for p in r.prefixes))
            req.host_hit_tokens = hit - req.device_hit_tokens
        cursors = [SealCursor.after_prefix(hit // self.page_tokens) for _ in self.ranks] if self.prefix_cache \
            else None
        turn_end = self.policy.turn_end_pages(req.prompt_tokens, req.max_output_tokens)
        req.admitted_at = self.clock()
        self._running[req.req_id] = _Active(req, kvs, cursors, turn_end)
        self.counters["admitted"] += 1

    def _recompute_after_failed_restore(self, r: _Ready) -> None:
        """A restore copy failed (a copy worker crashed mid-restore): the request's live bounded state is invalid
        and it could never be scheduled. Give back its KV (the prefix blocks included) and admit it again, at the
        head of the inbox, without a prefix: it computes everything, so its tokens are what they would have been."""
        assert r.kvs is not None
        for kv in r.kvs:
            kv.release()
        self.counters["restore_failed_recomputed"] += 1
        self._inbox.appendleft(_Ready(r.req, None, recompute=True))

    def _unblock_admission(self) -> bool:
        """With nothing running, holds of requests queued behind the head can starve it (they pin blocks no one
        may evict). Release them and resolve those requests again later; True if that freed anything."""
        if self._running:
            return False
        behind = [r for r in list(self._inbox)[1:] if r.prefixes is not None and r.prefixes[0].hold.num_blocks]
        for r in behind:
            self._inbox.remove(r)
            self._drop(r)
            self._resolve(r.req)
            self.counters["holds_released_for_admission"] += 1
        return bool(behind)

    def _never_fits(self) -> bool:
        """The head can never be admitted: nothing running, nothing resolving (no hold or reservation will be
        released), no save pinning blocks, and still no room."""
        return not self._running and not self._resolving and \
            all(self.store.pinned_blocks(rank) == 0 for rank in self.ranks)

    @staticmethod
    def _drop(r: _Ready) -> None:
        for p in r.prefixes or ():
            p.hold.release()
        for kv in r.kvs or ():
            kv.release()

    def _plan(self) -> list[tuple[_Active, int]]:
        """Decode tokens first (one per decoding request), then prefill chunks in admission order under the token
        budget."""
        budget = self.chunk_tokens
        plan: list[tuple[_Active, int]] = []
        prefills: list[_Active] = []
        for a in self._running.values():
            if a.kv.num_computed == a.kv.num_tokens - 1:
                plan.append((a, 1))
                budget -= 1
            else:
                prefills.append(a)
        for a in prefills:
            if budget <= 0:
                break
            n = self.policy.prefill_chunk(a.kv.num_computed, a.req.prompt_tokens, budget, a.turn_end_pages,
                                          self._bounded)
            plan.append((a, n))
            budget -= n
        return plan

    def _after_step(self, plan: list[tuple[_Active, int]], logits: torch.Tensor) -> list[Request]:
        now = self.clock()
        sampled = logits.argmax(dim=-1).tolist()
        copy_orders: list[list[CopyOrder]] = [[] for _ in self.ranks]  # per rank
        to_seal: list[_Active] = []
        finished: list[_Active] = []
        for i, (a, n) in enumerate(plan):
            kv, req = a.kv, a.req
            before = kv.num_computed
            emits = before + n == kv.num_tokens
            if emits and req.handoff_out:
                # Prefill side of a hand-off: the sampled token is the anchor, not part of the KV; name the partial
                # last page (pad) and checkpoint the bounded state at that boundary; retire seals it all (Handoff).
                tok = int(sampled[i])
                for r, k in enumerate(a.kvs):
                    k.apply()
                    k.pad_to_boundary()
                    if self._bounded:
                        copy_orders[r].extend(k.seal_by_copy())
                req.output.append(tok)
                req.first_token_at = now
                self.counters["prefill_tokens"] += n
                finished.append(a)
                continue
            if emits:
                tok = int(sampled[i])
                for k in a.kvs:
                    k.apply([tok])
                req.output.append(tok)
                if req.keep_logits:
                    req.logits.append(logits[i].clone())
                if req.first_token_at is None:
                    req.first_token_at = now
                    self.counters["prefill_tokens"] += n
                else:
                    self.counters["decode_tokens"] += 1
                if len(req.output) >= req.max_output_tokens or (req.stop_on_eos and tok == self.model.eos_token_id):
                    finished.append(a)
            else:
                for k in a.kvs:
                    k.apply()
                self.counters["prefill_tokens"] += n
            if not self.prefix_cache:
                continue
            after = kv.num_computed
            if self._bounded:
                if after % self.page_tokens == 0 and self.policy.due(after // self.page_tokens, a.turn_end_pages):
                    for r, k in enumerate(a.kvs):
                        copy_orders[r].extend(k.seal_by_copy())
                    to_seal.append(a)
            elif self.policy.crossed(before, after, a.turn_end_pages):
                to_seal.append(a)
        to_seal = [a for a in to_seal if a not in finished]  # retire does their final seal
        # Bounded checkpoints: copied and fenced now, before the next step rewrites the live slots; the pages up to
        # them are then handed to the store (which saves up to the deepest complete checkpoint).
        for r, orders in enumerate(copy_orders):
            if orders:
                self.store.execute_copies(r, orders)
                self.counters["checkpoint_copies"] += len(orders)
        for a in to_seal:
            assert a.cursors is not None
            # A hand-off's pages must all be leased to the consumer, the ones sealed along the way included.
            for r, (k, cursor) in enumerate(zip(a.kvs, a.cursors)):
                self.store.seal(r, k, cursor, SaveClass.HANDOFF if a.req.handoff_out else SaveClass.CACHEABLE)
        done = []
        for a in finished:
            del self._running[a.req.req_id]
            if a.req.handoff_out:
                if self._bounded and not all(k.checkpoint_sealed() for k in a.kvs):
                    # No staging slot was free for the boundary copy (they are pinned by saves in flight). A hand-off
                    # must be delivered, so retry at the next steps instead of emitting an envelope no decode side
                    # could ever satisfy; the live slot is not written again meanwhile (prefill is done).
                    self._checkpointing.append(a)
                    self.counters["handoff_checkpoint_retries"] += 1
                    continue
                self._hand_off(a)  # done once emitted (now, or after the barrier)
                continue
            for r, k in enumerate(a.kvs):
                if a.cursors is not None:
                    self.store.retire(r, k, a.cursors[r])
                else:
                    k.release()
            a.req.finished_at = now
            done.append(a.req)
        return done

    def _hand_off(self, a: _Active) -> None:
        assert a.cursors is not None
        for r, (k, cursor) in enumerate(zip(a.kvs, a.cursors)):
            self.store.retire(r, k, cursor, SaveClass.HANDOFF)  # parks until the saves settle
        if self.handoff_barrier:
            self._handing_off.append((a.req, a.cursors))  # emitted once its saves are visible on every rank
            return
        self._seal_envelope(a.req)
        a.req.finished_at = self.clock()
        self._emitted.append(a.req)

    def _retry_checkpoints(self) -> None:
        for a in list(self._checkpointing):
            for r, k in enumerate(a.kvs):
                if not k.checkpoint_sealed():
                    self.store.execute_copies(r, k.seal_by_copy())
            if all(k.checkpoint_sealed() for k in a.kvs):
                self._checkpointing.remove(a)
                self._hand_off(a)

    def _seal_envelope(self, req: Request) -> None:
        tok = req.output[0]
        eos = req.stop_on_eos and tok == self.model.eos_token_id
        req.envelope = HandoffEnvelope(req.req_id, self.fingerprint, committed_len=req.prompt_tokens,
                                       anchor_token_id=None if eos else tok,
                                       chain_key=chain_key(self.store.pools[0].hasher, req.prompt, req.prompt_tokens,
                                                           self.scope))
        self.counters["handoffs_emitted"] += 1

    def _emit_handoffs(self) -> list[Request]:
        """With the KV-ready barrier: emit the hand-offs whose Handoff saves have all settled."""
        out = []
        for req, cursors in list(self._handing_off):
            if all(c.settled.is_set() for c in cursors):
                self._handing_off.remove((req, cursors))
                self._seal_envelope(req)
                req.finished_at = self.clock()
                out.append(req)
        return out

    def _idle_wait(self) -> None:
        """Nothing to compute: wait for a resolve to land or a save to unpin blocks, instead of spinning."""
        futs = [f for _, fs in self._resolving.values() for f in fs if not f.done()]
        if futs:
            concurrent.futures.wait(futs, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)
        elif self._handing_off:
            cursors = self._handing_off[0][1]
            ([c for c in cursors if not c.settled.is_set()] or cursors)[0].settled.wait(0.05)
        elif self._checkpointing:
            with contextlib.suppress(concurrent.futures.TimeoutError):
                for r in self.ranks:  # saves settling unpin staging slots
                    self.store.flush_saves(r, timeout=0.05)
        elif self._inbox:
            with contextlib.suppress(concurrent.futures.TimeoutError):
                for r in self.ranks:
                    self.store.flush_saves(r, timeout=1.0)

    # -- observe --------------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        return dict(self.counters) | {"resolving": len(self._resolving), "inbox": len(self._inbox),
                                      "running": len(self._running)}
