"""n-gram drafting (prompt lookup): propose what followed the most recent earlier occurrence of the text's
last n tokens, in the prompt or in what was generated. Model-free: a draft costs a tensor search, no
weights are read. q is a point mass on the proposal, so the accept-reject rule stays exact in sampling
too (a proposal the target rules out is simply rejected)."""

from __future__ import annotations

import torch

from ..engine.drafter import Draft, Drafter, Processing
from ..engine.state import DecodeState


class NGramDrafter(Drafter):
    """Prompt lookup, with transformers' parameter names.

    Args:
        prompt_lookup_num_tokens: the most tokens proposed per iteration (gamma's ceiling, and its default).
        max_matching_ngram_size: the longest suffix looked up; shorter ones are tried when it has no match,
            down to `min_matching_ngram_size`.
        min_matching_ngram_size: the shortest suffix that counts as a match (1 proposes after any earlier
            occurrence of the last token).

    Row by row in a batch: a row with a match proposes its continuation; a row without one proposes filler
    (its pending token repeated, also a point mass: exact, only a wasted position). With no match in any row
    the drafter is not `available` and the iteration goes to another drafter, or is a plain step. Past the end
    of the text the continuation repeats with the match's period (after "a b c a b" matching "a b", it
    proposes "c a b c ..."), which is what a model caught in a loop does next.
    """

    check_drafts = False

    def __init__(
        self, prompt_lookup_num_tokens: int = 10, max_matching_ngram_size: int = 2, min_matching_ngram_size: int = 1
    ):
        super().__init__()
        for name, value in (
            ("prompt_lookup_num_tokens", prompt_lookup_num_tokens),
            ("max_matching_ngram_size", max_matching_ngram_size),
            ("min_matching_ngram_size", min_matching_ngram_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer.")
        if min_matching_ngram_size > max_matching_ngram_size:
            raise ValueError(
                f"min_matching_ngram_size={min_matching_ngram_size} exceeds max_matching_ngram_size="
                f"{max_matching_ngram_size}."
            )
        self.max_drafts = self.default_drafts = prompt_lookup_num_tokens
        self.max_ngram, self.min_ngram = max_matching_ngram_size, min_matching_ngram_size
        self._match: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # from `available`

    @property
    def name(self) -> str:
        return "ngram"

    def estimated_cost(self) -> float:
        return 0.0  # no weights read; the search is a few small tensor operations

    def available(self, state: DecodeState) -> bool:
        self._match = find_continuations(state.sequences, state.pad_offset, self.max_ngram, self.min_ngram)
        return bool(self._match[0].any())  # the iteration's one host sync for this drafter

    def draft(self, state: DecodeState, gamma: int, process: Processing, do_sample: bool) -> Draft:
        if self._match is None:  # called without `available` (it is the loop's first question)
            self.available(state)
        found, start, period = self._match
        self._match = None
        sequences = state.sequences
        steps = torch.arange(gamma, device=sequences.device)[None, :]  # [1, G]
        index = start[:, None] + steps % period[:, None]  # [batch, G]: periodic past the end of the text
        tokens = sequences.gather(1, index.clamp(max=sequences.shape[1] - 1))
        tokens = torch.where(found[:, None], tokens, sequences[:, -1:])  # rows without a match: filler
        return Draft.point_mass(tokens)


def find_continuations(
    sequences: torch.Tensor, pad_offset: torch.Tensor, max_ngram: int, min_ngram: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each row of `sequences` [batch, T] (left padding `pad_offset` [batch] never matches): whether its
    last n tokens (n from max_ngram down to min_ngram, the longest that matches) occur earlier, where the
    continuation of the most recent such occurrence starts, and the distance from there to the end of the
    text (the period of the repetition). Returns (found [batch] bool, start [batch] long, period [batch] long)."""
    batch, length = sequences.shape
    device = sequences.device
    found = torch.zeros(batch, dtype=torch.bool, device=device)
    start = torch.zeros(batch, dtype=torch.long, device=device)
    for n in range(max_ngram, min_ngram - 1, -1):
        if length <= n:
            continue
        windows = sequences.unfold(1, n, 1)[:, :-1]  # [batch, T-n, n]: every n-gram but the suffix itself
        hits = (windows == sequences[:, None, -n:]).all(dim=-1)  # [batch, T-n]
        begins = torch.arange(length - n, device=device)[None, :]
        hits &= begins >= pad_offset[:, None]
        last = torch.where(hits, begins, -1).amax(dim=1)  # [batch]: the most recent match, -1 for none
        new = (last >= 0) & ~found
        start = torch.where(new, last + n, start)
        found |= new
    period = (length - start).clamp_min(1)
    return found, start, period
