"""`kvproc bench replay --capacity ... --hint within=S`: the eviction table with the serving layer's retention hint.

The online rows here go through the host tier's own index (`kvproc.tiers.host_index.HostIndex`, the code a `kvproc up`
tier runs, with its shipped eviction policy), not the reference simulator: the figure is the shipped mechanism's.
Same unit and hit rule as `eviction_sim` (one 512-token trace block = one page slot, keyed by its trace block id;
capacity C tokens = C // 512 slots; a request's hit = its leading run of committed pages, tokens min(hit x 512,
input_length); the trace's timestamps are the index's clock). Per request, what a store does against its tier:
`query` its pages (a hit's lease released at once: one use of the hit pages), then `reserve_save` + `commit_save`
of the pages after the hit, or, with a hint, of every page of the request with `retain_s` (as `KvStore.seal` sends a
hinted save: the present pages held and re-ranked, the lost ones saved again). Differences from the simulator: the
pages a save holds (its present prefix) are never the room for its own new pages, and the room is made before the
save's pages go in (the simulator evicts block by block, a long prompt's tail evicting its own head).

The hint is an oracle annotation of the trace (not online): a request is hinted when its conversation comes back
within `within` seconds (its prompt's last full block, the probe's definition in bench/RESULTS.md, is in a later
request that arrives within `within` s), and then carries `retain_s` = `retain` (default: `within`); `noise` flips
each request's bit with that probability (seeded), to size how good the serving layer's bit must be.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvproc.bench.eviction_sim import TRACE_BLOCK, PolicyResult
from kvproc.tiers.host_index import Hit, HostIndex, SaveTicket

if TYPE_CHECKING:
    from kvproc.bench.replay import TraceRequest


@dataclass(frozen=True)
class HintSpec:
    within: float  # a request is hinted when its conversation comes back within this many seconds (oracle)
    retain: float  # the hint's retain_s
    noise: float = 0.0  # the fraction of requests whose bit is flipped

    @property
    def label(self) -> str:
        noise = f",noise={self.noise:g}" if self.noise else ""
        return f"within={self.within:g},retain={self.retain:g}{noise}"


def parse_hint(text: str) -> HintSpec:
    """`within=300[,retain=R][,noise=F]` (also `;`-separated)."""
    fields: dict[str, float] = {}
    for part in text.replace(";", ",").split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in ("within", "retain", "noise"):
            raise ValueError(f"--hint: expected within=S[,retain=S][,noise=F], got {text!r}")
        fields[name.strip()] = float(value)
    if "within" not in fields:
        raise ValueError(f"--hint needs within=S, got {text!r}")
    spec = HintSpec(fields["within"], fields.get("retain", fields["within"]), fields.get("noise", 0.0))
    if not (spec.within > 0 and spec.retain >= 0 and 0 <= spec.noise <= 1):
        raise ValueError(f"--hint: within > 0, retain >= 0, 0 <= noise <= 1, got {text!r}")
    return spec


def oracle_bits(trace: list[TraceRequest], within: float, noise: float = 0.0, seed: int = 0) -> list[bool]:
    """Per request: does its conversation come back within `within` s (its last full block, or its only block, is
    in a later request arriving no more than `within` s after it), each bit flipped with probability `noise`."""
    times = [r.timestamp / 1000.0 for r in trace]
    nxt: list[float] = [math.inf] * len(trace)
    last: dict[int, float] = {}
    for i in range(len(trace) - 1, -1, -1):
        ids = trace[i].hash_ids
        b = ids[-2] if len(ids) > 1 else ids[-1]
        nxt[i] = last.get(b, math.inf) - times[i]
        for x in ids:
            last[x] = times[i]
    flip = random.Random(seed)
    return [(d <= within) != (flip.random() < noise) for d in nxt]


def replay_host_index(trace: list[TraceRequest], capacity_tokens: float, policy: str,
                      hints: list[bool] | None = None, retain_s: float = 0.0) -> PolicyResult:
    """Replay through a `HostIndex` of capacity // 512 slots under `policy`; `hints[i]`: request i's save carries
    `retain_s`. Returns the simulator's result type (evictions = the index's)."""
    cap = len({b for r in trace for b in r.hash_ids}) if math.isinf(capacity_tokens) else int(capacity_tokens) // TRACE_BLOCK
    now = [0.0]
    index = HostIndex(max(cap, 1), high_watermark=1.0, eviction=policy, clock=lambda: now[0],
                      max_retain_s=max(retain_s, 0.0))
    keys: dict[int, bytes] = {}
    hit_blocks = total_blocks = hit_tokens = input_tokens = 0
    for i, req in enumerate(trace):
        now[0] = req.timestamp / 1000.0
        ks = [keys.get(b) or keys.setdefault(b, b.to_bytes(16, "little")) for b in req.hash_ids]
        rid = f"r{i}"
        res = index.query(rid, ks)
        h = 0
        if isinstance(res, Hit):
            h = res.pages
            index.release_lease(res.lease_id)
        hit_blocks += h
        total_blocks += len(ks)
        hit_tokens += min(h * TRACE_BLOCK, req.input_length)
        input_tokens += req.input_length
        hinted = hints is not None and hints[i] and retain_s > 0
        lo = 0 if hinted else h
        if lo < len(ks):
            t = index.reserve_save(rid, ks[lo:], retain_s=retain_s if hinted else None)
            if isinstance(t, SaveTicket):
                index.commit_save(t.save_id)
    return PolicyResult(policy, capacity_tokens, hit_blocks / max(total_blocks, 1), hit_tokens / max(input_tokens, 1),
                        hit_tokens, index.counters["evictions"])


def compare_hinted(traces: dict[str, list[TraceRequest]], capacities: list[float], policies: list[str],
                   hint: HintSpec) -> list[dict[str, object]]:
    """Per (trace, capacity): Belady (the simulator's bound), then each online policy through the host index without
    and with the hint; each row with its fraction of Belady."""
    from kvproc.bench.eviction_sim import next_uses, simulate

    rows: list[dict[str, object]] = []
    for name, trace in traces.items():
        nu = next_uses(trace)
        bits = oracle_bits(trace, hint.within, hint.noise)
        for cap in capacities:
            bound = simulate(trace, cap, "belady", nu=nu)
            runs: list[tuple[str, PolicyResult]] = []
            for p in policies:
                if p == "belady":
                    runs.append(("belady", bound))
                    continue
                runs.append((p, replay_host_index(trace, cap, p)))
                runs.append((f"{p}+hint", replay_host_index(trace, cap, p, bits, hint.retain)))
            for label, r in runs:
                rows.append({"trace": name, "capacity_tokens": cap, "policy": label, "hint": hint.label,
                             "hinted_requests": sum(bits) / max(len(bits), 1),
                             "block_hit_ratio": r.block_hit_ratio, "token_hit_ratio": r.token_hit_ratio,
                             "of_belady": r.token_hit_ratio / bound.token_hit_ratio if bound.token_hit_ratio else 0.0,
                             "prefill_tokens_saved": r.prefill_tokens_saved, "evictions": r.evictions})
    return rows
