"""A hand-off the store cannot deliver is refused with the reason, never accepted with nothing saved (issue 18):
a model whose spec turns prefix caching off, or a rank without a host tier."""

from __future__ import annotations

import numpy as np
import pytest

from kvproc import HandoffUnavailable, RequestKv, SaveClass, SealCursor, build_local_store
from kvproc.engine.engine import Engine
from kvproc.engine.models import build_model
from kvproc.engine.request import Request

PT = 16


def _store(*, drafter: bool, host: bool):  # type: ignore[no-untyped-def]
    model = build_model("mla", num_blocks=32, num_slots=4, page_tokens=PT, seed=1, drafter=drafter)
    return model, build_local_store(model, live_slots=2, host_bytes=(8 << 20) if host else None)


def _computed(store, model, n: int = 40) -> RequestKv:  # type: ignore[no-untyped-def]
    kv = RequestKv(store.pools[0], "p", np.arange(2, 2 + n), 4)
    assert kv.try_admit(0)
    kv.schedule(n)
    kv.apply()
    return kv


@pytest.mark.parametrize("verb", ["seal", "retire"])
def test_a_handoff_seal_with_prefix_caching_off_is_refused_with_the_specs_reason(verb: str) -> None:
    model, store = _store(drafter=True, host=True)
    with store:
        assert not store.spec.prefix_caching
        kv = _computed(store, model)
        cursor = SealCursor()
        with pytest.raises(HandoffUnavailable, match="neither checkpointable nor optional") as err:
            getattr(store, verb)(0, kv, cursor, SaveClass.HANDOFF)
        assert err.value.reason.startswith("prefix caching is off for this model")
        assert store.stats()["store"]["handoff_refused"] == 1
        assert cursor.pending == 0 and cursor.pages == 0  # no save in flight, nothing marked saved
        store.seal(0, kv, cursor, SaveClass.CACHEABLE)  # the control: a cacheable seal is a no-op, as before
        kv.release()


def test_a_handoff_seal_on_a_rank_without_a_host_tier_is_refused() -> None:
    model, store = _store(drafter=False, host=False)
    with store:
        kv = _computed(store, model)
        with pytest.raises(HandoffUnavailable, match="no host tier"):
            store.retire(0, kv, SealCursor(), SaveClass.HANDOFF)
        kv.release()


@pytest.mark.parametrize("drafter,host", [(True, True), (False, False)], ids=["prefix-caching-off", "no-tier"])
def test_the_engine_fails_a_handoff_request_at_intake_with_the_reason_and_keeps_no_kv(drafter: bool,
                                                                                        host: bool) -> None:
    model, store = _store(drafter=drafter, host=host)
    with store:
        pool = store.pools[0]
        free = pool.paged.available
        eng = Engine(model, store, max_batch=2, chunk_tokens=32)
        req = Request.make("h", np.arange(2, 42), 4)
        req.handoff_out = True
        plain = Request.make("n", np.arange(2, 42), 4)
        eng.run([req, plain])
        assert req.failed is not None and req.failed.startswith("handoff: ")
        assert ("neither checkpointable" in req.failed) if drafter else ("no host tier" in req.failed)
        assert req.envelope is None and not req.output
        assert plain.failed is None and len(plain.output) == 4  # the engine kept serving
        assert eng.counters["handoffs_refused"] == 1
        assert pool.paged.available == free  # nothing admitted for it, nothing stranded
