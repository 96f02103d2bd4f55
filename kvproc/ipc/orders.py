"""Copy orders: what a copy worker is asked to move. Metadata only (block ids and slots); the bytes stay in shared
memory. These structs travel inside the copy-worker request messages unchanged.
"""

from __future__ import annotations

import msgspec


class BoundedCopy(msgspec.Struct, array_like=True, frozen=True, gc=False):
    group: str
    device_slot: int  # a staging slot on the device side
    host_slot: int


class SaveOrder(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Device -> host: paged blocks into page slots (pairwise), bounded staging slots into bounded host slots."""

    req_id: str
    device_blocks: list[int]
    host_slots: list[int]
    bounded: list[BoundedCopy] = []
    # The save's fence word and token (`kvproc/tiers/save_fence.py`): claimed before a byte is written, so slots the
    # tier has given back are never written by this order. -1: no fence (a layout without a shared slot table).
    fence: int = -1
    fence_token: int = 0
    # The CUDA IPC handle of the event the engine recorded after the step that wrote these pages (its `step_fence`,
    # `KvStore`): the copy worker's save stream waits on it on the GPU before the batch (`kvproc/workers/
    # cuda_mover.py`). None: no fence (an engine on the CPU, or one that synchronises before it seals). Last, with a
    # default: an older peer's order decodes with None, and an older worker ignores the trailing item.
    after_event: bytes | None = None


class LoadOrder(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Host -> device: page slots into reserved blocks, bounded host slots into reserved staging slots."""

    req_id: str
    host_slots: list[int]
    device_blocks: list[int]
    bounded: list[BoundedCopy] = []
    # The load's fence word and token (`kvproc/tiers/load_fence.py`): claimed before a byte is written, so blocks
    # the store freed after giving up on this order are never written by it. -1: no fence (an in-process copier).
    fence: int = -1
    fence_token: int = 0
    # The host-tier attachment its slots come from (`AttachArenas.host_epoch`): the worker refuses an order from
    # another one -- a hit from a replaced tier, loaded after the worker re-attached to the new tier's segment.
    host_epoch: int = 0


class SlotCopy(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Device -> device: one bounded slot (every arena of the group) into another (seal-by-copy or restore)."""

    group: str
    src_slot: int
    dst_slot: int
