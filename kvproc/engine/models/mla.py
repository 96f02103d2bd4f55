"""`mla`: latent attention with a soft sparse indexer, an optional MTP layer and an optional drafter.

Groups (all paged groups share one block-id space, so one allocation serves them all):
- `latent` (paged): per layer, one 144-float row per token = [normalised KV latent (128) | rotated rope key (16)],
  576 bytes in the execution layout. Stored rows are 656 bytes (see `wire.py`), so `repack` runs on every save/load.
- `indexer` (paged, aligned with `latent`): per layer, one indexer key per token. The indexer's scores bias the
  attention logits (a soft top-k): it is read on every step, so a mis-restored indexer block changes the logits,
  while staying continuous in float noise so chunked and one-shot prefill agree.
- `mtp` (paged, optional, `mtp=True`): the KV of one extra MTP layer that drafts the next-next token. It never feeds
  the main logits, which is why it may be missing from a checkpoint.
- `drafter` (bounded, `drafter=True`): the last few final hidden states a drafter reads. It can be neither stored
  nor recomputed from tokens at a hit, so it is declared not checkpointable and prefix caching turns off, visibly.
"""

from __future__ import annotations

import torch

from kvproc.contract import ArenaId, GroupKind, GroupSpec, KvSpec, RepackDirection, Sharding
from kvproc.engine.models import wire
from kvproc.engine.models.base import (
    Allocator,
    PreparedItem,
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
    apply_rope,
    attend,
    paged_write_read,
    rms_norm,
)
from kvproc.engine.models.stack import StackModel


