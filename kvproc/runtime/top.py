"""`kvproc console top`: a cluster at a glance, redrawn in place every interval -- rates over the last interval, not
totals.

Each frame is the difference of two reads of every process's `Stats` (the same read as `kvproc console status`):
hit ratio by tier, resolves/s, copy GB/s each way, saves shed/s; then levels: open leases and hand-offs, device pool
and host-tier occupancy per rank, and each process's CPU (its CPU time over the interval, from /proc) and RSS. The
store's figures exist when the launcher's process embeds a store (`ClusterStore.start`); a `kvproc up` cluster has
none, and shows "-" there. A counter that went backwards (a restarted process) counts from zero.

    kvproc console top [--interval S] [--frames N] [--json]

`--json` prints one JSON object per frame, one per line, the fields `frame()` returns.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import psutil

_RANK = re.compile(r"^rank(\d+)\.(.+)$")
_NA = "-"


@dataclass
class Sample:
    """One read of the cluster: every process's row (`console.collect`), its CPU seconds, and when."""

    at: float
    rows: list[dict[str, Any]]
    cpu_s: dict[int, float]


def cpu_seconds(pid: int) -> float | None:
    try:
        t = psutil.Process(pid).cpu_times()
    except (psutil.Error, OSError):
        return None
    return float(t.user + t.system)


def take(read_rows: Callable[[], list[dict[str, Any]]]) -> Sample:
    at = time.monotonic()
    rows = read_rows()
    cpu = {int(r["pid"]): c for r in rows if r.get("pid") and (c := cpu_seconds(int(r["pid"]))) is not None}
    return Sample(at, rows, cpu)


def _counters(sample: Sample, role: str) -> list[tuple[int, Mapping[str, int]]]:
    return [(int(r["rank"]), r.get("counters") or {}) for r in sample.rows if r["role"] == role]


def _delta(prev: Mapping[str, int], cur: Mapping[str, int], match: Callable[[str], bool]) -> int:
    """Sum over the matching counters of how much each grew (a counter that fell restarted from zero)."""
    total = 0
    for key, value in cur.items():
        if match(key):
            before = prev.get(key, 0)
            total += value - before if value >= before else value
    return total


def _by_rank(prev: Sample, cur: Sample, role: str) -> list[tuple[int, Mapping[str, int], Mapping[str, int]]]:
    before = dict(_counters(prev, role))
    return [(rank, before.get(rank, {}), now) for rank, now in _counters(cur, role)]


def _ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole > 0 else None


def frame(prev: Sample, cur: Sample) -> dict[str, Any]:
    """The view's fields: rates over prev -> cur, and levels as of cur."""
    dt = max(cur.at - prev.at, 1e-6)
    store = _by_rank(prev, cur, "launcher")
    has_store = bool(store) and any(k.startswith(("store.", "rank")) for k in store[0][2])
    out: dict[str, Any] = {"interval_s": round(dt, 3)}
    if has_store:
        _, b, c = store[0]

        def grew(*names: str) -> int:
            return _delta(b, c, lambda k: k in names)

        queries = grew("store.prefix_cache_queries")
        dev, host = grew("store.prefix_cache_hits_device"), grew("store.prefix_cache_hits_host")
        out["hit_ratio"] = {"device": _ratio(dev, queries), "host": _ratio(host, queries),
                            "miss": _ratio(queries - dev - host, queries)}
        out["query_tokens_per_s"] = round(queries / dt, 1)
        out["resolves_per_s"] = round(_delta(b, c, lambda k: k.startswith("outcome.resolve.")) / dt, 1)
        out["saves_ok_per_s"] = round(_delta(b, c, lambda k: k == "outcome.save.ok") / dt, 1)
        out["saves_shed_per_s"] = round(_delta(b, c, lambda k: k.startswith("outcome.save.shed")) / dt, 1)
        out["saves_failed_per_s"] = round(_delta(b, c, lambda k: k.startswith("outcome.save.failed")) / dt, 1)
        pools: dict[int, dict[str, int]] = {}
        for key, value in c.items():
            if (match := _RANK.match(key)) is not None:
                pools.setdefault(int(match[1]), {})[match[2]] = value
        out["pools"] = [{"rank": r, "blocks": p.get("num_blocks", 0), "active": p.get("active_blocks", 0),
                         "cached_pages": p.get("indexed_pages", 0), "pinned": p.get("pinned_blocks", 0),
                         "occupancy": _ratio(p.get("active_blocks", 0), p.get("num_blocks", 0))}
                        for r, p in sorted(pools.items())]
    else:
        out.update(hit_ratio=None, query_tokens_per_s=None, resolves_per_s=None, saves_ok_per_s=None,
                   saves_shed_per_s=None, saves_failed_per_s=None, pools=[])
    copied = _by_rank(prev, cur, "copy_worker")
    out["copy_gb_per_s"] = {d: round(sum(_delta(b, c, f"bytes_{d}".__eq__) for _, b, c in copied) / dt / 1e9, 3)
                            for d in ("save", "load")}
    tiers = _by_rank(prev, cur, "host_tier")
    out["tiers"] = [{"rank": r, "slots": c.get("index.page_slots", 0),
                     "used": c.get("index.page_slots", 0) - c.get("index.free_page_slots", 0),
                     "entries": c.get("index.entries", 0),
                     "occupancy": _ratio(c.get("index.page_slots", 0) - c.get("index.free_page_slots", 0),
                                         c.get("index.page_slots", 0))} for r, _, c in tiers]
    out["open_leases"] = sum(c.get("index.open_leases", 0) for _, _, c in tiers)
    out["open_handoffs"] = sum(c.get("index.open_handoffs", 0) for _, _, c in tiers)
    out["ttl_reclaimed_per_s"] = round(sum(_delta(b, c, lambda k: k.startswith("ttl_reclaimed_"))
                                           for _, b, c in tiers) / dt, 1)
    out["processes"] = [_process(r, prev, cur, dt) for r in cur.rows]
    return out


