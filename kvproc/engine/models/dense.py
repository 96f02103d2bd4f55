"""`dense`: a GQA transformer with full attention; one paged group, one arena per layer."""

from __future__ import annotations

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
)
from kvproc.engine.models.stack import StackModel


class DenseModel(StackModel):
    name = "dense"
    GROUP = "attn"

    def __init__(self, num_blocks: int, num_slots: int, *, page_tokens: int = 16, seed: int = 0,
                 allocator: Allocator = default_allocator, device: str = "cpu",
                 vocab_size: int = 4096, hidden: int = 256,
                 layers: int = 3, heads: int = 8, kv_heads: int = 2, head_dim: int = 32, mlp: int = 512) -> None:
        super().__init__(num_blocks, num_slots, page_tokens=page_tokens, seed=seed, allocator=allocator,
                         device=device)
        self.vocab_size = vocab_size
        self.eos_token_id = 1
        self._spec = KvSpec(page_tokens, (GroupSpec(self.GROUP, GroupKind.PAGED, Sharding.PER_RANK),))
        rng, gain = self._rng, 1.0 / (2 * layers) ** 0.5
        self.head = LmHead(rng, vocab_size, hidden)
        self.blocks: list[Block] = []
        for i in range(layers):
            proj = GqaProj(rng, hidden, heads, kv_heads, head_dim, gain)
            arena = self._alloc(self.GROUP, f"dense.L{i}.kv", num_blocks, page_tokens * proj.row_floats)
            self.blocks.append(Block(PagedGqaLayer(proj, arena, page_tokens), Mlp(rng, hidden, mlp, gain)))
