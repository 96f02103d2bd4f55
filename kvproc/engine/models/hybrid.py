"""`hybrid`: gated linear-attention layers (recurrent + conv state, bounded) interleaved with paged full attention.

The bounded group `linear` has two arenas, one slot spanning both:
- `hybrid.recurrent`: per linear layer and head, the d x d state S (S_t = g_t * S_{t-1} + k_t^T v_t);
- `hybrid.conv`: per linear layer, the last (kernel-1) pre-conv inputs of the short causal conv.
A live slot holds exactly the state after `start_pos` tokens; zeros are the state before the first token.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F

from kvproc.contract import GroupKind, GroupSpec, KvSpec, Sharding
from kvproc.engine.models.base import (
    Allocator,
    Rng,
    default_allocator,
)
from kvproc.engine.models.layers import (
    Block,
    GqaProj,
    LmHead,
    Mlp,
    PagedGqaLayer,
    StepCtx,
    rms_norm,
)
from kvproc.engine.models.stack import StackModel

_SUB_CHUNK = 64  # tokens per step of the chunkwise recurrence: O(T * 64) work instead of a per-token loop


def gated_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor,
                           state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise-exact gated linear attention. q, k, v: [B, H, T, d]; log_g: [B, H, T] (log decay <= 0);
    state: [B, H, d, d]. Returns (outputs [B, H, T, d], state after the last token).

    Within a sub-chunk, with b_t the cumulative log decay: o_t = e^{b_t} q_t S_0 + sum_{s<=t} e^{b_t-b_s}(q_t.k_s) v_s
    and S_end = e^{b_C} S_0 + sum_s e^{b_C-b_s} k_s^T v_s. Only differences b_t - b_s <= 0 are exponentiated, so
    nothing overflows however long the chunk.
    """
    t = q.shape[2]
    outs = []
    for a in range(0, t, _SUB_CHUNK):
        e = min(t, a + _SUB_CHUNK)
        qc, kc, vc = q[:, :, a:e], k[:, :, a:e], v[:, :, a:e]
        b = log_g[:, :, a:e].cumsum(-1)
        n = e - a
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        decay = (b[..., :, None] - b[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        scores = (qc @ kc.transpose(-1, -2)) * decay
        outs.append(scores @ vc + (qc * b[..., None].exp()) @ state)
        tail = (b[..., -1:] - b).exp()[..., None]  # decay from each token to the sub-chunk's end
        state = b[..., -1, None, None].exp() * state + (kc * tail).transpose(-1, -2) @ vc
    return torch.cat(outs, dim=2), state


class LinearRecurrentLayer:
    """Short causal conv over the q/k/v inputs, then per-head gated linear attention with bounded state."""

    def __init__(self, rng: Rng, hidden: int, heads: int, head_dim: int, conv_kernel: int, out_gain: float,
                 state: torch.Tensor, conv: torch.Tensor, group: str) -> None:
        self.heads, self.d, self.kernel, self.group = heads, head_dim, conv_kernel, group
        width = 3 * heads * head_dim
        self.ln = rng.norm(hidden)
        self.w_in = rng.linear(hidden, width)
        self.conv_w = rng.normal(width, conv_kernel, std=1.0 / conv_kernel**0.5)
        self.w_a = rng.linear(hidden, heads, 0.5)
        self.out_ln = rng.norm(head_dim)
        self.w_o = rng.linear(heads * head_dim, hidden, out_gain)
        self.state = state  # [slots, heads, d, d] view into the recurrent arena
        self.conv = conv  # [slots, kernel-1, width] view into the conv arena

    def __call__(self, x: torch.Tensor, ctx: StepCtx) -> torch.Tensor:
        h, d, kk = self.heads, self.d, self.kernel
        xn = rms_norm(x, self.ln)
        u = xn @ self.w_in
        # Decay per head and token in (0, 1), biased towards long memory (g ~ 0.95).
        log_g = F.logsigmoid(xn @ self.w_a + 3.0)
        out = torch.empty(x.shape[0], h, d)
        # Items with the same chunk length run as one batch (a decode step is one batch of T=1).
        by_len: dict[int, list[int]] = defaultdict(list)
        for i, it in enumerate(ctx.items):
            by_len[it.length].append(i)
        for t, idx in by_len.items():
            rows = torch.cat([torch.arange(*ctx.bounds[i]) for i in idx])
            slots = torch.tensor([ctx.items[i].slots[self.group] for i in idx], dtype=torch.long)
            nb = len(idx)
            ext = torch.cat([self.conv[slots], u[rows].view(nb, t, -1)], dim=1)  # [B, kernel-1+T, width]
            self.conv[slots] = ext[:, -(kk - 1) :]
            mixed = F.silu((ext.unfold(1, kk, 1) * self.conv_w).sum(-1))  # [B, T, width]
            q, k, v = mixed.view(nb, t, 3, h, d).permute(2, 0, 3, 1, 4)  # each [B, H, T, d]
            q = F.normalize(q, dim=-1) * d**-0.5
            k = F.normalize(k, dim=-1)
            o, s = gated_linear_attention(q, k, v, log_g[rows].view(nb, t, h).transpose(1, 2), self.state[slots])
            self.state[slots] = s
            out[rows] = o.transpose(1, 2).reshape(nb * t, h, d)
        return rms_norm(out, self.out_ln).flatten(1) @ self.w_o


class HybridModel(StackModel):
    name = "hybrid"
    ATTN, LINEAR = "attn", "linear"

    def __init__(self, num_blocks: int, num_slots: int, *, page_tokens: int = 16, seed: int = 0,
                 allocator: Allocator = default_allocator, device: str = "cpu",
                 vocab_size: int = 4096, hidden: int = 256,
                 layers: int = 4, full_attention_every: int = 2, heads: int = 8, kv_heads: int = 2,
                 head_dim: int = 32, linear_heads: int = 4, linear_head_dim: int = 32, conv_kernel: int = 4,
                 mlp: int = 512) -> None:
        super().__init__(num_blocks, num_slots, page_tokens=page_tokens, seed=seed, allocator=allocator,
                         device=device)
        self.vocab_size = vocab_size
        self.eos_token_id = 1
        full = [i for i in range(layers) if (i + 1) % full_attention_every == 0]
        lin = [i for i in range(layers) if i not in full]
        if not full or not lin:
            raise ValueError(f"hybrid: needs both kinds of layer, got full={full} linear={lin}")
        self._spec = KvSpec(page_tokens, (GroupSpec(self.ATTN, GroupKind.PAGED, Sharding.PER_RANK),
                                          GroupSpec(self.LINEAR, GroupKind.BOUNDED, Sharding.PER_RANK)))
        width = 3 * linear_heads * linear_head_dim
        state = self._alloc(self.LINEAR, "hybrid.recurrent", num_slots,
                            len(lin) * linear_heads * linear_head_dim**2)
        state = state.view(num_slots, len(lin), linear_heads, linear_head_dim, linear_head_dim)
        conv = self._alloc(self.LINEAR, "hybrid.conv", num_slots, len(lin) * (conv_kernel - 1) * width)
        conv = conv.view(num_slots, len(lin), conv_kernel - 1, width)
        rng, gain = self._rng, 1.0 / (2 * layers) ** 0.5
        self.head = LmHead(rng, vocab_size, hidden)
        self.blocks: list[Block] = []
        for i in range(layers):
            mixer: object
            if i in full:
                proj = GqaProj(rng, hidden, heads, kv_heads, head_dim, gain)
                arena = self._alloc(self.ATTN, f"hybrid.L{i}.kv", num_blocks, page_tokens * proj.row_floats)
                mixer = PagedGqaLayer(proj, arena, page_tokens)
            else:
                j = lin.index(i)
                mixer = LinearRecurrentLayer(rng, hidden, linear_heads, linear_head_dim, conv_kernel, gain,
                                             state[:, j], conv[:, j], self.LINEAR)
            self.blocks.append(Block(mixer, Mlp(rng, hidden, mlp, gain)))
