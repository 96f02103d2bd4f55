"""Two SGLang nodes, each with its own `kvproc up` host tier, node A's with `--remote` over a Mooncake Store on
loopback (a master and a storage node, real processes): a page A's backend stored reaches node B through Mooncake (A's
tier writes it behind, B's pulls it on its miss), bit for bit. The control: B's tier without `--remote` never sees
it, so the hit is Mooncake's. Skipped, with the reason, where the `remote` extra or libibverbs is missing in
`.venv-sglang`."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.conftest import kvproc_up
from tests.integrations.sglang.conftest import PAGE, SGL_CLUSTER, backend, host_pool, page_bytes, tier_stats
from tests.integrations.sglang.test_sglang_backend import keys, pages

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("b_remote", [True, False], ids=["b-on-mooncake", "control-b-without-remote"])
def test_a_page_reaches_another_nodes_tier_through_mooncake(own_mooncake: Any, b_remote: bool) -> None:
    url = own_mooncake.url
    pa, pb = host_pool(), host_pool()
    pb.kv_buffer.zero_()
    with kvproc_up(f"{SGL_CLUSTER}ra", "--remote", url) as (rd_a, _), \
            kvproc_up(f"{SGL_CLUSTER}rb", *(["--remote", url] if b_remote else [])) as (rd_b, _), \
            backend(pa, tier_runtime_dir=rd_a) as a, backend(pb, tier_runtime_dir=rd_b) as b:
        assert a.batch_set_v1(keys(3), pages(0, 3)) == [True] * 3
        # A's tier writes the pages behind to Mooncake (a generous deadline for a loaded machine, not a timing
        # assertion): once they are there, B's first look decides
        end = time.monotonic() + 60
        while tier_stats(a).get("remote.written_bytes", 0) < 3 * 3072 and time.monotonic() < end:
            time.sleep(0.1)
        assert tier_stats(a)["remote.written_bytes"] >= 3 * 3072
        if not b_remote:
            assert b.batch_exists(keys(3)) == 0
            assert b.batch_get_v1(keys(3), pages(4, 3)) == [False] * 3
            return
        assert b.batch_exists(keys(3)) == 3
        assert b.batch_get_v1(keys(3), pages(4, 3)) == [True] * 3
        assert [page_bytes(pb, p * PAGE) for p in range(4, 7)] == [page_bytes(pa, p * PAGE) for p in range(3)]
        assert tier_stats(b)["remote.pulled_pages"] == 3
