"""`RequestKv`: one request's KV on one rank, from admission to release.

Life of a request: `try_admit(credited)` (full-lifetime, honor-or-reject) -> `match_and_add_prefix(hold)` (consumes
the probe's hold; returns RESTORE copy orders for bounded groups) -> `schedule(n)` / `apply(sampled)` (or `revert()`)
per prefill chunk or decode step -> `seal_by_copy()` at checkpoint boundaries -> `release()` (or garbage collection).

Pages are sealed in place: `apply` registers every page that became full in the prefix index (its KV is final once
the step that wrote it has synchronized, which is when the engine calls `apply`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from kvproc.core.bounded import CopyKind, CopyOrder
from kvproc.core.hashing import DEFAULT_SCOPE, PAD_TOKEN_ID, BlockHasher, HashScope, PageHashes
from kvproc.core.holds import PrefixHold
from kvproc.core.ownership import require_type

if TYPE_CHECKING:
    from kvproc.core.pool import BlockPool


class RequestStateError(RuntimeError):
    """A RequestKv method was called in a state where it is not allowed (the message says which)."""


class LifetimeExceededError(RequestStateError):
    """A request tried to grow past the lifetime (prompt + max output) it was admitted with."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _TokenBuffer:
    """A growable int64 token array: prompts are long (no per-token Python list), decode appends one at a time."""

    def __init__(self, tokens: Sequence[int] | np.ndarray) -> None:
        # An array is cast straight into the buffer (one pass; an int32 prompt of 12 k tokens would otherwise be
        # converted into a temporary first, then copied).
        arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens, dtype=np.int64)
        if arr.ndim != 1:
            raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
        # Room for decode to append an eighth of the prompt before the first regrowth (which doubles): twice the
        # prompt, as before, put a 12 k-token prompt's buffer above malloc's mmap threshold, so every request
        # mapped and faulted in fresh pages (5 us against 2 us for the copy alone).
        self._buf = np.empty(max(16, arr.size + arr.size // 8), dtype=np.int64)
        self._buf[: arr.size] = arr
        self.n = arr.size

    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if self.n + arr.size > self._buf.size:
            grown = np.empty(2 * (self.n + arr.size), dtype=np.int64)
            grown[: self.n] = self._buf[: self.n]
            self._buf = grown
        self._buf[self.n : self.n + arr.size] = arr
        self.n += arr.size

    def view(self) -> np.ndarray:
        return self._buf[: self.n]


@dataclass
class KvState:
    """Everything a release needs, kept apart from the `RequestKv` so a GC finaliser can release it."""

    req_id: str
    lifetime: int
    admitted: bool = False
    released: bool = False
    pending_credit: int = 0
    block_ids: list[int] = field(default_factory=list)
    live: dict[str, int] = field(default_factory=dict)
    open_orders: dict[int, CopyOrder] = field(default_factory=dict)
    scheduled: tuple[int, int] | None = None  # (tokens, blocks drawn) of the step in flight
    restore_failed: bool = False
    # shared block -> paged groups whose PRIVATIZE copy is still out; the block is released when it reaches zero
    privatizing: dict[int, int] = field(default_factory=dict)

    @property
    def contribution(self) -> int:
        """This request's share of the pool's `entitled`: blocks it may still draw."""
        if not self.admitted or self.released:
            return 0
        return self.lifetime - len(self.block_ids) - self.pending_credit

    def release_locked(self, pool: "BlockPool") -> None:
        if self.released:
            return
        pool.entitled -= self.contribution
        pool.admitted_states.pop(id(self), None)
        self.released = True
        self.scheduled = None
        pool.paged.release(self.block_ids)
        self.block_ids = []
        busy = self._busy_live()
        for group, slot in list(self.live.items()):
            # A live slot an unfenced copy still reads or writes goes back only when that copy settles.
            if (group, slot) not in busy:
                pool.slabs[group].give_live(slot)
                del self.live[group]

    def _busy_live(self) -> set[tuple[str, int]]:
        """(group, live slot) pairs an unfenced copy order still reads (SEAL) or writes (RESTORE)."""
        return {(o.group, o.dst_slot if o.kind is CopyKind.RESTORE else o.src_slot)
                for o in self.open_orders.values() if o.kind is not CopyKind.PRIVATIZE}

    def order_settled(self, pool: "BlockPool", order: CopyOrder, ok: bool) -> None:
        self.open_orders.pop(order.order_id, None)
        if order.kind in (CopyKind.RESTORE, CopyKind.PRIVATIZE) and not ok:
            self.restore_failed = True
        if order.kind is CopyKind.PRIVATIZE:
            left = self.privatizing[order.src_slot] - 1
            if left:
                self.privatizing[order.src_slot] = left
            else:
                del self.privatizing[order.src_slot]
                pool.paged.release([order.src_slot])  # the shared page: back to the cache, still matchable
        if self.released:
            busy = self._busy_live()
            for group, slot in list(self.live.items()):
                if (group, slot) not in busy:
                    pool.slabs[group].give_live(slot)
                    del self.live[group]


class RequestKv:
    def __init__(
        self,
        pool: "BlockPool",
        req_id: str,
        prompt_tokens: Sequence[int] | np.ndarray,
        max_output_tokens: int,
        *,
        scope: HashScope = DEFAULT_SCOPE,
        hasher: BlockHasher | None = None,
        prompt_hashes: Sequence[bytes] | None = None,
    ) -> None:
        if max_output_tokens < 0:
            raise ValueError(f"max_output_tokens must be >= 0, got {max_output_tokens}")
        require_type(scope, HashScope, "scope")
        self.pool = pool
        self.req_id = req_id
        self.scope = scope
        self.page_tokens = pool.page_tokens
        self._hasher = hasher or pool.hasher
        self._tokens = _TokenBuffer(prompt_tokens)
        if not self._tokens.n:
            raise ValueError(f"request {req_id!r}: empty prompt")
        if prompt_hashes is None:
            self._hashes: list[bytes] = self._hasher.hash_prompt(self._tokens.view(), scope)
        else:
            self._hashes = self._checked_hashes(prompt_hashes)
        self.lifetime_blocks = _cdiv(self._tokens.n + max_output_tokens, self.page_tokens)
        self.num_computed = 0
        self._registered = 0  # pages registered in the prefix index
        self._s = KvState(req_id=req_id, lifetime=self.lifetime_blocks)
        self._finalize = weakref.finalize(self, pool.defer_release, self._s)

    def _checked_hashes(self, prompt_hashes: Sequence[bytes]) -> list[bytes]:
        """The resolve's chain, once it is shown to be this prompt's: hashes of another prompt (or scope, or model)
        would index this request's KV under that prompt's keys, and its next reader would be served this KV."""
        if not isinstance(prompt_hashes, PageHashes):
            raise TypeError(f"request {self.req_id!r}: prompt_hashes must be the `KvPrefix.page_hashes` of the "
                            f"resolve of this prompt (a PageHashes), got {type(prompt_hashes).__name__}: hashes "
                            "that cannot be checked against the prompt are not taken")
        full = self._tokens.n // self.page_tokens
        if len(prompt_hashes) != full:
            raise ValueError(f"request {self.req_id!r}: {len(prompt_hashes)} prompt hashes for {full} full pages of "
                             f"{self._tokens.n} tokens")
        why = prompt_hashes.covers(self._hasher, self._tokens.view(), self.scope)
        if why is not None:
            raise ValueError(f"request {self.req_id!r}: prompt_hashes refused: {why}")
        return list(prompt_hashes)

    # -- views ----------------------------------------------------------------------------------------------------
    @property
    def identity(self) -> object:
        """An object unique to this request for its whole life (its state): what a handle bound to it compares."""
        return self._s

    @property
    def tokens(self) -> list[int]:
        return self._tokens.view().tolist()

    def token_array(self) -> np.ndarray:
        """The known tokens as a read-only int64 view (no copy)."""
        v = self._tokens.view()
        v.flags.writeable = False
        return v

    @property
    def num_tokens(self) -> int:
        return self._tokens.n

    @property
    def block_ids(self) -> list[int]:
        return list(self._s.block_ids)

    @property
    def live_slots(self) -> dict[str, int]:
        return dict(self._s.live)

    @property
    def page_hashes(self) -> list[bytes]:
        """Hashes of the full pages known so far (prompt pages plus pages filled by apply / pad_to_boundary)."""
        return list(self._hashes)

    @property
    def admitted(self) -> bool:
        return self._s.admitted

    @property
    def released(self) -> bool:
        return self._s.released

    def block_generations(self) -> np.ndarray:
        with self.pool.lock:
            return self.pool.paged.generations(self._s.block_ids)

    def _require(self, cond: bool, what: str) -> None:
        if not cond:
            raise RequestStateError(f"request {self.req_id!r}: {what}")

    # -- admission ------------------------------------------------------------------------------------------------
    def try_admit(self, credited: int = 0) -> bool:
        """Full-lifetime admission, honor-or-reject. `credited` is the number of blocks the prefix hold will bring
        (`hold.num_blocks`), which the pool need not supply. On success the request is entitled to draw the rest of
        its lifetime and every such draw is guaranteed; it also gets a live slot in every bounded group."""
        s, pool = self._s, self.pool
        self._require(not s.released, "released")
        self._require(not s.admitted, "already admitted")
        if not 0 <= credited <= s.lifetime:
            raise ValueError(f"credited must be in [0, {s.lifetime}], got {credited}")
        pool.drain_deferred()
        with pool.lock:
            need = s.lifetime - len(s.block_ids) - credited
            if pool.paged.available < pool.entitled + need or any(
                not slab.live_free for slab in pool.slabs.values()
            ):
                pool.counters["admission_rejected"] += 1
                return False
            s.live = {g: slab.take_live() for g, slab in pool.slabs.items()}  # type: ignore[misc]
            s.admitted = True
            s.pending_credit = credited
            pool.entitled += s.contribution
            pool.admitted_states[id(s)] = s
            pool.counters["admitted"] += 1
        return True

    def match_and_add_prefix(self, hold: PrefixHold) -> list[CopyOrder]:
        """Adopt a probe's hold as this request's prefix. The hold is consumed: its references move here and any
        later use of it raises. Returns the RESTORE copy orders (staging -> live slot) the engine must execute and
        fence before the first step."""
        s, pool = self._s, self.pool
        self._require(s.admitted and not s.released, "match_and_add_prefix needs an admitted, unreleased request")
        self._require(self.num_computed == 0 and not s.block_ids, "a prefix can only be added to an empty request")
        pool.check_handle(hold, "prefix hold", f"request {self.req_id!r} of {pool.label}")
        k = hold.num_blocks
        if k < s.pending_credit:
            raise ValueError(f"request {self.req_id!r} was admitted with credit {s.pending_credit}, hold has {k}")
        if k and hold.hashes[-1] != self._hashes[k - 1]:
            raise ValueError(f"request {self.req_id!r}: the hold is for another prompt or scope")
        with pool.lock:
            orders = self._adopt_locked(hold)
        self.num_computed = k * self.page_tokens
        self._registered = k
        return orders

    def _adopt_locked(self, hold: PrefixHold) -> list[CopyOrder]:
        """Move the hold's references into this request (under the pool lock): its blocks become the block table,
        the entitlement drops to what is left to draw, and each bounded artifact becomes a RESTORE order (which now
        owns that staging slot's reference until it is fenced)."""
        s, pool = self._s, self.pool
        state = hold._take()
        before = s.contribution
        s.block_ids = list(state.ids)
        s.pending_credit = 0
        pool.entitled += s.contribution - before
        state.released = True
        orders: list[CopyOrder] = []
        for group, (slot, gen) in state.artifacts.items():
            order = pool.new_order(CopyKind.RESTORE, group, slot, s.live[group], gen, None, s, self.req_id)
            s.open_orders[order.order_id] = order
            orders.append(order)
        return orders

    def adopt_handoff_prefix(self, hold: PrefixHold, committed_len: int) -> list[CopyOrder]:
        """Decode side of a P/D hand-off: adopt the producer's padded chain as this request's first `committed_len`
        tokens. The hold must be the full hit (`ceil(committed_len / page)` pages, the last one padded with
        PAD_TOKEN_ID when `committed_len` is not page-aligned); admit with `credited=hold.num_blocks - 1` in that
        case, because the padded page is shared and immutable: it is copied into a private block (copy-on-restore,
        every paged group) before decode appends to it. Returns RESTORE orders (bounded groups) and PRIVATIZE
        orders (the boundary page) to execute and fence before the first step."""
        s, pool = self._s, self.pool
        P = self.page_tokens
        self._require(s.admitted and not s.released, "adopt_handoff_prefix needs an admitted, unreleased request")
        self._require(self.num_computed == 0 and not s.block_ids, "a prefix can only be added to an empty request")
        pool.check_handle(hold, "prefix hold", f"request {self.req_id!r} of {pool.label}")
        if not 0 < committed_len <= self._tokens.n:
            raise ValueError(f"committed_len {committed_len} outside this request's {self._tokens.n} tokens")
        k, full, padded = hold.num_blocks, committed_len // P, committed_len % P != 0
        if k != -(-committed_len // P):
            raise ValueError(f"request {self.req_id!r}: hand-off needs the full hit of {-(-committed_len // P)} "
                             f"pages, the hold has {k}: reject before admission")
        if padded and s.pending_credit > k - 1:
            raise ValueError(f"request {self.req_id!r}: admit a padded hand-off with credited <= {k - 1}: the padded "
                             "page is replaced by a private copy")
        if full and hold.hashes[full - 1] != self._hashes[full - 1]:
            raise ValueError(f"request {self.req_id!r}: the hold is for another prompt or scope")
        with pool.lock:
            orders = self._adopt_locked(hold)
            if padded:
                shared = s.block_ids[-1]
                # The draw is covered by the one block of slack the credit left (entitled already went down by one).
                (private,) = pool.paged.allocate(1)
                s.block_ids[-1] = private
                gen = int(pool.paged.generation[shared])
                groups = [g.name for g in pool.spec.paged_groups]
                s.privatizing[shared] = len(groups)
                for g in groups:
                    order = pool.new_order(CopyKind.PRIVATIZE, g, shared, private, gen, None, s, self.req_id)
                    s.open_orders[order.order_id] = order
                    orders.append(order)
        self.num_computed = committed_len
        self._registered = full
        return orders

    # -- steps ----------------------------------------------------------------------------------------------------
    def schedule(self, num_tokens: int) -> list[int]:
        """Make room for computing the next `num_tokens` known tokens; returns the block table. The draw cannot
        fail for an admitted request (its lifetime is entitled)."""
        s, pool = self._s, self.pool
        self._require(s.admitted and not s.released, "schedule needs an admitted, unreleased request")
        self._require(s.scheduled is None, "a step is already scheduled (apply or revert it first)")
        self._require(not s.open_orders, "a bounded copy order is not fenced yet: the step would race it")
        self._require(not s.restore_failed, "a restore copy failed: this request's bounded state is invalid")
        self._require(s.pending_credit == 0, "admitted with a credit: add the prefix hold first")
        if num_tokens <= 0 or self.num_computed + num_tokens > self._tokens.n:
            raise ValueError(
                f"request {self.req_id!r}: cannot schedule {num_tokens} tokens at {self.num_computed} of "
                f"{self._tokens.n} known"
            )
        pages = _cdiv(self.num_computed + num_tokens, self.page_tokens)
        if pages > s.lifetime:
            raise LifetimeExceededError(
                f"request {self.req_id!r} needs {pages} pages, its admitted lifetime is {s.lifetime}"
            )
        new = pages - len(s.block_ids)
        with pool.lock:
            ids = pool.paged.allocate(new) if new > 0 else []
            s.block_ids.extend(ids)
            pool.entitled -= len(ids)
            s.scheduled = (num_tokens, len(ids))
        return list(s.block_ids)

    def apply(self, sampled: Sequence[int] = ()) -> None:
        """The scheduled step finished (synchronized): its tokens' KV is in the arenas. `sampled` are new tokens
        to append (decode output). Pages that became full are sealed in place (made matchable)."""
        s = self._s
        self._require(s.scheduled is not None, "apply without a scheduled step")
        assert s.scheduled is not None
        self.num_computed += s.scheduled[0]
        s.scheduled = None
        if len(sampled):
            self._tokens.extend(sampled)
        self._seal_full_pages()

    def revert(self) -> None:
        """Undo the scheduled step: blocks it drew go back, entitlement restored.

        A drawn block that another handle (a save's pin) also references stays in the block table, with every drawn
        block before it: given back, it would count as entitled again while the pin keeps it unavailable, and an
        admitted request's later draw could fail (`available < entitled`). The next step reuses those blocks."""
        s, pool = self._s, self.pool
        self._require(s.scheduled is not None, "revert without a scheduled step")
        assert s.scheduled is not None
        _, drawn = s.scheduled
        with pool.lock:
            if drawn:
                shared = np.flatnonzero(pool.paged.refcount[np.asarray(s.block_ids[-drawn:], dtype=np.int64)] > 1)
                keep = int(shared[-1]) + 1 if len(shared) else 0
                give = drawn - keep
                if give:
                    back = s.block_ids[-give:]
                    del s.block_ids[-give:]
                    pool.paged.release(back)
                    pool.entitled += give
            s.scheduled = None
        pool.notify_capacity()

    def append_tokens(self, tokens: Sequence[int]) -> None:
        """Append known tokens without computing them (a new user turn continuing this request)."""
        self._tokens.extend(tokens)

    def pad_to_boundary(self) -> int:
        """Name the partial last page: pad it with PAD_TOKEN_ID to the page boundary (no compute; padding rows are
        never read) and seal it. Returns the number of pad tokens."""
        s = self._s
        self._require(s.scheduled is None, "pad_to_boundary during a scheduled step")
        self._require(self.num_computed == self._tokens.n, "pad_to_boundary needs every known token computed")
        k = (-self._tokens.n) % self.page_tokens
        if k:
            self._tokens.extend([PAD_TOKEN_ID] * k)
            self.num_computed += k
            self._seal_full_pages(pad_tail=True)
        return k

    def _seal_full_pages(self, *, pad_tail: bool = False) -> None:
        P = self.page_tokens
        known_pages = self._tokens.n // P
        if known_pages > len(self._hashes):
            start = len(self._hashes)
            parent = self._hashes[-1] if self._hashes else None
            self._hashes.extend(
                self._hasher.hash_prompt(self._tokens.view()[start * P : known_pages * P], self.scope, parent=parent,
                                        pad_tail=pad_tail)
            )
        full = self.num_computed // P
        if full > self._registered and self.pool.spec.prefix_caching:
            with self.pool.lock:
                paged = self.pool.paged
                # the pages' token ids only for KV events (a listener): a view, no per-token work here (the buffer only
                # grows: a sealed page's tokens never change, so the view may outlive this call)
                r = self._registered
                if paged.listener is None:
                    paged.register(self._s.block_ids[r:full], self._hashes[r:full])
                else:  # the pages' tokens, and the chain's page before them (a prefix hit's, an earlier seal's)
                    paged.register(self._s.block_ids[r:full], self._hashes[r:full],
                                   self._tokens.view()[r * P : full * P], 0, self._hashes[r - 1] if r else None)
            self._registered = full

    # -- bounded checkpoints --------------------------------------------------------------------------------------
    def seal_by_copy(self) -> list[CopyOrder]:
        """Checkpoint every restorable bounded group at the current (page-aligned) boundary: returns SEAL copy orders
        (live -> staging) to execute and fence before the next step writes the live slots. A group whose checkpoint
        already exists is skipped; one with no staging slot free is shed (counted)."""
        s, pool = self._s, self.pool
        self._require(s.admitted and not s.released, "seal_by_copy needs an admitted, unreleased request")
        self._require(s.scheduled is None, "seal_by_copy only between steps")
        P = self.page_tokens
        if not pool.spec.prefix_caching or self.num_computed == 0 or self.num_computed % P:
            return []
        key = self._hashes[self.num_computed // P - 1]
        orders: list[CopyOrder] = []
        with pool.lock:
            for g in pool.spec.restorable_bounded_groups:
                if pool.checkpoints.get(key, g.name) is not None:
                    continue
                got = pool.take_staging_locked(g.name)
                if got is None:
                    pool.counters["seal_copies_shed"] += 1
                    continue
                slot, gen = got
                order = pool.new_order(CopyKind.SEAL, g.name, s.live[g.name], slot, gen, key, s, self.req_id)
                s.open_orders[order.order_id] = order
                orders.append(order)
        return orders

    def checkpoint_sealed(self) -> bool:
        """Every required (non-optional) restorable bounded group has a fenced copy at the current boundary: the
        checkpoint here is complete (trivially true for paged-only models, page boundaries being checkpoints)."""
        P, pool = self.page_tokens, self.pool
        if self.num_computed == 0 or self.num_computed % P:
            return not pool.checkpoints.required
        key = self._hashes[self.num_computed // P - 1]
        with pool.lock:
            return all(pool.checkpoints.get(key, g) is not None for g in pool.checkpoints.required)

    # -- end ------------------------------------------------------------------------------------------------------
    def release(self) -> None:
        """Give back every block and slot (idempotent). Sealed pages stay matchable (inactive) until evicted."""
        self._finalize.detach()
        with self.pool.lock:
            self._s.release_locked(self.pool)
        self.pool.notify_capacity()