class MlaAttention:
    """Absorbed multi-head latent attention: every head attends over the shared latent rows (an MQA over 144-dim
    keys and 128-dim values), with the per-head up-projections folded into the query and the output."""

    def __init__(self, rng: Rng, hidden: int, heads: int, latent: int, rope: int, nope: int, v_dim: int,
                 idx_heads: int, idx_dim: int, out_gain: float, latent_arena: torch.Tensor,
                 index_arena: torch.Tensor, page_tokens: int) -> None:
        self.heads, self.latent, self.rope, self.nope, self.v_dim = heads, latent, rope, nope, v_dim
        self.idx_heads, self.idx_dim = idx_heads, idx_dim
        self.ln = rng.norm(hidden)
        self.w_q = rng.linear(hidden, heads * (nope + rope))
        self.w_dkv = rng.linear(hidden, latent + rope)
        self.kv_ln = rng.norm(latent)
        self.w_uk = rng.normal(heads, nope, latent, std=1.0 / nope**0.5)
        self.w_uv = rng.normal(heads, latent, v_dim, std=1.0 / latent**0.5)
        self.w_o = rng.linear(heads * v_dim, hidden, out_gain)
        self.w_iq = rng.linear(hidden, idx_heads * idx_dim)
        self.w_ik = rng.linear(hidden, idx_dim)
        self.w_iw = rng.linear(hidden, idx_heads, 0.5)
        self.scale = 1.0 / (nope + rope) ** 0.5
        self.latent_arena, self.index_arena, self.page_tokens = latent_arena, index_arena, page_tokens

    def __call__(self, x: torch.Tensor, ctx: StepCtx) -> torch.Tensor:
        n, h = x.shape[0], self.heads
        xn = rms_norm(x, self.ln)
        q = (xn @ self.w_q).view(n, h, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        q_rope = apply_rope(q_rope, ctx.rope(self.rope))
        q_full = torch.cat([torch.einsum("thn,hnl->thl", q_nope, self.w_uk), q_rope], dim=-1)  # [N, H, 144]
        c, k_rope = (xn @ self.w_dkv).split([self.latent, self.rope], dim=-1)
        k_rope = apply_rope(k_rope[:, None, :], ctx.rope(self.rope))[:, 0]
        rows = torch.cat([rms_norm(c, self.kv_ln), k_rope], dim=-1)  # [N, 144]: the stored latent row
        iq = (xn @ self.w_iq).view(n, self.idx_heads, self.idx_dim)
        ik = xn @ self.w_ik
        iw = xn @ self.w_iw  # per-query weight of each indexer head
        # Values are the whole stored row (keys == values): equal key/value widths keep SDPA on its fused CPU
        # kernel; the 16 rope columns of the output are dropped before the value up-projection.
        out = torch.empty(n, h, self.latent + self.rope)
        plan = ctx.decode_plan(self.page_tokens)
        done: set[int] = set()
        if plan is not None:
            r = plan.rows
            lat = plan.write_read(self.latent_arena, rows[r])  # [B, L, 144]
            keys = plan.write_read(self.index_arena, ik[r])  # [B, L, idx_dim]
            bias = self._index_bias(iq[r][:, None], iw[r][:, None], keys)[:, 0]  # [B, L]
            out[r] = plan.attend(q_full[r], lat[:, :, None, :], lat[:, :, None, :], bias=bias,
                                 scale=self.scale)
            done = set(plan.items)
        for i, (it, (a, b)) in enumerate(zip(ctx.items, ctx.bounds)):
            if i in done:
                continue
            lat = paged_write_read(self.latent_arena, self.page_tokens, it, rows[a:b])  # [L, 144]
            keys = paged_write_read(self.index_arena, self.page_tokens, it, ik[a:b])  # [L, idx_dim]
            bias = self._index_bias(iq[a:b][None], iw[a:b][None], keys[None])[0]  # [T, L]
            out[a:b] = attend(q_full[a:b], lat[:, None, :], lat[:, None, :], it.positions, None,
                              bias=bias, scale=self.scale)
        o = torch.einsum("thl,hlv->thv", out[..., : self.latent], self.w_uv)
        return o.reshape(n, h * self.v_dim) @ self.w_o

    def _index_bias(self, iq: torch.Tensor, iw: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Indexer scores [B, T, L] = sum_h w[t,h] * relu(q[t,h] . k[s]), scaled to a modest logit bias."""
        s = torch.relu(torch.einsum("bthd,bsd->bths", iq, keys))
        return torch.einsum("bths,bth->bts", s, iw) * (1.0 / self.idx_dim**0.5)


class MlaModel(StackModel):
    name = "mla"
    LATENT, INDEXER, MTP, DRAFTER = "latent", "indexer", "mtp", "drafter"

    def __init__(self, num_blocks: int, num_slots: int, *, page_tokens: int = 16, seed: int = 0,
                 allocator: Allocator = default_allocator, device: str = "cpu",
                 vocab_size: int = 4096, hidden: int = 256,
                 layers: int = 3, heads: int = 4, latent: int = 128, rope: int = 16, nope: int = 32,
                 v_dim: int = 64, idx_heads: int = 2, idx_dim: int = 32, mlp: int = 512, mtp: bool = False,
                 drafter: bool = False, draft_window: int = 4) -> None:
        super().__init__(num_blocks, num_slots, page_tokens=page_tokens, seed=seed, allocator=allocator,
                         device=device)
        if latent + rope != wire.EXEC_ROW_FLOATS:
            raise ValueError(f"mla: latent+rope must be {wire.EXEC_ROW_FLOATS} floats (the 576-byte execution row"
                             f" the wire layout is defined for), got {latent}+{rope}")
        self.vocab_size = vocab_size
        self.eos_token_id = 1
        self.mtp, self.drafter, self.draft_window, self.hidden = mtp, drafter, draft_window, hidden
        groups = [GroupSpec(self.LATENT, GroupKind.PAGED, Sharding.PER_RANK),
                  GroupSpec(self.INDEXER, GroupKind.PAGED, Sharding.PER_RANK)]
        if mtp:
            groups.append(GroupSpec(self.MTP, GroupKind.PAGED, Sharding.PER_RANK, optional=True))
        if drafter:
            groups.append(GroupSpec(self.DRAFTER, GroupKind.BOUNDED, Sharding.PER_RANK, checkpointable=False,
                                    optional=False))
        self._spec = KvSpec(page_tokens, tuple(groups))
        rng, gain = self._rng, 1.0 / (2 * layers) ** 0.5
        self.head = LmHead(rng, vocab_size, hidden)
        self.blocks: list[Block] = []
        for i in range(layers):
            lat = self._alloc(self.LATENT, f"mla.L{i}.latent", num_blocks, page_tokens * wire.EXEC_ROW_FLOATS,
                              stored_bytes_per_block=page_tokens * wire.WIRE_ROW_BYTES, stored_layout=wire.WIRE_LAYOUT)
            idx = self._alloc(self.INDEXER, f"mla.L{i}.index_k", num_blocks, page_tokens * idx_dim)
            attn = MlaAttention(rng, hidden, heads, latent, rope, nope, v_dim, idx_heads, idx_dim, gain, lat, idx,
                                page_tokens)
            self.blocks.append(Block(attn, Mlp(rng, hidden, mlp, gain)))
        # Weights of optional parts are drawn after the trunk, so enabling them leaves the main logits unchanged.
        self.mtp_block: Block | None = None
        if mtp:
            proj = GqaProj(rng, hidden, 4, 2, 32, 1.0)
            arena = self._alloc(self.MTP, "mla.mtp.kv", num_blocks, page_tokens * proj.row_floats)
            self.mtp_block = Block(PagedGqaLayer(proj, arena, page_tokens), Mlp(rng, hidden, mlp, 1.0))
        self.drafter_state: torch.Tensor | None = None
        if drafter:
            self.drafter_state = self._alloc(self.DRAFTER, "mla.drafter.hidden", num_slots,
                                             draft_window * hidden).view(num_slots, draft_window, hidden)
            self.w_draft = rng.linear(hidden, hidden)
        # Side outputs of the last forward (greedy drafts); the engine may ignore them.
        self.last_mtp_draft: torch.Tensor | None = None
        self.last_drafter_draft: torch.Tensor | None = None

    def repack(self, group: str, direction: RepackDirection, src: torch.Tensor, dst: torch.Tensor,
               arena: ArenaId) -> None:
        if group == self.LATENT:
            wire.repack_latent(RepackDirection(direction), src, dst)
        else:
            super().repack(group, direction, src, dst, arena)

    def _forward(self, items: list[PreparedItem]) -> torch.Tensor:
        x, ctx = self._hidden(items)
        last = ctx.last_rows()
        hf = self.head.final_hidden(x)
        if self.mtp_block is not None:
            hm = self.mtp_block(hf, ctx)
            self.last_mtp_draft = self.head.logits(self.head.final_hidden(hm[last])).argmax(-1)
        if self.drafter_state is not None:
            self._update_drafter(ctx, hf)
        return self.head.logits(hf[last])

    def _update_drafter(self, ctx: StepCtx, hf: torch.Tensor) -> None:
        """Roll the newest hidden states into each live drafter slot (index p % window), then draft from it."""
        assert self.drafter_state is not None
        w = self.draft_window
        slots = []
        for it, (a, b) in zip(ctx.items, ctx.bounds):
            m = min(w, it.length)
            slot = it.slots[self.DRAFTER]
            self.drafter_state[slot, it.positions[-m:] % w] = hf[b - m : b]
            slots.append(slot)
        summary = self.drafter_state[torch.tensor(slots)].mean(1)
        self.last_drafter_draft = self.head.logits(self.head.final_hidden(summary @ self.w_draft)).argmax(-1)
