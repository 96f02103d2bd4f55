"""Building blocks shared by the tiny models: norms, RoPE, MLP, attention over arena-resident KV.

A forward step concatenates every item's new tokens on one axis (N rows) so projections and MLPs are one matmul for
the whole batch; only the parts that touch a sequence's own KV (paged blocks, a ring slot) loop over items.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvproc.engine.models.base import PreparedItem, Rng


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@dataclass
class StepCtx:
    """What every layer needs about the batch, built once per forward."""

    items: list[PreparedItem]
    bounds: list[tuple[int, int]]  # item i's rows in the concatenated token axis
    positions: torch.Tensor  # long [N]
    _rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _decode: DecodePlan | None | bool = False  # False: not built yet; None: fewer than two decode items

    @staticmethod
    def build(items: list[PreparedItem]) -> StepCtx:
        bounds, off = [], 0
        for it in items:
            bounds.append((off, off + it.length))
            off += it.length
        return StepCtx(items, bounds, torch.cat([it.positions for it in items]))

    def rope(self, dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [N, 1, dim/2] for the batch's absolute positions (cached per rotary width)."""
        if dim not in self._rope:
            inv = theta ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
            ang = self.positions.to(torch.float32)[:, None] * inv[None, :]
            self._rope[dim] = (ang.cos()[:, None, :], ang.sin()[:, None, :])
        return self._rope[dim]

    def decode_plan(self, page_tokens: int) -> DecodePlan | None:
        """Batched gather plan for the single-token items (None when fewer than two: the loop is as fast)."""
        if self._decode is False:
            self._decode = DecodePlan.build(self, page_tokens)
        return self._decode  # type: ignore[return-value]

    def last_rows(self) -> torch.Tensor:
        return torch.tensor([b - 1 for _, b in self.bounds], dtype=torch.long)


