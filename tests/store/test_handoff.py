"""P/D hand-off, kvproc side: padding, Handoff saves, fingerprint, full-hit adoption with copy-on-restore, leases.

The tier and copier are kvproc's in-process ones (store side of the contract); across real processes and two engines
see the engine's P/D tests.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvproc import RequestKv, ReusePolicy
from kvproc.contract import validate_layout
from kvproc.core.bounded import CopyKind
from kvproc.core.hashing import PAD_TOKEN_ID, HashAlgorithm
from kvproc.store.handoff import (
    FingerprintMismatch,
    HandoffEnvelope,
    check_fingerprint,
    fingerprint,
    handoff_resolve_policy,
    padded_chain,
)
from kvproc.store.types import SaveClass, SealCursor, StoreConfig
from tests.store.conftest import PAGE, churn, make_store

PROMPT = list(range(1, 11))  # 10 tokens: pages of 4 -> the third page is partial and gets 2 pad tokens


def produce(store, model, rid="prod"):
    """Prefill side: compute the prompt, pad, checkpoint the bounded group, seal + retire with Handoff.
    Returns the envelope and {page hash: bytes of both paged arenas} of the producer's pages."""
    pool = store.pools[0]
    kv = RequestKv(pool, rid, PROMPT, 4)
    assert kv.try_admit()
    kv.schedule(len(PROMPT))
    for b in kv.block_ids:
        for a in range(2):
            model.block(a, b)[:] = torch.randint(0, 256, (256,), dtype=torch.uint8)
    kv.apply()
    assert kv.pad_to_boundary() == 2
    orders = kv.seal_by_copy()
    store.execute_copies(0, orders)
    pages = {h: (model.block(0, b).clone(), model.block(1, b).clone()) for h, b in zip(kv.page_hashes, kv.block_ids)}
    store.retire(0, kv, SealCursor.after_prefix(0), SaveClass.HANDOFF)
    store.flush_saves(0)
    return HandoffEnvelope(rid, "fp", committed_len=len(PROMPT), anchor_token_id=42), pages


def consume(store, env, *, max_out=4):
    chain = padded_chain(PROMPT, env.committed_len, PAGE)
    assert chain.tolist()[-2:] == [PAD_TOKEN_ID] * 2
    pre = store.resolve_prefix_sync(0, "dec", chain, policy=handoff_resolve_policy(env.producer_req_id, 1.0))
    kv = RequestKv(store.pools[0], "dec", PROMPT + [env.anchor_token_id], max_out)
    return pre, kv


def test_decode_adopts_the_padded_chain_and_copies_the_boundary_page_before_appending():
    store, model, tier, _ = make_store(bounded=True)
    with store:
        env, pages = produce(store, model)
        churn(store)  # the decode side is another engine: its device pool does not have the pages
        pre, kv = consume(store, env)
        assert pre.host_tokens == 12 and pre.hold.num_blocks == 3
        shared = pre.hold.block_ids[-1]
        for h, b in zip(pre.hold.hashes, pre.hold.block_ids):  # the producer's bytes, padded page included
            assert torch.equal(model.block(0, b), pages[h][0]) and torch.equal(model.block(1, b), pages[h][1])
        assert kv.try_admit(credited=pre.hold.num_blocks - 1)
        orders = kv.adopt_handoff_prefix(pre.hold, env.committed_len)
        assert {o.kind for o in orders} == {CopyKind.RESTORE, CopyKind.PRIVATIZE}
        store.execute_copies(0, orders)
        private = kv.block_ids[-1]
        assert private != shared and kv.num_computed == 10
        for a in range(2):
            assert torch.equal(model.block(a, private), model.block(a, shared))
        # decode appends into the private page; the shared padded page stays intact and matchable
        before = model.block(0, shared).clone()
        kv.schedule(1)
        model.block(0, private)[:] = 0
        kv.apply([7])
        assert torch.equal(model.block(0, shared), before)
        pool = store.pools[0]
        chain = pool.hasher.hash_prompt(padded_chain(PROMPT, 10, PAGE), pad_tail=True)
        again = pool.probe(chain, 12, ReusePolicy.FULL_PAGES)
        assert again.block_ids[-1] == shared
        kv.release()


