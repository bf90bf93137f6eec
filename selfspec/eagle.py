"""The EAGLE drafter: an `EagleHeads` head drafting chains from the target's features (selfspec/heads/eagle.py).

The head keeps a KV cache of its own, one entry per sequence index i: (f_i, token i+1) -> o_i. Only entries
made of the target's true features stay in it. A draft of G tokens runs G head steps: step 0 takes the
backlog, every (feature, next token) pair committed since the last draft, ending with the feature that gave
the pending token and the pending token itself; steps 1..G-1 feed the head's own output back with the token
just drafted. After the verify pass the G-1 fed-back entries are dropped, and the features of the committed
positions join the backlog. So each row's head sees what it saw in training.

Batches: rows commit different counts, so the backlog is kept right-aligned with a count per row, and the
cache's slots carry a validity flag per row; unused slots are masked, never removed. No host synchronisation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from .adapter import ModelAdapter
from .drafter import Draft, Drafter, Processing, Verified, draft_chain
from .drafters import draft_head_size
from .state import DecodeState

if TYPE_CHECKING:
    from .heads.eagle import EagleHeads


def append_right_aligned(old, old_counts, new, new_counts):
    """Per row b, the last old_counts[b] entries of `old` [batch, W, F] followed by the first new_counts[b] of
    `new` [batch, P, F], right-aligned in [batch, W + P, F] (the slots before them hold filler); and the counts."""
    width, extra = old.shape[1], new.shape[1]
    slot = torch.arange(width + extra, device=new.device)[None, :]
    counts = old_counts + new_counts
    k = slot - (width + extra - counts)[:, None]  # the entry's place in row b's sequence (< 0: filler)
    source = torch.where(k < old_counts[:, None], width - old_counts[:, None] + k, width + k - old_counts[:, None])
    index = source.clamp(0, width + extra - 1)[..., None].expand(-1, -1, new.shape[-1])
    return torch.cat([old, new], dim=1).gather(1, index), counts


class EagleDrafter(Drafter):
    """Drafts with an EAGLE head: reads the target's features at `heads.features`, one head step per token."""

    check_drafts = False

    def __init__(self, adapter: ModelAdapter, heads: EagleHeads, vocab=None, confidence: float | None = None):
        super().__init__(confidence)
        self.adapter, self.heads, self.vocab = adapter, heads, vocab
        self.hidden_layers = heads.features
        self._cache = DynamicCache()
        self._valid = self._backlog = self._counts = self._outputs = None
        self._fed_back = 0  # entries of the current draft that hold fed-back outputs (dropped after verifying)

    @property
    def name(self) -> str:
        return "eagle"

    def estimated_cost(self) -> float:
        """c from the weights a draft token reads: the head's layers and the (draft) LM head, over the target's
        layers and LM head."""
        head = sum(p.numel() for p in self.heads.parameters())
        head -= sum(p.numel() for p in self.heads.draft_lora.parameters()) if self.heads.draft_lora else 0
        target = sum(p.numel() for p in self.adapter.layers.parameters())
        target += sum(p.numel() for p in self.adapter.lm_head.parameters())
        return (head + draft_head_size(self.adapter, self.vocab, self.heads.draft_lora)) / target

    def _features(self, hidden: dict) -> torch.Tensor:
        return torch.cat([hidden[layer] for layer in self.hidden_layers], dim=-1)

    def begin(self, state: DecodeState, hidden: dict) -> None:
        """The prompt's features wait in the backlog (each row's padding excluded); the head's cache is empty."""
        features = self._features(hidden)  # [batch, T, F]
        self._cache = DynamicCache()
        self._valid = torch.zeros(state.batch_size, 0, dtype=torch.bool, device=features.device)
        self._backlog, self._counts = features, features.shape[1] - state.pad_offset
        self._fed_back = 0

    def _mask(self, new_valid: torch.Tensor) -> torch.Tensor:
        """Float mask [batch, 1, n, S + n] for n new entries: the valid cached slots and, causally, the valid new
        ones (an invalid entry sees itself, so that nothing is computed from an empty row)."""
        n = new_valid.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=new_valid.device).tril()
        new = (causal[None] & new_valid[:, None, :]) | torch.eye(n, dtype=torch.bool, device=new_valid.device)[None]
        visible = torch.cat([self._valid[:, None, :].expand(-1, n, -1), new], dim=2)
        dtype = next(self.heads.parameters()).dtype
        return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
            ~visible, torch.finfo(dtype).min
        )[:, None]

    def _run(self, state: DecodeState, hidden, tokens, start: int, new_valid) -> torch.Tensor:
        """Head step over entries whose tokens `tokens` [batch, n] sit at sequence indices start..start+n-1 (each
        entry one index before its token); returns the last entry's output [batch, 1, H]."""
        count = tokens.shape[1]
        token_positions = state.position_ids(start, count)
        positions = (token_positions - 1).clamp_min(0)
        outputs = self.heads.step(
            hidden, self.adapter.embed(tokens, token_positions), positions, self._mask(new_valid), self._cache
        )
        self._valid = torch.cat([self._valid, new_valid], dim=1)
        return outputs[:, -1:]

    def draft(self, state: DecodeState, gamma: int, process: Processing, do_sample: bool) -> Draft:
        length = state.length

        def next_logits(i: int, token: torch.Tensor) -> torch.Tensor:
            if i == 0:  # the backlog, ending with the pending token's entry: true features only
                width = min(self._backlog.shape[1], length - 1)  # older slots can only be filler
                backlog = self._backlog[:, -width:]
                valid = torch.arange(width, device=backlog.device)[None, :] >= (width - self._counts)[:, None]
                hidden = self.heads.fused(backlog)
                self._outputs = self._run(state, hidden, state.sequences[:, -width:], length - width, valid)
                self._backlog, self._counts = backlog[:, :0], torch.zeros_like(self._counts)
            else:  # the head's own output fed back, with the token drafted last
                valid = torch.ones(state.batch_size, 1, dtype=torch.bool, device=token.device)
                self._outputs = self._run(state, self._outputs, token, length - 1 + i, valid)
                self._fed_back += 1
            return self.heads.logits(self._outputs[:, 0], self.adapter, self.vocab)

        return draft_chain(state, gamma, process, do_sample, next_logits, self.confidence)

    def accept(self, verified: Verified) -> None:
        """Drop the fed-back entries; the features of the committed positions join the backlog."""
        if self._fed_back:
            ModelAdapter.crop(self._cache, self._fed_back)
            self._valid = self._valid[:, : -self._fed_back]
            self._fed_back = 0
        features = self._features(verified.hidden)  # [batch, P, F] over the pass's positions
        path = verified.path[..., None].expand(-1, -1, features.shape[-1])
        committed = features.gather(1, path)  # in the order they were committed
        self._backlog, self._counts = append_right_aligned(
            self._backlog, self._counts, committed, verified.num_accepted + 1
        )

    def select_rows(self, rows: torch.Tensor) -> None:
        self._cache.batch_select_indices(rows)
        self._valid, self._backlog, self._counts = self._valid[rows], self._backlog[rows], self._counts[rows]
