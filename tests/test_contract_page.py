"""docs/kv-contract.md cannot drift from the code (issue 40): every `python` block of the page runs, in order, in one
namespace, as an integrator would paste them (the P/D and TP examples start real clusters)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)
CONTRACT = Path(__file__).resolve().parents[1] / "docs" / "kv-contract.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def run_blocks(blocks: list[str]) -> list[str]:
    """Run the blocks in one namespace; the failures, each with its block's first line ([] when all ran)."""
    ns: dict[str, object] = {"__name__": "kv_contract_page"}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"{CONTRACT.name}[python block {i}]", "exec"), ns)  # noqa: S102 - the page's own code
        except Exception as e:  # noqa: BLE001 - reported with the block
            return [f"block {i} ({block.splitlines()[0]!r}): {e!r}"]
    return []


def test_every_python_block_of_the_contract_page_runs() -> None:
    blocks = python_blocks(CONTRACT.read_text())
    assert len(blocks) >= 7, len(blocks)  # the model, check, protocol, one rank, P/D, TP, shapes
    assert any("adopt_handoff_prefix" in b for b in blocks) and any("Engine(tp, store, ranks=2" in b for b in blocks)
    problems = run_blocks(blocks)
    assert not problems, problems
    # the control: a block that no longer matches the code (a renamed call) is reported, naming its block
    bad = run_blocks([blocks[0], blocks[0].replace("check_model(MyKv()).ok", "check_model(MyKv()).passed_all")])
    assert len(bad) == 1 and bad[0].startswith("block 1") and "passed_all" in bad[0]
