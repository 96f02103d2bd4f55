"""Summaries of one workload run: the columns of the demo table and the keys of its JSON."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from kvproc.engine.workload import TurnRecord


@dataclass(frozen=True)
class RunSummary:
    ttft_p50_ms: float
    ttft_p99_ms: float
    output_tok_s: float
    turns_completed: int
    turns_failed: int
    prompt_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    computed_tokens: int
    wall_s: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def summarize(records: Sequence[TurnRecord], wall_s: float) -> RunSummary:
    ok = [r for r in records if r.failed is None]
    ttft = np.array([r.ttft_s for r in ok if r.ttft_s is not None], dtype=np.float64) * 1e3
    prompt = sum(r.prompt_tokens for r in ok)
    dev = sum(r.device_hit_tokens for r in ok)
    host = sum(r.host_hit_tokens for r in ok)
    out_tokens = sum(len(r.output) for r in ok)
    return RunSummary(
        ttft_p50_ms=float(np.percentile(ttft, 50)) if ttft.size else float("nan"),
        ttft_p99_ms=float(np.percentile(ttft, 99)) if ttft.size else float("nan"),
        output_tok_s=out_tokens / wall_s if wall_s > 0 else 0.0,
        turns_completed=len(ok),
        turns_failed=len(records) - len(ok),
        prompt_tokens=prompt,
        device_hit_tokens=dev,
        host_hit_tokens=host,
        computed_tokens=prompt - dev - host,
        wall_s=wall_s,
    )


def ttft_by_turn(records: Sequence[TurnRecord], turns: int) -> list[float]:
    """Median TTFT (ms) of each turn index (nan where no turn of that index completed)."""
    out = []
    for t in range(turns):
        v = [r.ttft_s * 1e3 for r in records if r.turn == t and r.failed is None and r.ttft_s is not None]
        out.append(float(np.median(v)) if v else float("nan"))
    return out


def outputs_identical(runs: Sequence[Sequence[TurnRecord]]) -> bool:
    """Every turn completed in every run, with the same generated tokens."""
    maps = []
    for recs in runs:
        if any(r.failed is not None for r in recs):
            return False
        maps.append({(r.conversation, r.turn): r.output for r in recs})
    return all(m == maps[0] for m in maps[1:])


def outputs_digest(records: Sequence[TurnRecord]) -> str:
    """A digest of every turn's generated tokens, in (conversation, turn) order: equal digests mean equal outputs
    (what compares two demo invocations, e.g. `--ranks 1` and `--ranks 2`)."""
    h = hashlib.blake2b(digest_size=16)
    for r in sorted(records, key=lambda r: (r.conversation, r.turn)):
        h.update(repr((r.conversation, r.turn, r.output, r.failed is None)).encode())
    return h.hexdigest()


def first_difference(runs: Mapping[str, Sequence[TurnRecord]]) -> str | None:
    """A human-readable description of the first turn whose outputs differ between runs (for the report)."""
    names = list(runs)
    base = {(r.conversation, r.turn): r.output for r in runs[names[0]]}
    for name in names[1:]:
        other = {(r.conversation, r.turn): r.output for r in runs[name]}
        for key in sorted(base):
            a, b = base[key], other.get(key)
            if a != b:
                if b is None:
                    return f"conversation {key[0]} turn {key[1]}: missing in {name}"
                i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                return f"conversation {key[0]} turn {key[1]}: {names[0]} and {name} differ at output token {i}"
    return None
