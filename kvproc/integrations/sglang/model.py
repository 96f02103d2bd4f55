"""The kvproc `KvModel` the backend attaches to its store: one paged group, one arena of one page.

kvproc's tier learns a model's page layout from its arenas (`ClusterStore.attach_model`), and engines may share a
tier only if their layouts' fingerprints are equal. The backend's pages never pass through kvproc's own device pool
(they move between SGLang's host pool and the tier's slots, `HostDirect`), so the arena is one page long: it exists
only to describe a page (its name carries the page format, its size the page's bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvproc import ArenaId, GroupKind, GroupSpec, KvArena, KvSpec, RepackDirection
from kvproc.integrations.sglang.pages import PageFormat

GROUP = "kv"


class SglangPageModel:
    def __init__(self, fmt: PageFormat, model_id: str, zero_copy: bool,
                 allocator: Callable[[str, int], torch.Tensor]) -> None:
        self._spec = KvSpec(fmt.page_tokens, (GroupSpec(GROUP, GroupKind.PAGED),), model_id=model_id)
        self.arena_name = fmt.arena_name(zero_copy)
        n = fmt.page_bytes
        self._arenas = [(GROUP, KvArena(self.arena_name, allocator(self.arena_name, n), 1, n, n))]

    def spec(self) -> KvSpec:
        return self._spec

    def arenas(self, rank: int) -> Sequence[tuple[str, KvArena]]:
        return self._arenas

    def repack(self, group: str, direction: RepackDirection, src: torch.Tensor, dst: torch.Tensor,
               arena: ArenaId) -> None:
        dst.copy_(src)  # stored as SGLang lays pages out (no stored_layout declared): never called
