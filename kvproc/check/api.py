"""`kvproc.check_model(model)`: prove a model's KV contract in seconds, before it serves a token.

Runs, in this process, on the model's own arenas (and random bytes where a forward would write KV): the contract's
validation; the stored-layout proofs on its `repack`; the sharding proof on its ranks' forward (N ranks); then, on a
store with a host tier (`build_local_store`), save -> host tier -> load on every rank, a bounded group through its
checkpoint, a REPLICATED model stored once, and a P/D hand-off between two attaches. The model's arenas are written:
check a model built for the check (`kvproc check MODULE:FACTORY` builds one), not one that is serving."""

from __future__ import annotations

import contextlib

import torch

from kvproc.check import layout_checks, sharding, store_checks
from kvproc.check.report import CheckReport, Failure, GroupRow
from kvproc.contract import ArenaLayout, GroupKind, KvContractError, KvModel, KvSpec, require_model_id, validate_layout
from kvproc.store.build import build_local_store
from kvproc.store.handoff import model_label
from kvproc.store.kv_store import KvStore
from kvproc.store.local_tier import LocalTier


def _rows(spec: KvSpec, refused: str) -> list[GroupRow]:
    rows = []
    for g in spec.groups:
        why = ""
        if refused:
            why = f"refused: {refused}"
        elif not spec.prefix_caching:
            why = ("neither checkpointable nor optional: prefix caching is off for the model" if
                   not g.checkpointable and not g.optional else f"prefix caching is off ({spec.prefix_caching_off_reason})")
        elif not g.checkpointable:
            why = "not checkpointable (optional): never stored; a checkpoint is valid without it"
        rows.append(GroupRow(g.name, g.kind.value, g.sharding.value, not why, why))
    return rows


def _host_bytes(layout: ArenaLayout) -> int:
    page = sum(a.stored_bytes for g, a in layout.arenas if layout.spec.group(g).kind is GroupKind.PAGED)
    slot = sum(a.stored_bytes for g, a in layout.arenas if layout.spec.group(g).kind is GroupKind.BOUNDED)
    return max(1 << 20, 32 * page + 64 * slot)  # room for every check's pages and checkpoints


def _close(store: KvStore) -> None:
    store.close()
    for c in store.copiers:
        with contextlib.suppress(Exception):
            c.close()
    for t in dict.fromkeys(store.tiers):
        with contextlib.suppress(Exception):
            t.close()


def check_model(model: KvModel, *, ranks: int | None = None, seed: int = 0) -> CheckReport:
    """Check `model`'s KV contract at `ranks` ranks (default: `model.ranks`, else 1); the report's `text()` is what
    `kvproc check` prints, its `ok` what it exits with."""
    n = ranks or int(getattr(model, "ranks", 1))
    report = CheckReport(model_label(model), n)
    gen = torch.Generator().manual_seed(seed)
    try:
        spec = model.spec()
        layouts = [validate_layout(spec, model.arenas(r)) for r in range(n)]
    except (KvContractError, ValueError, TypeError) as e:
        report.failures.append(Failure("contract", "-", str(e)))
        return report
    refused = ""
    try:
        spec.check_sharding(n)
    except KvContractError as e:
        refused = str(e)
    report.rows = _rows(spec, refused)
    if refused:
        report.failures.append(Failure("contract", ",".join(g.name for g in spec.groups), refused))
        return report
    try:
        require_model_id(spec, report.model)
    except KvContractError as e:
        report.failures.append(Failure("contract", "-", str(e)))
        return report
    report.passed.append(f"contract: {len(spec.groups)} group(s), {len(layouts[0].arenas)} arena(s) per rank, "
                         f"page {spec.page_tokens} tokens, model_id {spec.model_id!r}")
    layout_checks.stored_layouts(model, layouts[0], report, gen)
    sharding.ranks_compute(model, layouts, report, gen)
    if not spec.prefix_caching:
        report.notes.append(f"no store proofs: prefix caching is off ({spec.prefix_caching_off_reason})")
        return report
    try:
        store = build_local_store(model, live_slots=1, host_bytes=_host_bytes(layouts[0]), ranks=n)
    except (KvContractError, ValueError) as e:  # e.g. a repack hook without the `arena` parameter
        report.failures.append(Failure("contract", ",".join(g.name for g in spec.groups), str(e)))
        return report
    try:
        for name, run in (("host round trip", lambda: store_checks.round_trips(store, layouts, report, gen)),
                          ("P/D hand-off", lambda: _handoff(model, store, layouts[0], report, gen))):
            try:
                run()
            except Exception as e:  # noqa: BLE001 - reported as that proof's failure, never a traceback
                report.failures.append(Failure(name, ",".join(g.name for g in spec.groups), repr(e)))
    finally:
        _close(store)
    return report


def _handoff(model: KvModel, store: KvStore, layout: ArenaLayout, report: CheckReport, gen: torch.Generator) -> None:
    tier = store.tiers[0]
    assert isinstance(tier, LocalTier)
    store_checks.handoff(model, store, layout, tier, report, gen, lambda c: c.close())  # type: ignore[attr-defined]
