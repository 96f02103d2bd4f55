"""`StackModel`: the shape all four tiny models share -- embed, a stack of blocks, an LM head -- so each model file
only builds its layers (and its KV groups) and says nothing about the forward pass it has in common."""

from __future__ import annotations

import dataclasses

import torch

from kvproc.contract import KvSpec
from kvproc.engine.models.base import PreparedItem, TinyModel
from kvproc.engine.models.layers import Block, LmHead, StepCtx


class StackModel(TinyModel):
    # Set by the subclass's __init__.
    _spec: KvSpec
    head: LmHead
    blocks: list[Block]

    def spec(self) -> KvSpec:
        if not self._spec.model_id:  # the weights exist once the constructor has run: their digest names them
            self._spec = dataclasses.replace(self._spec, model_id=self.model_id)
        return self._spec

    def _hidden(self, items: list[PreparedItem]) -> tuple[torch.Tensor, StepCtx]:
        """Final-layer activations of every new token of the step, and the step's context."""
        ctx = StepCtx.build(items)
        x = self.head.embed_tokens(ctx)
        for block in self.blocks:
            x = block(x, ctx)
        return x, ctx

    def _forward(self, items: list[PreparedItem]) -> torch.Tensor:
        x, ctx = self._hidden(items)
        return self.head.logits(self.head.final_hidden(x[ctx.last_rows()]))
