"""Several SGLang backends on one `kvproc up` tier (its own process tree, found through its runtime dir): a page one
backend stored is a hit for another of the same model, page format and shard; another page format or model is
refused by the tier's fingerprint when it attaches; another tensor-parallel shard never sees the first one's pages."""

from __future__ import annotations

import pytest

from kvproc.integrations.sglang import SglangConfigError
from kvproc.integrations.sglang.keys import KeySpace
from tests.integrations.sglang.conftest import PAGE, backend, host_pool, page_bytes, tier_stats
from tests.integrations.sglang.test_sglang_backend import keys, pages

pytestmark = pytest.mark.timeout(180)


def test_two_backends_share_pages_and_other_formats_are_refused(shared_tier: str) -> None:
    writer_pool, reader_pool = host_pool(), host_pool()
    reader_pool.kv_buffer.zero_()
    with backend(writer_pool, tier_runtime_dir=shared_tier) as w, \
            backend(reader_pool, tier_runtime_dir=shared_tier) as r:
        assert w.fingerprint == r.fingerprint and "id=tests/tiny-model page=16" in w.fingerprint
        assert w.batch_set_v1(keys(3), pages(0, 3)) == [True] * 3
        assert r.batch_exists(keys(3)) == 3
        assert r.batch_get_v1(keys(3), pages(4, 3)) == [True] * 3
        assert [page_bytes(reader_pool, p * PAGE) for p in range(4, 7)] == \
            [page_bytes(writer_pool, p * PAGE) for p in range(3)]
        # another host layout, dtype or model: other bytes for the same tokens, refused at attach (the engine
        # fails at start, naming both fingerprints)
        for pool, cfg, differs in [(host_pool("mha", "layer_first"), {}, "layer_first"),
                                   (host_pool(dtype="float16"), {}, "float16"),
                                   (host_pool(), {"model_id": "other/model@v2"}, "other/model@v2"),
                                   (host_pool(heads=4), {}, ":6144:")]:
            with pytest.raises(SglangConfigError, match=f"refused.*{differs}"):
                with backend(pool, tier_runtime_dir=shared_tier, **cfg):
                    pass
        assert r.batch_exists(keys(3)) == 3  # the tier still serves the backends it took


@pytest.mark.parametrize("control", [False, True], ids=["namespaced", "control-no-shard-in-keys"])
def test_another_tensor_parallel_shard_never_sees_the_pages(shared_tier: str, control: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """MHA's heads are split across TP ranks: rank 1's page is not rank 0's. The control drops the shard from the
    key namespace and rank 1 then 'hits' rank 0's bytes: the namespaced assertion is one that can fail."""
    if control:
        orig = KeySpace.__init__
        monkeypatch.setattr(KeySpace, "__init__", lambda self, fp, shard: orig(self, fp, "all"))
    with backend(host_pool(), tier_runtime_dir=shared_tier, tp_rank=0, tp_size=2) as r0, \
            backend(host_pool(), tier_runtime_dir=shared_tier, tp_rank=1, tp_size=2) as r1:
        assert r0.batch_set_v1(keys(2), pages(0, 2)) == [True] * 2
        assert r0.batch_exists(keys(2)) == 2
        assert r1.batch_exists(keys(2)) == (2 if control else 0)


def test_mla_ranks_share_one_copy(shared_tier: str) -> None:
    """MLA's latent is the same on every TP rank: one rank's page serves the others (SGLang writes it once)."""
    p0, p1 = host_pool("mla"), host_pool("mla")
    p1.kv_buffer.zero_()
    with backend(p0, tier_runtime_dir=shared_tier, mla=True, tp_rank=0, tp_size=2) as r0, \
            backend(p1, tier_runtime_dir=shared_tier, mla=True, tp_rank=1, tp_size=2) as r1:
        assert r0.batch_set_v1(keys(2), pages(0, 2)) == [True] * 2
        assert r1.batch_get_v1(keys(2), pages(2, 2)) == [True] * 2
        assert page_bytes(p1, 2 * PAGE) == page_bytes(p0, 0)
        assert tier_stats(r1)["entries"] == 2


def test_a_killed_shared_tier_turns_calls_into_misses_not_errors() -> None:
    """The shared tier's process SIGKILLed under a running backend: SGLang's calls answer misses and failed sets
    (SGLang then recomputes, as without L3) instead of raising into its prefetch and backup threads."""
    import os
    import signal

    from tests.conftest import kvproc_up
    from tests.integrations.sglang.conftest import SGL_CLUSTER

    with kvproc_up(f"{SGL_CLUSTER}k") as (rd, tier_pid):
        with backend(host_pool(), tier_runtime_dir=rd) as b:
            assert b.batch_set_v1(keys(2), pages(0, 2)) == [True] * 2
            os.kill(tier_pid, signal.SIGKILL)  # the tier this test started
            for _ in range(2):
                assert b.batch_exists(keys(2)) == 0
                assert b.batch_get_v1(keys(2), pages(4, 2)) == [False, False]
                assert b.batch_set_v1(keys(2, "n"), pages(0, 2)) == [False, False]
