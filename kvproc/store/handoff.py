"""Prefill/decode hand-off through the store (reference design section 6): the envelope and the fingerprint.

The prefill side pads the prompt's partial last page with PAD_TOKEN_ID (`RequestKv.pad_to_boundary`), checkpoints
every group, seals with `SaveClass.HANDOFF` and emits a `HandoffEnvelope`. The decode side checks the fingerprint
(rejecting a mismatch with both strings), rebuilds the same padded chain (`padded_chain`), resolves it with
`HANDOFF_RESOLVE` (full pages, wait for the full hit, and consume the producer's lease when its load completes),
asserts the full hit before admission, and adopts it with `RequestKv.adopt_handoff_prefix` (copy-on-restore of the
padded page).

Lease decision: the producer's Handoff entries are released when the consumer's **load completes** (the resolve
consumes the lease right after committing the loaded pages), not at the admission assertion: between the two the
pages exist only on the host tier, and releasing earlier would let them be evicted under a consumer that has not
read them. A consumer that hits entirely in its own device pool (no load) releases them at admission
(`KvStore.release_handoff`); a rejected or cancelled request revokes them (`KvStore.revoke_handoff`); a TTL on the
tier reclaims forgotten ones, counted and logged.
"""

from __future__ import annotations

from typing import Sequence

import msgspec
import numpy as np

from kvproc.contract import ArenaLayout, KvContractError, Sharding, require_model_id
from kvproc.core.hashing import (DEFAULT_HASH, DEFAULT_SCOPE, HASH_LAYOUT_VERSION, PAD_TOKEN_ID, BlockHasher,
                                 HashAlgorithm, HashScope)
from kvproc.core.holds import ReusePolicy
from kvproc.core.ownership import ForeignHandleError
from kvproc.store.types import ResolvePolicy

# 2: arenas named with their stored layout (name:bytes:layout); REPLICATED groups marked (":replicated"): their KV is
# stored once for all ranks, a PER_RANK group's per rank, so the two never exchange KV.
HANDOFF_VERSION = 2


class HandoffEnvelope(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the prefill side sends the decode side (through the router), besides the request itself."""

    producer_req_id: str
    fingerprint: str
    committed_len: int  # real prompt tokens whose KV is in the store (the padding is not counted)
    anchor_token_id: int | None  # the first sampled token; None when it was EOS (decode then stops at once)
    draft_tokens: list[int] = []
    # The hex hash of the producer's last padded page (`chain_key`): the prompt the envelope belongs to. The consumer
    # refuses the envelope for any other prompt (or scope) before it resolves, so one request's envelope never
    # consumes another producer's lease or waits for a save that will not come. "" (a producer before this field):
    # not checked.
    chain_key: str = ""


class FingerprintMismatch(KvContractError):
    """The two engines cannot exchange KV: different weights (model id), model shape, layout, page size or hashing.
    Raised by `check_fingerprint` (a hand-off) and by `ClusterStore.attach_model` (a shared tier serving another
    fingerprint)."""




def model_label(model: object) -> str:
    """How a fingerprint names a model: its `name` attribute when it is a non-empty string, else its class name.
    A label only (read by people, in refusals): the identity of the weights is `spec().model_id`."""
    name = getattr(model, "name", None)
    return name if isinstance(name, str) and name else type(model).__name__


def fingerprint(model_name: str, layout: ArenaLayout, algorithm: HashAlgorithm = DEFAULT_HASH,
                salt_version: str = "") -> str:
    """The one fingerprint (a human-readable capability string): equal strings mean the two engines can restore each
    other's KV, through a hand-off (`check_fingerprint`) or a shared host tier (its Configure carries it).

    `model_name`: `model_label(model)` (a label); `layout`: `validate_layout(model.spec(), model.arenas(0))`;
    `algorithm`: the pools' hash family (`pool.hasher.algorithm`, `DEFAULT_HASH` unless you built the pools with
    another); `salt_version`: a version of your cache-salt scheme, if you have one. It covers the weights
    (`model_id`), page size, every group (kind, optional, checkpointable, replicated), every arena's
    `name:stored bytes:stored layout`, and the hash family."""
    spec = layout.spec
    groups = ",".join(
        f"{g.name}:{g.kind.value}{':opt' if g.optional else ''}{':nockpt' if not g.checkpointable else ''}"
        f"{':replicated' if g.sharding is Sharding.REPLICATED else ''}"
        for g in spec.groups
    )
    arenas = ",".join(a.layout_tag for _, a in layout.arenas)
    return (f"kvproc-handoff/v{HANDOFF_VERSION} model={model_name} id={require_model_id(spec, model_name)} "
            f"page={spec.page_tokens} groups=[{groups}] "
            f"stored=[{arenas}] hash={algorithm.value}/v{HASH_LAYOUT_VERSION} salt={salt_version or '-'}")


def check_fingerprint(mine: str, theirs: str) -> None:
    if mine != theirs:
        raise FingerprintMismatch(f"hand-off fingerprint mismatch: producer {theirs!r}, this engine {mine!r}")


def padded_chain(tokens: Sequence[int] | np.ndarray, committed_len: int, page_tokens: int) -> np.ndarray:
    """The producer's padded token chain: the first `committed_len` tokens, padded to the page boundary."""
    arr = np.asarray(tokens, dtype=np.int64)[:committed_len]
    if arr.size != committed_len:
        raise ValueError(f"the request has {arr.size} tokens, the envelope commits {committed_len}")
    pad = (-committed_len) % page_tokens
    return np.concatenate([arr, np.full(pad, PAD_TOKEN_ID, dtype=np.int64)]) if pad else arr


def chain_key(hasher: BlockHasher, tokens: Sequence[int] | np.ndarray, committed_len: int,
              scope: HashScope = DEFAULT_SCOPE) -> str:
    """The envelope's `chain_key` for a prompt: the hex hash of its padded chain's last page."""
    hashes = hasher.hash_prompt(padded_chain(tokens, committed_len, hasher.page_tokens), scope, pad_tail=True)
    return hashes[-1].hex() if len(hashes) else ""


def check_envelope(env: HandoffEnvelope, req_id: str, hasher: BlockHasher, tokens: Sequence[int] | np.ndarray,
                   scope: HashScope = DEFAULT_SCOPE) -> None:
    """Refuse an envelope emitted for another prompt or scope than this request's (`ForeignHandleError`)."""
    if env.chain_key and chain_key(hasher, tokens, env.committed_len, scope) != env.chain_key:
        raise ForeignHandleError(f"the hand-off envelope of producer request {env.producer_req_id!r}",
                                 f"a prompt whose padded chain ends in {env.chain_key[:16]}...",
                                 f"request {req_id!r} (another prompt or scope)")


def handoff_resolve_policy(producer_req_id: str, deadline_s: float | None = None) -> ResolvePolicy:
    return ResolvePolicy(reuse=ReusePolicy.FULL_PAGES, wait_for_full_hit=True, deadline_s=deadline_s,
                         consume_handoff_of=producer_req_id)