def _process(row: Mapping[str, Any], prev: Sample, cur: Sample, dt: float) -> dict[str, Any]:
    pid = int(row.get("pid") or 0)
    before, now = prev.cpu_s.get(pid), cur.cpu_s.get(pid)
    cpu = round(100.0 * max(0.0, now - before) / dt, 1) if before is not None and now is not None else None
    rss = row.get("rss_bytes")
    return {"role": row["role"], "rank": row["rank"], "pid": pid, "state": row["state"], "cpu_pct": cpu,
            "rss_mib": round(rss / 2**20, 1) if rss is not None else None}


def _pct(x: float | None) -> str:
    return _NA if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str = ".1f") -> str:
    return _NA if x is None else format(x, fmt)


def render(cluster: str, f: Mapping[str, Any]) -> str:
    h = f["hit_ratio"] or {}
    lines = [
        f"kvproc top  cluster {cluster}  rates over the last {f['interval_s']:.1f} s",
        (f"resolves/s {_num(f['resolves_per_s']):>8}   hit ratio  device {_pct(h.get('device')):>6}  "
         f"host {_pct(h.get('host')):>6}  miss {_pct(h.get('miss')):>6}   query tokens/s "
         f"{_num(f['query_tokens_per_s'])}"),
        (f"copy GB/s  save {f['copy_gb_per_s']['save']:.3f}  load {f['copy_gb_per_s']['load']:.3f}   saves/s ok "
         f"{_num(f['saves_ok_per_s'])}  shed {_num(f['saves_shed_per_s'])}  failed {_num(f['saves_failed_per_s'])}"),
        (f"leases open {f['open_leases']}  hand-offs open {f['open_handoffs']}  TTL reclaims/s "
         f"{f['ttl_reclaimed_per_s']:.1f}"),
    ]
    for p in f["pools"]:
        lines.append(f"pool rank{p['rank']}  active {p['active']}/{p['blocks']} blocks ({_pct(p['occupancy'])})  "
                     f"cached {p['cached_pages']} pages  pinned {p['pinned']}")
    for t in f["tiers"]:
        lines.append(f"tier rank{t['rank']}  used {t['used']}/{t['slots']} page slots ({_pct(t['occupancy'])})  "
                     f"entries {t['entries']}")
    lines.append(f"{'PROCESS':<12} {'RANK':>4} {'PID':>8} {'STATE':<11} {'CPU%':>6} {'RSS_MiB':>8}")
    for p in f["processes"]:
        lines.append(f"{p['role']:<12} {p['rank']:>4} {p['pid']:>8} {p['state']:<11} {_num(p['cpu_pct']):>6} "
                     f"{_num(p['rss_mib']):>8}")
    return "\n".join(lines)