@dataclass
class DecodePlan:
    """Single-token items of a step, attended together: each gathers its whole paged prefix, padded to the longest.

    Built once per forward and reused by every paged layer, so a decode batch costs one gather and one attention
    call per layer instead of one per sequence.
    """

    items: list[int]  # indices into ctx.items
    rows: torch.Tensor  # long [B], their rows in the concatenated token axis
    write_rows: torch.Tensor  # long [B], flat arena row of each new token
    gather: torch.Tensor  # long [B, nbmax], each item's blocks (padding -> block 0, masked)
    mask: torch.Tensor  # bool [B, 1, 1, nbmax * page_tokens], True for the item's real positions

    @staticmethod
    def build(ctx: StepCtx, page_tokens: int) -> DecodePlan | None:
        idx = [i for i, it in enumerate(ctx.items) if it.length == 1]
        if len(idx) < 2:
            return None
        nbmax = max(ctx.items[i].read_blocks.numel() for i in idx)
        gather = torch.zeros(len(idx), nbmax, dtype=torch.long)
        mask = torch.zeros(len(idx), nbmax * page_tokens, dtype=torch.bool)
        for j, i in enumerate(idx):
            it = ctx.items[i]
            gather[j, : it.read_blocks.numel()] = it.read_blocks
            mask[j, : it.total] = True
        rows = torch.tensor([ctx.bounds[i][0] for i in idx], dtype=torch.long)
        write = torch.cat([ctx.items[i].write_rows for i in idx])
        return DecodePlan(idx, rows, write, gather, mask[:, None, None, :])

    def write_read(self, arena: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Write the B new rows [B, R], then gather every item's blocks -> [B, nbmax * page_tokens, R].

        Whole blocks are gathered (index_select of large rows is far faster than a per-token gather); positions
        past an item's length are masked out by `mask`.
        """
        r = rows.shape[1]
        arena.view(-1, r).index_copy_(0, self.write_rows, rows)
        b = self.gather.shape[0]
        return arena.index_select(0, self.gather.view(-1)).view(b, -1, r)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, bias: torch.Tensor | None = None,
               scale: float | None = None) -> torch.Tensor:
        """q [B, Hq, D], k [B, Lmax, Hk, D], v [B, Lmax, Hk, Dv] -> [B, Hq, Dv]; bias [B, Lmax] is optional."""
        mask = self.mask if bias is None else bias[:, None, None, :].masked_fill(~self.mask, float("-inf"))
        out = F.scaled_dot_product_attention(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[2])
        return out[:, :, 0, :]


def apply_rope(x: torch.Tensor, cs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate [N, heads, dim] by absolute position (half-split layout). Keys are stored already rotated."""
    cos, sin = cs
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


_Q_BLOCK = 256


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor | None,
           *, window: int | None = None, bias: torch.Tensor | None = None,
           scale: float | None = None) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over k [L, Hk, D], v [L, Hk, Dv] -> [T, Hq, Dv].

    `k_pos` None means keys are positions 0..L-1 (a paged prefix + the chunk). `window` keeps only keys within the
    last `window` positions of each query; `bias` [T, L] is added to the scores (masked entries are added here).
    """
    t, hq, _ = q.shape
    hk, n_keys = k.shape[1], k.shape[0]
    if t > _Q_BLOCK and k_pos is None and (bias is not None or window is not None or int(q_pos[0]) > 0):
        # A masked long chunk: query blocks see only keys up to their last position, skipping the masked upper
        # triangle the fused kernel would otherwise compute (the unmasked one-shot case uses is_causal instead).
        outs = []
        for a in range(0, t, _Q_BLOCK):
            b = min(t, a + _Q_BLOCK)
            n = int(q_pos[b - 1]) + 1
            outs.append(attend(q[a:b], k[:n], v[:n], q_pos[a:b], None, window=window,
                               bias=None if bias is None else bias[a:b, :n], scale=scale))
        return torch.cat(outs)
    qb, kb, vb = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    mask: torch.Tensor | None = None
    is_causal = False
    plain = bias is None and window is None and k_pos is None
    if plain and t == 1:
        pass  # a decode query at the last position sees every key
    elif plain and t == n_keys and int(q_pos[0]) == 0:
        is_causal = True  # one-shot prefill: lets the kernel skip the upper triangle
    else:
        kp = torch.arange(n_keys) if k_pos is None else k_pos
        keep = kp[None, :] <= q_pos[:, None]
        if window is not None:
            keep &= kp[None, :] > q_pos[:, None] - window
        mask = keep if bias is None else bias.masked_fill(~keep, float("-inf"))
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=is_causal, scale=scale,
                                         enable_gqa=hq != hk)
    return out[0].transpose(0, 1)


class Mlp:
    """Pre-norm SwiGLU feed-forward; returns the residual update."""

    def __init__(self, rng: Rng, hidden: int, inner: int, out_gain: float) -> None:
        self.ln = rng.norm(hidden)
        self.w_in = rng.linear(hidden, 2 * inner)
        self.w_out = rng.linear(inner, hidden, out_gain)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        g, u = (rms_norm(x, self.ln) @ self.w_in).chunk(2, dim=-1)
        return (F.silu(g) * u) @ self.w_out


class GqaProj:
    """Pre-norm q/k/v projection with RoPE, for grouped-query attention."""

    def __init__(self, rng: Rng, hidden: int, heads: int, kv_heads: int, head_dim: int, out_gain: float) -> None:
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.ln = rng.norm(hidden)
        self.w_qkv = rng.linear(hidden, (heads + 2 * kv_heads) * head_dim)
        self.w_o = rng.linear(heads * head_dim, hidden, out_gain)

    @property
    def row_floats(self) -> int:
        """One token's K and V, as stored: [K heads | V heads]."""
        return 2 * self.kv_heads * self.head_dim

    def qkv(self, x: torch.Tensor, ctx: StepCtx) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, d = x.shape[0], self.head_dim
        q, k, v = (rms_norm(x, self.ln) @ self.w_qkv).split(
            [self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        cs = ctx.rope(d)
        return (apply_rope(q.reshape(n, self.heads, d), cs), apply_rope(k.reshape(n, self.kv_heads, d), cs),
                v.reshape(n, self.kv_heads, d))

    def split_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kvd = self.kv_heads * self.head_dim
        return (rows[:, :kvd].reshape(-1, self.kv_heads, self.head_dim),
                rows[:, kvd:].reshape(-1, self.kv_heads, self.head_dim))


def paged_write_read(arena: torch.Tensor, page_tokens: int, item: PreparedItem, rows: torch.Tensor) -> torch.Tensor:
    """Write the item's new rows [T, R] into its blocks, then read back rows for positions [0, start+T).

    `arena` is the float view [num_blocks, page_tokens * R]. Reading back what was just written (instead of using
    the fresh tensors) keeps one code path for computed and restored positions.
    """
    r = rows.shape[1]
    arena.view(-1, r).index_copy_(0, item.write_rows, rows)
    return arena.index_select(0, item.read_blocks).view(-1, r)[: item.total]


class PagedGqaLayer:
    """Full causal GQA attention whose K/V live in one paged arena (one row per token)."""

    def __init__(self, proj: GqaProj, arena: torch.Tensor, page_tokens: int) -> None:
        self.proj, self.arena, self.page_tokens = proj, arena, page_tokens

    def __call__(self, x: torch.Tensor, ctx: StepCtx) -> torch.Tensor:
        q, k, v = self.proj.qkv(x, ctx)
        rows = torch.cat([k.flatten(1), v.flatten(1)], dim=1)
        out = torch.empty(x.shape[0], self.proj.heads, self.proj.head_dim)
        plan = ctx.decode_plan(self.page_tokens)
        done: set[int] = set()
        if plan is not None:
            kv = plan.write_read(self.arena, rows[plan.rows])
            kk, vv = self.proj.split_rows(kv.flatten(0, 1))
            shape = (len(plan.items), -1, self.proj.kv_heads, self.proj.head_dim)
            out[plan.rows] = plan.attend(q[plan.rows], kk.reshape(shape), vv.reshape(shape))
            done = set(plan.items)
        for i, (it, (a, b)) in enumerate(zip(ctx.items, ctx.bounds)):
            if i in done:
                continue
            kk, vv = self.proj.split_rows(paged_write_read(self.arena, self.page_tokens, it, rows[a:b]))
            out[a:b] = attend(q[a:b], kk, vv, it.positions, None)
        return out.flatten(1) @ self.proj.w_o


class Block:
    """Residual block: x + mixer(x), then x + mlp(x)."""

    def __init__(self, mixer: object, mlp: Mlp) -> None:
        self.mixer, self.mlp = mixer, mlp

    def __call__(self, x: torch.Tensor, ctx: StepCtx) -> torch.Tensor:
        x = x + self.mixer(x, ctx)  # type: ignore[operator]
        return x + self.mlp(x)


class LmHead:
    """Embedding, final norm and an untied output projection scaled so greedy argmax has clear margins."""

    def __init__(self, rng: Rng, vocab: int, hidden: int, logit_scale: float = 4.0) -> None:
        self.embed = rng.normal(vocab, hidden, std=1.0)
        self.ln = rng.norm(hidden)
        self.w = rng.linear(hidden, vocab, logit_scale)

    def embed_tokens(self, ctx: StepCtx) -> torch.Tensor:
        return self.embed[torch.cat([it.tokens for it in ctx.items])]

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.ln)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.w
