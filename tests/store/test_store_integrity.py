"""Integrity: paths that used to commit another prompt's (or no) bytes under a page's key while reporting ok.

Each test fails on the code before the fix: a seal after release or with a bad cursor committed keys whose bytes
were never copied; hashes of another prompt were trusted by `RequestKv`; two engines with other weights named their
pages alike and passed each other's fingerprints.
"""

from __future__ import annotations

import pytest
import torch

from kvproc import BlockPool, InvalidSealCursor, KvContractError, KvSpec, RequestKv, RequestStateError, validate_layout
from kvproc.core.hashing import HashAlgorithm
from kvproc.store.cluster import fingerprint as tier_fingerprint
from kvproc.store.handoff import fingerprint as handoff_fingerprint
from kvproc.store.types import SealCursor
from tests.store.conftest import PAGE, BytesModel, compute, make_store

torch.manual_seed(0)


def _tier_keys(tier) -> set[bytes]:
    return set(tier.index.entries)


def test_seal_after_release_is_refused_and_commits_nothing():
    store, model, tier, _ = make_store()
    with store:
        kv, cur, _, _ = compute(store, model, "a", list(range(1, 13)))
        kv.release()
        with pytest.raises(RequestStateError, match="released"):
            store.seal(0, kv, cur)
        with pytest.raises(RequestStateError, match="released"):
            store.retire(0, kv, cur)
        store.flush_saves(0, 10)
        assert not _tier_keys(tier)  # before the fix: 3 keys committed over slots nothing was copied into
        assert store.counters["seal_refused_state"] == 2


@pytest.mark.parametrize("pages", [-1, -3, True, 1.5, 10_000])
def test_a_cursor_that_is_not_a_page_count_of_the_request_is_refused(pages):
    store, model, tier, _ = make_store()
    with store:
        kv, _, _, _ = compute(store, model, "a", list(range(1, 13)))
        with pytest.raises(InvalidSealCursor, match="not a page count"):
            store.seal(0, kv, SealCursor(pages))  # type: ignore[arg-type]
        store.flush_saves(0, 10)
        assert not _tier_keys(tier)  # -1 used to take page_hashes[-1:] with block_ids[-1:]: mismatched pairs
        store.retire(0, kv, SealCursor.after_prefix(0))
        store.flush_saves(0, 10)
        assert len(_tier_keys(tier)) == 3


def test_a_request_whose_block_table_no_longer_matches_its_hashes_is_not_saved():
    store, model, tier, _ = make_store()
    with store:
        kv, cur, _, _ = compute(store, model, "a", list(range(1, 13)))
        pool = store.pools[0]
        with pool.lock:  # another path re-registers one of its blocks under another page (simulated takeover)
            pool.paged.block_hash[kv.block_ids[1]] = b"\x01" * 16
        with pytest.raises(RequestStateError, match="not sealed under its page hashes"):
            store.seal(0, kv, cur)
        store.flush_saves(0, 10)
        assert not _tier_keys(tier)


def test_hashes_of_another_prompt_cannot_be_adopted_through_the_resolve():
    store, model, _, _ = make_store()
    with store:
        a, b = list(range(1, 13)), list(range(1, 5)) + [50, 51, 52, 53] + list(range(9, 13))
        prefix_a = store.resolve_prefix_sync(0, "a", a)
        with pytest.raises(ValueError, match="other tokens"):
            RequestKv(store.pools[0], "b", b, 4, prompt_hashes=prefix_a.page_hashes)
        prefix_a.hold.release()


def _model(model_id: str) -> BytesModel:
    m = BytesModel(16)
    m._spec = KvSpec(PAGE, m._spec.groups, model_id=model_id)
    return m


def test_engines_with_other_weights_name_pages_apart_and_fail_each_others_fingerprints():
    a, b = _model("org/model@rev-1"), _model("org/model-finetune@rev-7")
    la, lb = (validate_layout(m.spec(), m.arenas(0)) for m in (a, b))
    pa, pb = BlockPool.from_layout(la, live_slots=1), BlockPool.from_layout(lb, live_slots=1)
    toks = list(range(1, 13))
    assert set(pa.hasher.hash_prompt(toks)).isdisjoint(pb.hasher.hash_prompt(toks))
    assert tier_fingerprint(a, la) != tier_fingerprint(b, lb)
    assert "id=org/model@rev-1" in tier_fingerprint(a, la)
    alg = HashAlgorithm.BLAKE2B_128
    assert handoff_fingerprint("bytes", la, alg) != handoff_fingerprint("bytes", lb, alg)


def test_a_store_whose_kv_leaves_the_process_needs_a_model_id():
    anon = _model("")
    layout = validate_layout(anon.spec(), anon.arenas(0))
    with pytest.raises(KvContractError, match="KvSpec.model_id is empty"):
        tier_fingerprint(anon, layout)
    with pytest.raises(KvContractError, match="KvSpec.model_id is empty"):
        handoff_fingerprint("bytes", layout, HashAlgorithm.BLAKE2B_128)
    with pytest.raises(KvContractError, match="model_id must be a string"):
        KvSpec(PAGE, anon.spec().groups, model_id=None)  # type: ignore[arg-type]
