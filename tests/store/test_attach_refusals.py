"""What `ClusterStore.attach_model` refuses, and with which typed error (issue 40 items 5-8): a repack hook no arena
needs (it would never run), a shared tier serving another fingerprint (`FingerprintMismatch`, not a bare
RemoteError), a PER_RANK model on a shared cluster with too few tiers; a REPLICATED model needs only tier[0] of a
shared cluster (`kvproc up --ranks 1`). And the tier's fingerprint is the hand-off's: one definition."""

from __future__ import annotations

import pytest
import torch

from kvproc import FingerprintMismatch, KvContractError, Sharding, fingerprint, model_label, validate_layout
from kvproc.engine.engine import Engine
from kvproc.engine.models import build_model
from kvproc.store import cluster
from kvproc.store.build import build_local_store
from kvproc.store.cluster import ClusterStore
from tests.conftest import BLOCK_BYTES, STORED_EXTRA, ShmBytesModel, cluster_store
from tests.store.conftest import RankShardModel
from tests.store.test_replicated import TOKS, _compute_and_retire, _restore, _spec

pytestmark = pytest.mark.timeout(180)


def test_a_repack_hook_with_no_stored_layout_is_refused_naming_the_arenas() -> None:
    with pytest.raises(KvContractError, match=r"no arena declares a stored_layout.*\['kv0', 'kv1'"):
        with cluster_store(stored=False, repack="tests.conftest:xor_repack"):
            pass
    with cluster_store(stored=True, repack="tests.conftest:xor_repack"):  # the control: declared, accepted
        pass


def test_a_shared_tier_of_another_fingerprint_raises_fingerprint_mismatch() -> None:
    with ClusterStore.start(1 << 20) as owner:  # a tier nobody has configured yet (what `kvproc up` runs)
        with ClusterStore.start(1 << 20, tier_runtime_dir=owner.cluster.runtime_dir) as first:
            first.attach_model(ShmBytesModel(first.allocator, 8), live_slots=1)
            with ClusterStore.start(1 << 20, tier_runtime_dir=owner.cluster.runtime_dir) as second:
                other = ShmBytesModel(second.allocator, 8, stored=True)
                with pytest.raises(FingerprintMismatch, match="host tier.0. refused ShmBytesModel") as e:
                    second.attach_model(other, live_slots=1, repack="tests.conftest:xor_repack")
                assert isinstance(e.value, KvContractError)
                both = (f"kv0:{BLOCK_BYTES + STORED_EXTRA}:xor-trailer-v1", f"kv0:{BLOCK_BYTES}:-")
                assert all(tag in str(e.value) for tag in both)  # both fingerprints


def test_the_tiers_fingerprint_is_the_handoffs() -> None:
    model = build_model("mla", num_blocks=4, num_slots=1)
    layout = validate_layout(model.spec(), model.arenas(0))
    assert cluster.fingerprint(model, layout) == fingerprint(model_label(model), layout)
    store = build_local_store(model, live_slots=1)
    try:
        assert Engine(model, store).fingerprint == cluster.fingerprint(model, layout)  # the engine's P/D one too
    finally:
        store.close()
    assert model_label(model) == "mla" and model_label(object()) == "object"


def test_a_replicated_model_needs_only_tier_0_of_a_shared_cluster() -> None:
    """`kvproc up --ranks 1` serves a 2-rank REPLICATED model (stored once, in tier[0], restored on both ranks); a
    PER_RANK model is refused there, naming `kvproc up --ranks 2`."""
    with ClusterStore.start(1 << 20) as up:  # one shared tier
        with ClusterStore.start(1 << 20, ranks=2, tier_runtime_dir=up.cluster.runtime_dir) as cs:
            model = RankShardModel(_spec(Sharding.PER_RANK), 2, cs.allocator)
            with pytest.raises(RuntimeError, match=r"kvproc up --ranks 2"):
                cs.attach_model(model, live_slots=1)  # type: ignore[arg-type]  # no repack: none needed
        with ClusterStore.start(1 << 20, ranks=2, tier_runtime_dir=up.cluster.runtime_dir) as cs:
            model = RankShardModel(_spec(Sharding.REPLICATED), 2, cs.allocator)
            store = cs.attach_model(model, live_slots=1)  # type: ignore[arg-type]
            written = _compute_and_retire(store, model, 0)
            for r in range(2):
                host, pages = _restore(store, model, r)
                assert host == len(TOKS) - 1, r
                assert all(torch.equal(a, b) for a, b in zip(pages, written, strict=True))
