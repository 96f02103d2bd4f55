"""`swa`: interleaved sliding-window (local) and full (global) GQA layers.

Global layers keep K/V in the paged group `global`. Local layers keep the last `window` tokens' K/V in a ring, the
bounded group `swa` (one arena per local layer): position p lives at ring index p % window, and a live slot holds
the ring after `start_pos` tokens.
"""

from __future__ import annotations

import torch

from kvproc.contract import GroupKind, GroupSpec, KvSpec, Sharding
from kvproc.engine.models.base import (
    Allocator,
    default_allocator,
)
from kvproc.engine.models.layers import (
    Block,
    GqaProj,
    LmHead,
    Mlp,
    PagedGqaLayer,
    StepCtx,
    attend,
)
from kvproc.engine.models.stack import StackModel

_Q_BLOCK = 128  # long chunks attend in query blocks: each needs only the ring and the last `window` chunk keys
_NOWHERE = -(2**40)  # position given to ring entries not yet written: always outside every query's window


class RingGqaLayer:
    def __init__(self, proj: GqaProj, ring: torch.Tensor, window: int, group: str) -> None:
        self.proj, self.ring, self.window, self.group = proj, ring, window, group  # ring: [slots, window, row]

    def __call__(self, x: torch.Tensor, ctx: StepCtx) -> torch.Tensor:
        w = self.window
        q, k, v = self.proj.qkv(x, ctx)
        rows = torch.cat([k.flatten(1), v.flatten(1)], dim=1)
        out = torch.empty(x.shape[0], self.proj.heads, self.proj.head_dim)
        ring_idx = torch.arange(w)
        for it, (a, b) in zip(ctx.items, ctx.bounds):
            slot = it.slots[self.group]
            ring = self.ring[slot].clone()  # read before this chunk overwrites it
            # The position held at ring index j: the latest p < start with p % w == j (negative: never written).
            ring_pos = it.start - 1 - (it.start - 1 - ring_idx) % w
            ring_pos = torch.where(ring_pos >= 0, ring_pos, _NOWHERE)
            for qa in range(0, it.length, _Q_BLOCK):
                qb = min(it.length, qa + _Q_BLOCK)
                lo = max(0, qa - w + 1)  # earliest chunk key any query of this block can see
                keys = torch.cat([ring, rows[a + lo : a + qb]]) if qa < w else rows[a + lo : a + qb]
                kpos = torch.cat([ring_pos, it.positions[lo:qb]]) if qa < w else it.positions[lo:qb]
                kk, vv = self.proj.split_rows(keys)
                out[a + qa : a + qb] = attend(q[a + qa : a + qb], kk, vv, it.positions[qa:qb], kpos, window=w)
            m = min(w, it.length)
            self.ring[slot, it.positions[-m:] % w] = rows[b - m : b]
        return out.flatten(1) @ self.proj.w_o


class SwaModel(StackModel):
    name = "swa"
    GLOBAL, LOCAL = "global", "swa"

    def __init__(self, num_blocks: int, num_slots: int, *, page_tokens: int = 16, seed: int = 0,
                 allocator: Allocator = default_allocator, device: str = "cpu",
                 vocab_size: int = 4096, hidden: int = 256,
                 layers: int = 4, global_every: int = 2, window: int = 32, heads: int = 8, kv_heads: int = 2,
                 head_dim: int = 32, mlp: int = 512) -> None:
        super().__init__(num_blocks, num_slots, page_tokens=page_tokens, seed=seed, allocator=allocator,
                         device=device)
        self.vocab_size = vocab_size
        self.eos_token_id = 1
        self.window = window
        glob = [i for i in range(layers) if (i + 1) % global_every == 0]
        if not glob or len(glob) == layers or window <= 0:
            raise ValueError(f"swa: needs local and global layers and window > 0, got global={glob}, window={window}")
        self._spec = KvSpec(page_tokens, (GroupSpec(self.GLOBAL, GroupKind.PAGED, Sharding.PER_RANK),
                                          GroupSpec(self.LOCAL, GroupKind.BOUNDED, Sharding.PER_RANK)))
        rng, gain = self._rng, 1.0 / (2 * layers) ** 0.5
        self.head = LmHead(rng, vocab_size, hidden)
        self.blocks: list[Block] = []
        for i in range(layers):
            proj = GqaProj(rng, hidden, heads, kv_heads, head_dim, gain)
            mixer: object
            if i in glob:
                arena = self._alloc(self.GLOBAL, f"swa.L{i}.kv", num_blocks, page_tokens * proj.row_floats)
                mixer = PagedGqaLayer(proj, arena, page_tokens)
            else:
                ring = self._alloc(self.LOCAL, f"swa.L{i}.ring", num_slots, window * proj.row_floats)
                mixer = RingGqaLayer(proj, ring.view(num_slots, window, proj.row_floats), window, self.LOCAL)
            self.blocks.append(Block(mixer, Mlp(rng, hidden, mlp, gain)))
