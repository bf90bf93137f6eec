"""The early-exit drafter: the target's first k layers and an exit head (the model's own final norm and LM head,
optionally after a trained block of `selfspec.heads.ExitHeads`). Its verify pass reuses what its draft computed."""

from __future__ import annotations

import torch
from torch import nn

from ..adapter import CallVocabulary, DraftVocabulary, ModelAdapter, draft_head_size
from ..engine.drafter import Draft, Drafter, Processing, draft_chain
from ..engine.state import DecodeState
from ..heads import ExitHeads
from ..heads.lora import DraftLoRA


class EarlyExitDrafter(Drafter):
    """q from layers 0..k-1 and an exit head (the model's own final norm and LM head, optionally after a
    trained block). The draft writes the lower-layer KV entries of its positions into the one shared
    cache; the verify pass runs the lower layers only for the last draft token and the upper layers for
    all G+1 positions."""

    check_drafts = False

    def __init__(
        self,
        adapter: ModelAdapter,
        exit_layer: int,
        head: nn.Module | None = None,
        vocab: DraftVocabulary | None = None,
        lora: DraftLoRA | None = None,
        confidence: float | None = None,
    ):
        super().__init__(confidence)
        num_layers = adapter.num_layers
        if num_layers < 2:
            raise ValueError(f"Early exit needs at least 2 decoder layers; this model has {num_layers}.")
        if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or not 1 <= exit_layer < num_layers:
            raise ValueError(
                f"exit_layer={exit_layer!r} is out of range: this model has {num_layers} decoder layers, so "
                f"exit_layer must be an integer from 1 to {num_layers - 1}."
            )
        self.adapter = adapter
        self.exit_layer = exit_layer
        self.head = head
        self.vocab = vocab
        self._vocab = CallVocabulary(vocab, adapter.lm_head)  # joined by each call's tokens (vocab.context)
        self.lora = lora  # a draft-only LoRA on the shared LM head (`selfspec.heads.lora`)
        self._hidden: list[torch.Tensor] = []

    @classmethod
    def from_heads(cls, heads: ExitHeads, adapter: ModelAdapter, exit_layer, tree, vocab, confidence):
        """The drafter of trained exit heads: at `exit_layer` (default: the heads' own), through its head."""
        if tree:
            raise ValueError("A candidate tree needs Medusa or EAGLE heads: early exit drafts a chain.")
        layer = heads.default_exit_layer if exit_layer is None else exit_layer
        drafter = cls(adapter, layer, None, vocab, heads.draft_lora, confidence)  # checks the range
        drafter.head = heads.head_for(layer)
        return drafter

    @property
    def name(self) -> str:
        return f"exit {self.exit_layer}"

    def estimated_cost(self) -> float:
        """c from the weights a draft token reads (the memory-bound regime): layers 0..k-1, the exit head
        and the LM head, over all layers and the LM head."""
        layers = [sum(p.numel() for p in layer.parameters()) for layer in self.adapter.layers]
        head = sum(p.numel() for p in self.adapter.lm_head.parameters())
        extra = sum(p.numel() for p in self.head.parameters()) if self.head is not None else 0
        return (
            sum(layers[: self.exit_layer]) + extra + draft_head_size(self.adapter.lm_head, self.vocab, self.lora)
        ) / (sum(layers) + head)

    def exit_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            hidden = self.head(hidden)
        return self.adapter.head_logits(hidden, self._vocab.current, self.lora)

    def _lower(self, state: DecodeState, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Layers 0..k-1 over `tokens` [batch, n] at sequence indices start..start+n-1."""
        count = tokens.shape[1]
        return self.adapter.run_lower(
            tokens, state.position_ids(start, count), state.cache, self.exit_layer, state.attention_mask(start + count)
        )

    def begin(self, state: DecodeState, hidden: dict) -> None:
        self._vocab.begin(state.sequences, state.mask)

    def draft(self, state: DecodeState, gamma: int, process: Processing, do_sample: bool) -> Draft:
        start = state.length - 1  # index of the pending token
        self._hidden = []
        self._vocab.follow(state.sequences)

        def next_logits(i: int, token: torch.Tensor) -> torch.Tensor:
            hidden = self._lower(state, token, start + i)  # [batch, 1, H]
            self._hidden.append(hidden)
            return self.exit_logits(hidden[:, -1])

        return draft_chain(state, gamma, process, do_sample, next_logits, self.confidence)

    def verify(self, target, state: DecodeState, draft: Draft, hidden_layers=()):
        """Target logits [batch, G+1, V] for the pending token and the G drafts, the lower layers reused."""
        start, gamma = state.length - 1, draft.tokens.shape[1]
        if gamma == 0:
            return super().verify(target, state, draft, hidden_layers)
        last = self._lower(state, draft.tokens[:, -1:], start + gamma)
        hidden = torch.cat([*self._hidden, last], dim=1)  # [batch, G+1, H]
        tokens = torch.cat([state.sequences[:, -1:], draft.tokens], dim=1)
        self._hidden = []
        return self.adapter.run_upper(
            hidden,
            tokens,
            state.position_ids(start, gamma + 1),
            state.cache,
            self.exit_layer,
            state.attention_mask(start + gamma + 1),
            layers=hidden_layers,
        )
