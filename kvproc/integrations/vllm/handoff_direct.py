"""P/D in vLLM: the hand-off's pages go straight between vLLM's blocks and the shared tier's slots, one copy each
way: the consumer leases the producer's pages in the tier and the mover copies them once, into vLLM's blocks.

- producer: its saves are `SaveClass.HANDOFF` saves (vLLM's blocks -> the tier's slots), the
  prompt's partial last page keyed as the padded chain's last page (`padded_tail_key`: the pad rows are whatever
  vLLM's block holds there, never read). A HANDOFF commit pins every key it names, the pages the tier had already
  (deduplicated, not copied) included, for the producer's request until the consumer consumes it or the tier's
  hand-off TTL.
- consumer: `full_hit` waits (up to the consumer's `handoff_wait_s`) until the tier holds the whole padded chain
  (a save landing: its commit; a save not reserved yet: its last key) and leases it, as the store's
  `handoff_resolve_policy` resolve does; anything shorter is a short hit (leases released: vLLM computes). The
  connector consumes the producer's hand-off (`KvStore.release_handoff`) once the load settled.

Tensor parallel (`tp.py`): each rank's tier is waited for and leased the same way (`full_hit_ranked`); the hit
counts only when every rank's tier has the whole chain.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvproc.core.hashing import PAD_TOKEN_ID, BlockHasher, HashScope
from kvproc.ipc.errors import reason_of
from kvproc.store.handoff import padded_chain
from kvproc.tiers.host_index import Hit, Loading

if TYPE_CHECKING:
    from kvproc.integrations.vllm.tp import RankedTier
    from kvproc.store.host_direct import HostDirect

__all__ = ["full_hit", "full_hit_ranked", "handoff_keys", "padded_tail_key"]


def handoff_keys(hasher: BlockHasher, tokens: Sequence[int], committed_len: int, scope: HashScope) -> list[bytes]:
    """The tier keys of a hand-off: the pages of the first `committed_len` tokens, the last one padded."""
    return list(hasher.hash_prompt(padded_chain(tokens, committed_len, hasher.page_tokens), scope, pad_tail=True))


def padded_tail_key(hasher: BlockHasher, tail: Sequence[int], scope: HashScope, parent: bytes | None) -> bytes:
    """The key of a prompt's partial last page `tail` (fewer tokens than a page), padded, after page `parent`."""
    pad = hasher.page_tokens - len(tail)
    if not 0 < pad < hasher.page_tokens:
        raise ValueError(f"a padded page needs 1..{hasher.page_tokens - 1} tokens, got {len(tail)}")
    return bytes(hasher.hash_prompt(list(tail) + [PAD_TOKEN_ID] * pad, scope, parent=parent, pad_tail=True)[0])


async def full_hit(direct: "HostDirect", req_id: str, keys: list[bytes], wait_s: float) -> Hit | None:
    """Lease all of `keys` in `direct`'s tier, waiting up to `wait_s` for a producer's saves to land; None (nothing
    leased, the outcome recorded) when the tier does not hold them all by then."""
    tier, store = direct.tier, direct.store
    deadline = time.monotonic() + wait_s
    waited_key = False  # the last key was committed: a query still short now has a hole (evicted): it stays short
    reason = "deadline_full_hit"
    try:
        while (remaining := deadline - time.monotonic()) > 0:
            if not tier.available:
                reason = "tier_unavailable"
                break
            step = min(remaining, direct.timeout_s)
            got = await asyncio.wait_for(tier.query(req_id, keys, timeout=step), step + 1.0)
            if isinstance(got, Loading):  # the producer's save of these pages is landing: its commit is a moment away
                await asyncio.wait_for(tier.wait_settled(got.save_id, timeout=step), step + 1.0)
                continue
            if isinstance(got, Hit) and got.pages == len(keys):
                store.outcomes.record("resolve", req_id, "ok", "handoff")
                return got
            if isinstance(got, Hit):
                tier.release_lease(got.lease_id)
            if waited_key:
                reason = "handoff_hole"
                break
            # Not saved yet (the producer's mover has not reserved it): wait for its last page, then ask again.
            waited_key = bool(await asyncio.wait_for(tier.wait_key(keys[-1], timeout=step), step + 1.0))
    except Exception as e:  # noqa: BLE001 - a failed query is a short hit, recorded
        reason = reason_of(e)
    store.outcomes.record("resolve", req_id, "degraded", reason)
    return None


async def full_hit_ranked(ranked: "RankedTier", req_id: str, keys: list[bytes], wait_s: float) -> list[Hit] | None:
    """`full_hit` on every rank's tier at once: one lease per rank (a REPLICATED model's one tier's, for every
    rank), or None with every lease released when one rank's tier does not hold the whole chain."""
    got = await asyncio.gather(*(full_hit(d, req_id, keys, wait_s) for d in ranked.directs))
    if any(h is None for h in got):
        for d, h in zip(ranked.directs, got):
            if h is not None:
                d.tier.release_lease(h.lease_id)
        return None
    return ranked.per_rank([h for h in got if h is not None])