def test_the_handoff_lease_is_released_when_the_consumers_load_completes():
    store, model, tier, _ = make_store(bounded=True)
    with store:
        env, _ = produce(store, model)
        assert tier.index.stats()["open_handoffs"] == 1
        churn(store)
        pre, kv = consume(store, env)
        assert pre.host_tokens == 12
        assert tier.index.stats()["open_handoffs"] == 0 and tier.index.stats()["handoffs_consumed"] == 1


def test_a_short_hit_is_rejected_before_admission():
    store, model, tier, copier = make_store(bounded=True, config=StoreConfig(resolve_deadline_s=0.3))
    with store:
        copier.fail_saves = True  # the producer's Handoff save fails: counted, and the consumer sees a short hit
        env, _ = produce(store, model)
        assert store.stats()["store"]["handoff_save_failed"] == 1
        churn(store)
        pre, kv = consume(store, env)
        assert pre.hold.num_blocks < 3
        with pytest.raises(ValueError, match="full hit"):
            kv.try_admit(0) and kv.adopt_handoff_prefix(pre.hold, env.committed_len)
        kv.release()
        pre.hold.release()
        assert store.pools[0].stats()["admitted_requests"] == 0


def test_a_cancelled_requests_handoff_entry_is_revoked():
    store, model, tier, _ = make_store(bounded=True)
    with store:
        env, _ = produce(store, model)
        store.revoke_handoff(env.producer_req_id)
        time.sleep(0.05)
        st = tier.index.stats()
        assert st["open_handoffs"] == 0 and st["handoffs_revoked"] == 1


def test_a_forgotten_handoff_lease_is_reclaimed_by_ttl_and_counted():
    store, model, tier, _ = make_store(bounded=True)
    with store:
        tier.index.handoff_ttl_s = 0.05
        env, _ = produce(store, model)
        time.sleep(0.1)
        out = tier.index.reap()
        assert out["handoffs"] == ["prod"] and tier.index.stats()["handoffs_reclaimed_by_ttl"] == 1


def test_fingerprint_names_shape_layout_page_and_hash_and_a_mismatch_shows_both():
    store, model, _, _ = make_store(bounded=True)
    with store:
        layout = validate_layout(model.spec(), model.arenas(0))
        fp = fingerprint("bytes", layout, HashAlgorithm.BLAKE2B_128)
        assert "page=4" in fp and "state:bounded" in fp and "kv0:256:-" in fp and "blake2b-128" in fp
        other = fingerprint("bytes", layout, HashAlgorithm.XXH3_128)
        with pytest.raises(FingerprintMismatch) as e:
            check_fingerprint(fp, other)
        assert fp in str(e.value) and other in str(e.value)


def test_padded_admission_must_leave_one_block_of_slack():
    store, model, _, _ = make_store(bounded=True)
    with store:
        env, _ = produce(store, model)
        pre, kv = consume(store, env)
        assert kv.try_admit(credited=pre.hold.num_blocks)
        with pytest.raises(ValueError, match="credited"):
            kv.adopt_handoff_prefix(pre.hold, env.committed_len)
        kv.release()
        pre.hold.release()


@pytest.mark.parametrize("producer_mtp,consumer_mtp", [(True, False), (False, True), (True, True)])
def test_an_optional_group_is_part_of_the_pd_fingerprint_both_ways(producer_mtp: bool, consumer_mtp: bool) -> None:
    """The rule (kv-contract, `optional`): a P/D pair declares the same groups, optional ones included; one side
    with an MTP layer and the other without is refused in either direction, naming both fingerprints."""
    from kvproc.engine.models import build_model

    def fp(mtp: bool) -> str:
        model = build_model("mla", num_blocks=8, num_slots=4, page_tokens=16, seed=0, mtp=mtp)
        return fingerprint(model.name, validate_layout(model.spec(), model.arenas(0)), HashAlgorithm.BLAKE2B_128)

    mine, theirs = fp(consumer_mtp), fp(producer_mtp)
    if producer_mtp == consumer_mtp:
        check_fingerprint(mine, theirs)
    else:
        with pytest.raises(FingerprintMismatch, match="mtp"):
            check_fingerprint(mine, theirs)
