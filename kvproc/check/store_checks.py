"""The proofs that need a store: save -> host tier -> load on every rank (a bounded group through its checkpoint),
a REPLICATED model stored once and restored on every rank, and a P/D hand-off between two attaches of the model.

Each runs on the model's own arenas (and, for the decode side of the hand-off, on a copy of their geometry), with
random bytes written where a forward pass would write KV: kvproc moves bytes, so bytes are what is proved."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from kvproc.check.blocks import compare, fill, scramble, snapshot
from kvproc.check.report import CheckReport, Failure
from kvproc.contract import ArenaLayout, KvArena, KvModel, validate_layout
from kvproc.core.request_kv import RequestKv
from kvproc.store.build import model_repack
from kvproc.store.handoff import (
    FingerprintMismatch,
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
from kvproc.store.local_tier import LocalCopier, LocalTier
from kvproc.store.types import SaveClass, SealCursor
from kvproc.workers.copy_exec import CopyExecutor

PAGES = 2  # pages a round trip saves and restores
FLUSH_S = 60.0  # generous: a loaded machine still finishes


def _groups(layout: ArenaLayout) -> tuple[list[str], list[str]]:
    spec = layout.spec
    return [g.name for g in spec.paged_groups], [g.name for g in spec.restorable_bounded_groups]


def _compute(store: KvStore, rank: int, layout: ArenaLayout, req: str, toks: list[int], gen: torch.Generator,
             save_class: SaveClass = SaveClass.CACHEABLE, pad: bool = False) -> tuple[dict, dict]:
    """Rank `rank` "computes" `toks` (random bytes into its blocks and live slots), checkpoints the bounded groups at
    the end and retires with `save_class`: returns what was written (paged snapshot, {group: bounded snapshot})."""
    paged, bounded = _groups(layout)
    kv = RequestKv(store.pools[rank], req, toks, 1)
    if not kv.try_admit(0):
        raise RuntimeError(f"rank {rank}: a {len(toks)}-token request was not admitted (the pool is too small)")
    kv.schedule(len(toks))
    fill(layout, paged, kv.block_ids, gen)
    for g in bounded:
        fill(layout, [g], [kv.live_slots[g]], gen)
    kv.apply()
    if pad:
        kv.pad_to_boundary()
    if bounded and not store.execute_copies(rank, kv.seal_by_copy()):
        raise RuntimeError(f"rank {rank}: the bounded checkpoint copy (live -> staging) failed")
    written = snapshot(layout, paged, kv.block_ids), {g: snapshot(layout, [g], [kv.live_slots[g]]) for g in bounded}
    store.retire(rank, kv, SealCursor.after_prefix(0), save_class)
    store.flush_saves(rank, FLUSH_S)
    return written


def _check_restored(check: str, layout: ArenaLayout, kv: RequestKv, n_blocks: int, written: tuple[dict, dict],
                    by_position: bool = False) -> list[Failure]:
    paged, bounded = _groups(layout)
    out = compare(check, layout, paged, kv.block_ids[:n_blocks], written[0], by_position)
    for g in bounded:
        out += compare(check, layout, [g], [kv.live_slots[g]], written[1][g], by_position)
    return out


def _restore(store: KvStore, rank: int, layout: ArenaLayout, req: str, toks: list[int], gen: torch.Generator,
             written: tuple[dict, dict], check: str, by_position: bool = False) -> list[Failure]:
    """Empty rank `rank`'s device cache, scramble its arenas, resolve `toks` plus one token: the prefix must come
    from the host tier whole and bit for bit."""
    store.drop_device_cache(rank, FLUSH_S)
    scramble(layout, gen)
    want = len(toks)
    pre = store.resolve_prefix_sync(rank, req, toks + [toks[-1] + 1])
    group = ",".join(g.name for g in layout.spec.groups)
    if pre.host_tokens != want:
        pre.hold.release()
        return [Failure(check, group, f"rank {rank} restored {pre.host_tokens} of {want} tokens from the host tier "
                        f"({pre.device_tokens} from the device; miss: {pre.hold.reason.value})")]
    kv = RequestKv(store.pools[rank], req, toks + [toks[-1] + 1], 1)
    if not kv.try_admit(pre.hold.num_blocks):
        pre.hold.release()
        return [Failure(check, group, f"rank {rank}: the restoring request was not admitted")]
    n_blocks = pre.hold.num_blocks
    ok = store.execute_copies(rank, kv.match_and_add_prefix(pre.hold))  # consumes the hold
    out = [] if ok else [Failure(check, group, f"rank {rank}: the bounded restore copy failed")]
    out += _check_restored(check, layout, kv, n_blocks, written, by_position)
    kv.release()
    return out


def round_trips(store: KvStore, layouts: list[ArenaLayout], report: CheckReport, gen: torch.Generator) -> None:
    """Every rank: save -> host tier -> load, bit for bit (PER_RANK: each rank its own shard through its own tier).
    A REPLICATED model: rank 0 saves once, into the one tier; every rank restores that copy."""
    pt = layouts[0].spec.page_tokens
    ranks = len(layouts)
    replicated = ranks > 1 and layouts[0].spec.replicated
    savers = [0] if replicated else list(range(ranks))
    written = {}
    for r in savers:
        toks = list(range(1000 * (r + 1), 1000 * (r + 1) + PAGES * pt))
        written[r] = (toks, _compute(store, r, layouts[r], f"check-save-{r}", toks, gen))
    failures: list[Failure] = []
    if replicated:
        tiers = {id(t): t for t in store.tiers}
        entries = sum(s["entries"] for k, s in store.stats().items() if k.startswith("tier") and isinstance(s, dict))
        if len(tiers) != 1 or entries != PAGES:
            failures.append(Failure("replicated stored once", ",".join(g.name for g in layouts[0].spec.groups),
                                    f"{entries} tier entries in {len(tiers)} tier(s) for {PAGES} pages"))
        else:
            report.passed.append(f"replicated: {PAGES} pages stored once, in one tier, for {ranks} ranks")
    for r in range(ranks):
        toks, w = written[0 if replicated else r]
        failures += _restore(store, r, layouts[r], f"check-load-{r}", toks, gen, w, "host round trip",
                             by_position=replicated and r != 0)
    report.failures += failures
    if not failures:
        paged, bounded = _groups(layouts[0])
        what = f"paged {paged}" + (f", bounded {bounded} (through a checkpoint)" if bounded else "")
        on = f"on each of {ranks} ranks" + (" (from rank 0's one copy)" if replicated else "") if ranks > 1 else ""
        report.passed.append(f"save -> host tier -> load is bit-exact for {what} {on}".rstrip())


def _clone(layout: ArenaLayout) -> ArenaLayout:
    """The same geometry in fresh memory: the decode engine of a P/D pair (its own arenas, the same model)."""
    def copy(a: KvArena) -> KvArena:
        return dataclasses.replace(a, tensor=torch.zeros_like(a.tensor))
    return validate_layout(layout.spec, [(g, copy(a)) for g, a in layout.arenas])


def _changed(layout: ArenaLayout) -> ArenaLayout:
    """`layout` with its first arena stored in another layout (what a changed kernel or wire format is)."""
    g, a = layout.arenas[0]
    other = "check-changed-v1" if a.stored_layout != "check-changed-v1" else "check-changed-v2"
    changed = dataclasses.replace(a, stored_layout=other)
    return dataclasses.replace(layout, arenas=((g, changed),) + tuple(layout.arenas[1:]))


def handoff(model: KvModel, store: KvStore, layout: ArenaLayout, tier: LocalTier, report: CheckReport,
            gen: torch.Generator, close: Callable[[object], None]) -> None:
    """A P/D envelope between two attaches on one tier: the producer (`store`, rank 0) prefills a prompt ending
    inside a page, pads it and retires it as a hand-off; the consumer (a second store on the same tier, over a copy
    of the arenas) checks the fingerprint and the envelope, resolves the padded chain in full and adopts it: every
    byte equal. A changed stored layout must be refused by the fingerprint."""
    pt = layout.spec.page_tokens
    committed = PAGES * pt + max(1, pt // 2) if pt > 1 else PAGES + 1
    toks = list(range(5000, 5000 + committed))
    fp = fingerprint(model_label(model), layout)
    written = _compute(store, 0, layout, "check-pd", toks, gen, SaveClass.HANDOFF, pad=True)
    env = HandoffEnvelope("check-pd", fp, committed, anchor_token_id=toks[-1] + 1,
                          chain_key=chain_key(store.pools[0].hasher, toks, committed))
    theirs = _clone(layout)
    copier = LocalCopier(CopyExecutor(theirs, tier.host, tier.layout.for_layout(theirs), model_repack(model, theirs)))
    consumer = KvStore([theirs], live_slots=1, tier=tier, copiers=[copier])
    group = ",".join(g.name for g in layout.spec.groups)
    failures: list[Failure] = []
    try:
        check_fingerprint(fingerprint(model_label(model), theirs), env.fingerprint)
        check_envelope(env, "check-pd-in", consumer.pools[0].hasher, toks)
        pre = consumer.resolve_prefix_sync(0, "check-pd-in", padded_chain(toks, committed, pt),
                                           policy=handoff_resolve_policy(env.producer_req_id, FLUSH_S))
        need = math.ceil(committed / pt)
        if pre.hold.num_blocks != need:
            pre.hold.release()
            failures.append(Failure("P/D hand-off", group, f"the consumer's hit has {pre.hold.num_blocks} of {need} "
                                    f"pages (miss: {pre.hold.reason.value})"))
        else:
            kv = RequestKv(consumer.pools[0], "check-pd-in", toks + [toks[-1] + 1], 2)
            if not kv.try_admit(pre.hold.num_blocks - 1):
                failures.append(Failure("P/D hand-off", group, "the consumer's request was not admitted"))
                pre.hold.release()
            else:
                if not consumer.execute_copies(0, kv.adopt_handoff_prefix(pre.hold, committed)):
                    failures.append(Failure("P/D hand-off", group, "the consumer's restore copies failed"))
                failures += _check_restored("P/D hand-off", theirs, kv, need, written)
                kv.release()
    finally:
        consumer.close()
        close(copier)
    try:
        check_fingerprint(fingerprint(model_label(model), _changed(layout)), env.fingerprint)
        failures.append(Failure("P/D hand-off", layout.arenas[0][0], "a changed stored layout was not refused by the "
                                "fingerprint", layout.arenas[0][1].name))
    except FingerprintMismatch:
        pass
    report.failures += failures
    if not failures:
        report.passed.append(f"P/D: a {committed}-token hand-off passes between two attaches bit for bit; a changed "
                             "stored layout is refused by the fingerprint (FingerprintMismatch)")
