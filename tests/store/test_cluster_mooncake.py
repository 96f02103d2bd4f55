"""Two "nodes" (two clusters: separate runtime dirs, host tiers and segments) sharing one real Mooncake Store on
loopback (`kvproc/tiers/mooncake.py`): pages saved on one node are written behind to Mooncake and restored on the
other, bit for bit; a host-tier eviction is served back from Mooncake; another model's fingerprint never reaches the
first model's keys; and a dead master or storage node degrades resolves within their deadline, sheds saves (counted),
and the tier reconnects once Mooncake is back."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time

import pytest

from kvproc.core.request_kv import RequestKv
from kvproc.runtime.console import collect
from kvproc.store.kv_store import KvStore
from kvproc.store.types import SaveClass, StoreConfig
from kvproc.tiers.kv_events import BlockStored, decode_batch, endpoints
from kvproc.tiers.mooncake_local import LocalMooncake
from tests.conftest import (
    MooncakeNamespace,
    ShmBytesModel,
    check_bytes,
    churn,
    cluster_store,
    compute,
    kvproc_up,
    nothing_left,
    remote_stats,
    replay_kv_events,
    restores,
    saved,
    wait_for,
    written_behind,
)

pytestmark = pytest.mark.timeout(90)

TOKS = list(range(1, 18))  # 4 full pages of 4 tokens
HOST_6_PAGES = 3 * 4096 + 6 * (512 + 16)  # two 4 KiB-aligned regions and the slot table, 6 page slots


def test_a_prompt_saved_on_node_a_is_restored_on_node_b_from_mooncake(mooncake: MooncakeNamespace) -> None:
    with cluster_store(remote=mooncake.url) as (_, a, model_a), cluster_store(remote=mooncake.url) as (_, b, model_b):
        written = saved(a, model_a, "a", TOKS)
        st = written_behind(a, 4)
        assert st["writes_ok"] == 4 and st.get("writes_refused", 0) == 0
        model_b.zero()
        prefix = b.resolve_prefix_sync(0, "b", TOKS)
        assert prefix.host_tokens == 16  # B's host tier had none of it: all 4 pages came through Mooncake
        check_bytes(model_b, prefix, written)
        prefix.hold.release()
        rb = remote_stats(b)
        assert rb["pulled_pages"] == 4 and rb["pulls_ok"] == 1 and rb["probe_hit_pages"] == 4
        nothing_left(b)
        # Now in B's host tier: a second resolve is a plain host hit (no second pull).
        assert restores(b, model_b, "b2", TOKS, written) == 4
        assert remote_stats(b)["pulls_ok"] == 1
        # Pages pulled from Mooncake are not written back to it.
        assert remote_stats(b).get("writes_ok", 0) == 0


def test_without_remote_node_b_misses(mooncake: MooncakeNamespace) -> None:
    """The control for the test above: the same two nodes, B without the remote tier, restore nothing."""
    with cluster_store(remote=mooncake.url) as (_, a, model_a), cluster_store() as (_, b, _):
        saved(a, model_a, "a", TOKS)
        written_behind(a, 4)
        prefix = b.resolve_prefix_sync(0, "b", TOKS)
        assert prefix.host_tokens == 0
        prefix.hold.release()
        assert remote_stats(b) == {}


def test_host_tier_eviction_on_a_is_served_back_from_mooncake(mooncake: MooncakeNamespace) -> None:
    # 6 page slots on the host: the second and third prompts (4 pages each) evict the first one's pages.
    with cluster_store(host_bytes=HOST_6_PAGES, remote=mooncake.url) as (_, a, model):
        # Each save written behind before the next: write-behind leases a save's pages until Mooncake has them, so
        # in a 6-slot tier a save right behind another may be shed (no room yet), which this test is not about.
        written = saved(a, model, "first", TOKS)
        written_behind(a, 4)
        saved(a, model, "second", list(range(100, 117)))
        written_behind(a, 8)
        saved(a, model, "third", list(range(200, 217)))
        written_behind(a, 12)
        assert a.stats()["tier"]["evictions"] >= 4  # the first prompt's pages are gone from the host tier
        assert restores(a, model, "again", TOKS, written) == 4, remote_stats(a)
        st = remote_stats(a)
        assert st["pulls_ok"] >= 1 and st["pulled_pages"] >= 4
        nothing_left(a)


def test_a_model_with_another_fingerprint_never_sees_the_first_models_keys(mooncake: MooncakeNamespace) -> None:
    with cluster_store(remote=mooncake.url) as (_, a, model_a), \
            cluster_store(remote=mooncake.url, stored=True, repack="tests.conftest:xor_repack") as (_, c, _):
        saved(a, model_a, "a", TOKS)
        written_behind(a, 4)
        prefix = c.resolve_prefix_sync(0, "c", TOKS)  # same tokens, same page hashes: another model's bytes
        assert prefix.host_tokens == 0
        prefix.hold.release()
        st = remote_stats(c)
        assert st["probes"] >= 1 and st.get("probe_hit_pages", 0) == 0 and st.get("pulled_pages", 0) == 0


def test_pages_pulled_for_a_query_after_a_device_hit_are_parented_on_the_page_before_it(
        mooncake: LocalMooncake) -> None:
    """Node B holds the prompt's first page on its device (another prompt with the same first page), so its query
    for the prompt starts at page 1; the pages its tier pulls from Mooncake for that query are one BlockStored whose
    parent is page 0 (`Query.parent`), not a root: a router places them under the prompt's first page. And they are
    published once the pull commits (on Mooncake's thread), not when the next save's handler runs (none comes here)."""
    with cluster_store(remote=mooncake.url) as (_, a, model_a), \
            cluster_store(remote=mooncake.url, kv_events=True) as (cs_b, b, model_b):
        saved(a, model_a, "a", TOKS)
        written_behind(a, 4)
        kv, cur, _, _ = compute(b, model_b, "other", TOKS[:4] + [900 + i for i in range(13)])  # page 0 shared
        b.retire(0, kv, cur)
        b.flush_saves(0, 10)
        wait_for(lambda: b.stats()["tier"]["open_saves"] == 0, what="the other prompt's save committed")
        prefix = b.resolve_prefix_sync(0, "b", TOKS)
        assert prefix.device_tokens == 4 and prefix.host_tokens == 12  # page 0 on the device, 1-3 pulled
        hashes = RequestKv(b.pools[0], "x", TOKS, 0).page_hashes
        prefix.hold.release()
        assert remote_stats(b)["pulled_pages"] == 4  # page 0 for the other prompt's own resolve, then 1-3
        _, replay = endpoints(cs_b.cluster.runtime_dir, 0)

        def pulled() -> list[BlockStored]:
            return [e for _, p in replay_kv_events(replay) for e in decode_batch(p).events
                    if isinstance(e, BlockStored) and e.block_hashes[0] == hashes[1]]

        wait_for(lambda: bool(pulled()), what="the pulled pages' BlockStored")
        (event,) = pulled()
        assert event.block_hashes == hashes[1:4]
        assert event.parent_block_hash == hashes[0]


FAST = "&timeout=1"  # each Mooncake call's deadline: 1 s


@pytest.mark.parametrize("victim", ["master", "storage"])
def test_a_dead_mooncake_degrades_within_the_deadline_sheds_saves_and_reconnects(
        own_mooncake: LocalMooncake, victim: str) -> None:
    config = StoreConfig(resolve_deadline_s=3.0)
    with cluster_store(remote=own_mooncake.url + FAST, config=config) as (_, a, model_a), \
            cluster_store(remote=own_mooncake.url + FAST, config=config) as (_, b, model_b):
        saved(a, model_a, "before", TOKS)
        written_behind(a, 4)
        wait_for(lambda: remote_stats(b)["connected"] == 1, 10, "B connected to Mooncake")
        (own_mooncake.kill_master if victim == "master" else own_mooncake.kill_storage)()
        # B's resolve needs Mooncake: it degrades to a miss, within its deadline.
        t0 = time.monotonic()
        prefix = b.resolve_prefix_sync(0, "b", TOKS)
        took = time.monotonic() - t0
        assert prefix.host_tokens == 0 and took < config.resolve_deadline_s + 1.0, took
        prefix.hold.release()
        nothing_left(b)
        # A's new saves still land in A's host tier (a host hit on A), their write-behind is shed, counted.
        other = list(range(300, 317))
        written = saved(a, model_a, "during", other)
        assert restores(a, model_a, "during-again", other, written) == 4
        wait_for(lambda: remote_stats(a).get("writes_shed_unreachable", 0) > 0 or
                 remote_stats(a).get("writes_refused", 0) > 0, 10, "the write-behind shed")
        st_b = remote_stats(b)
        assert st_b["breaker_opened"] >= 1
        # A hand-off save cannot be written through: its commit is still answered (within the commit's deadline),
        # the failure counted, and the hand-off stays pinned in A's own tier (a consumer on A can still adopt it).
        kv, cur, _, _ = compute(a, model_a, "handoff", list(range(600, 617)))
        t0 = time.monotonic()
        a.retire(0, kv, cur, SaveClass.HANDOFF)
        a.flush_saves(0, 10)
        assert time.monotonic() - t0 < StoreConfig().tier_call_timeout_s + 2.0
        assert a.stats()["store"].get("handoff_save_failed", 0) == 0
        assert remote_stats(a)["handoff_write_through_failed"] >= 1 and a.stats()["tier"]["open_handoffs"] == 1
        a.revoke_handoff("handoff")
        wait_for(lambda: a.stats()["tier"]["open_handoffs"] == 0, what="the hand-off revoked")
        # Mooncake back (a fresh master loses its keys: both processes restart): the tiers reconnect by themselves.
        own_mooncake.restart()
        toks = reconnected_prompt(a, model_a)
        model_b.zero()
        wait_for(lambda: host_tokens(b, toks) == 16, 30, "B pulling from Mooncake again")
        nothing_left(b)


def host_tokens(store: KvStore, toks: list[int]) -> int:
    prefix = store.resolve_prefix_sync(0, f"r{time.monotonic()}", toks)
    prefix.hold.release()
    churn(store)
    return int(prefix.host_tokens)


def reconnected_prompt(store: KvStore, model: ShmBytesModel, timeout: float = 30.0) -> list[int]:
    """Save new prompts until one is written behind in full (the tier reconnected); its tokens."""
    end = time.monotonic() + timeout
    for i in itertools.count():
        assert time.monotonic() < end, "the tier never wrote to Mooncake again"
        before = remote_stats(store).get("writes_ok", 0)
        toks = [5000 + 100 * i + j for j in range(17)]
        saved(store, model, f"after{i}", toks)
        wait_for(lambda: remote_stats(store).get("queued_pages", 1) == 0, 10, "the write-behind idle")
        if remote_stats(store).get("writes_ok", 0) >= before + 4:
            return toks
        time.sleep(0.2)
    raise AssertionError("unreachable")


def test_kvproc_up_remote_writes_behind_and_a_plain_node_pulls_it(mooncake: MooncakeNamespace) -> None:
    """The two ways to configure it: a shared tier (`kvproc up --remote`) on node A, `ClusterStore.start(remote=)`
    on node B."""
    with kvproc_up("mcup", "--remote", mooncake.url) as (rd, _), \
            cluster_store(tier_runtime_dir=rd) as (_, a, model_a), cluster_store(remote=mooncake.url) as (_, b, model_b):
        written = saved(a, model_a, "a", TOKS)
        written_behind(a, 4)
        assert restores(b, model_b, "b", TOKS, written) == 4
        assert remote_stats(b)["pulled_pages"] == 4
        # `kvproc console status` (and /metrics, which reads the same counters) shows the remote tier's counters.
        (tier,) = [r for r in collect(rd) if r["role"] == "host_tier"]
        assert tier["counters"]["remote.writes_ok"] == 4 and tier["counters"]["remote.connected"] == 1


def test_kvproc_up_refuses_a_bad_remote_url() -> None:
    rd = f"/tmp/kvup-mcbad{os.getpid()}"
    up = subprocess.run([sys.executable, "-m", "kvproc", "up", "--cluster", "mcbad", "--runtime-dir", rd,
                         "--host-mib", "8", "--remote", "mooncake://127.0.0.1:1"], capture_output=True, text=True,
                        timeout=60, check=False)
    assert up.returncode != 0 and "metadata" in up.stdout + up.stderr
    assert not os.path.exists(rd)
