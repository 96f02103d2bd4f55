"""Checkpoint policy of the reference engine: WHEN bounded state is sealed (kvproc decides how and where).

Policy (reference design section 1): a checkpoint every `every_pages` pages and one at turn end. Bounded state can be
copied only at a page-aligned step boundary, so the policy also decides where prefill chunks end. "Turn end" is the
last page boundary the turn computes: the final sampled token is never computed, so a request of `prompt + max_out`
tokens computes `prompt + max_out - 1` of them. That boundary is what the conversation's next turn hits.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointPolicy:
    page_tokens: int
    every_pages: int

    def __post_init__(self) -> None:
        if self.every_pages <= 0:
            raise ValueError(f"checkpoint_every_pages must be positive, got {self.every_pages}")

    def turn_end_pages(self, prompt_tokens: int, max_output_tokens: int) -> int:
        return (prompt_tokens + max_output_tokens - 1) // self.page_tokens

    def due(self, pages: int, turn_end_pages: int) -> bool:
        return pages > 0 and (pages % self.every_pages == 0 or pages == turn_end_pages)

    def crossed(self, before_tokens: int, after_tokens: int, turn_end_pages: int) -> bool:
        """Whether a due boundary lies in (before, after] (paged-only models seal there; no cut needed)."""
        return self.last_due_in(before_tokens, after_tokens, turn_end_pages) is not None

    def last_due_in(self, lo_tokens: int, hi_tokens: int, turn_end_pages: int) -> int | None:
        """The deepest due boundary b (tokens) with lo < b <= hi, or None."""
        P = self.page_tokens
        best: int | None = None
        k = (hi_tokens // P) // self.every_pages * self.every_pages
        if k > 0 and k * P > lo_tokens:
            best = k * P
        t = turn_end_pages * P
        if lo_tokens < t <= hi_tokens and (best is None or t > best):
            best = t
        return best

    def prefill_chunk(self, computed: int, prompt_tokens: int, budget: int, turn_end_pages: int,
                      bounded: bool) -> int:
        """Tokens of the next prefill chunk. With bounded state, a chunk that does not finish the prompt is cut back
        to the deepest due boundary it spans, so the state can be sealed there. The chunk that finishes the prompt
        (and emits the first token) is cut only at the turn-end boundary, when the output is too short to reach
        it: that is the checkpoint the conversation's next turn hits; an extra step there is worth it."""
        end = min(prompt_tokens, computed + budget)
        if not bounded:
            return end - computed
        if end < prompt_tokens:
            b = self.last_due_in(computed, end, turn_end_pages)
            if b is not None:
                end = b
        elif computed < turn_end_pages * self.page_tokens < end:
            end = turn_end_pages * self.page_tokens
        return end - computed
