"""The docs hold to the code: every rule on the contract page names a test that exists, the hand-off API the page
shows is exported from `kvproc`, the page stays one page, and the stats keys table (`docs/observability.md`) is the
code's. Each checker has a control: a made-up row is reported."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import kvproc
from kvproc.engine.engine import Engine
from kvproc.engine.topology import PoolSizes, make_store

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = ROOT / "docs" / "kv-contract.md"
OBSERVABILITY = ROOT / "docs" / "observability.md"


def _section_rows(doc: Path, heading: str) -> list[list[str]]:
    """The cells of every row of the first table under `heading` (header and rule lines left out)."""
    text = doc.read_text()
    body = text[text.index(heading) + len(heading):]
    rows = []
    for line in body.splitlines():
        if line.startswith("## "):
            break
        if line.startswith("|") and not line.startswith("|---"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows[1:]  # the header


def _missing_tests(cells: list[str]) -> list[str]:
    """The `tests/...py::name` references in `cells` that name no such file or no such test function."""
    bad = []
    refs = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", " ".join(cells))
    if not refs:
        return [f"no test named in {cells}"]
    for path, name in refs:
        f = ROOT / path
        if not f.is_file():
            bad.append(f"{path}: no such file")
            continue
        defs = {n.name for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.FunctionDef)}
        if name not in defs:
            bad.append(f"{path}::{name}: no such test")
    return bad


RULES = "## The rules, and the test that proves each"


def test_every_rule_on_the_contract_page_names_a_test_that_exists() -> None:
    rows = _section_rows(CONTRACT, RULES)
    assert len(rows) >= 30, rows  # every rule of issue 18
    bad = [b for row in rows for b in _missing_tests(row[1:])]
    assert not bad, bad
    # the control: a row naming a test that does not exist, or none, is reported
    assert _missing_tests(["`tests/test_docs.py::test_that_is_not_there`"]) == \
        ["tests/test_docs.py::test_that_is_not_there: no such test"]
    assert _missing_tests(["no test"]) and _missing_tests(["`tests/nowhere.py::test_x`"])


def test_the_contract_page_stays_one_page() -> None:
    # an engine author reads it in 15 minutes; v3 (issue 40) holds runnable P/D and TP examples
    # (tests/test_contract_page.py) beside the rules table, hence the longer budget
    assert len(CONTRACT.read_text().splitlines()) <= 340


def test_the_handoff_api_on_this_page_is_exported_from_kvproc() -> None:
    text = CONTRACT.read_text()
    names = ["HandoffEnvelope", "fingerprint", "check_fingerprint", "padded_chain", "handoff_resolve_policy",
             "SaveClass", "FingerprintMismatch", "HandoffUnavailable", "align_holds", "Sharding"]
    for name in names:
        assert name in text, name  # the page shows it
        assert name in kvproc.__all__ and getattr(kvproc, name) is not None, name  # and `from kvproc import` works


# -- the stats keys table ----------------------------------------------------------------------------------------
STATS = "## Stats keys"


@cache
def _code_names() -> tuple[frozenset[str], frozenset[str]]:
    """Every string literal in kvproc's source, and every f-string's template with its fields as `{}`."""
    literals: set[str] = set()
    templates: set[str] = set()
    for f in (ROOT / "kvproc").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                literals.add(node.value)
            elif isinstance(node, ast.JoinedStr):
                templates.add("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values))
    return frozenset(literals), frozenset(templates)


def _pattern(key: str) -> re.Pattern[str]:
    """A documented key (`<name>` marks a field) as a regular expression over concrete keys."""
    return re.compile("^" + re.sub(r"<\w+>", r"[A-Za-z0-9_.]+", re.escape(key).replace(r"\<", "<").replace(r"\>", ">"))
                      + "$")


def _counted_by_code(name: str) -> bool:
    """A counter name (fields as `<x>`) the code can produce: a literal, or an f-string of that shape."""
    literals, templates = _code_names()
    rx = _pattern(name)
    return re.sub(r"<\w+>", "{}", name) in templates or any(rx.match(s) for s in literals)


def _table() -> dict[str, str]:
    return {row[0].strip("`"): row[1] for row in _section_rows(OBSERVABILITY, STATS)}


def _fresh_keys() -> set[str]:
    """The level keys of a fresh store (with a tier and a bounded group) and engine, as paths (`rank0.free_blocks`)."""
    with make_store("kvproc", "swa", PoolSizes(8, 1, 2, 8 << 20)) as t:
        eng = Engine(t.model, t.store, max_batch=1, chunk_tokens=16)
        stats = t.store.stats()
        keys = {f"engine.{k}" for k in eng.stats()}
    for section, value in stats.items():
        if isinstance(value, dict) and section != "outcomes":
            keys |= {f"{section}.{k}" for k in value}
        elif not isinstance(value, dict):
            keys.add(section)
    return keys


def _stats_table_problems(table: dict[str, str], fresh: set[str]) -> list[str]:
    levels = {k for k, kind in table.items() if kind == "level"}
    problems = [f"{k}: in a fresh store's stats, not in the table" for k in sorted(fresh)
                if not any(_pattern(d).match(k) for d in levels)]
    problems += [f"{d}: a level in the table, not in a fresh store's stats" for d in sorted(levels)
                 if not any(_pattern(d).match(k) for k in fresh)]
    problems += [f"{k}: a counter in the table the code never counts" for k, kind in sorted(table.items())
                 if kind == "counter" and not _counted_by_code(k.split(".", 1)[1] if "." in k else k)]
    problems += [f"{k}: kind {kind!r} is neither level nor counter" for k, kind in table.items()
                 if kind not in ("level", "counter")]
    return problems


def test_the_stats_keys_table_matches_the_code() -> None:
    table, fresh = _table(), _fresh_keys()
    assert len(table) >= 55
    assert not _stats_table_problems(table, fresh), _stats_table_problems(table, fresh)
    # the controls: a misspelt counter, a level the code lost, and a level the table lost are each reported
    assert _stats_table_problems(table | {"store.save_okk_typo": "counter"}, fresh) == \
        ["store.save_okk_typo: a counter in the table the code never counts"]
    assert _stats_table_problems(table | {"rank<r>.gone_blocks": "level"}, fresh) == \
        ["rank<r>.gone_blocks: a level in the table, not in a fresh store's stats"]
    assert _stats_table_problems({k: v for k, v in table.items() if k != "tier.entries"}, fresh) == \
        ["tier.entries: in a fresh store's stats, not in the table"]
    assert _stats_table_problems({k: v for k, v in table.items() if k != "rank<r>.parked"}, fresh) == \
        ["rank0.parked: in a fresh store's stats, not in the table"]


def test_every_test_the_gpu_page_names_exists() -> None:
    """docs/gpu.md says what ran on CPU by naming tests: each must exist (a renamed test would leave a false claim)."""
    text = (ROOT / "docs" / "gpu.md").read_text()
    refs = re.findall(r"`tests/[\w/]+\.py::\w+`", text)
    assert len(refs) >= 5, refs
    assert not _missing_tests(refs)
