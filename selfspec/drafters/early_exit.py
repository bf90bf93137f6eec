"""The built-in model drafters: early exit (the first k layers and an exit head) and Medusa heads (on the
target's last hidden state). Both implement `selfspec.drafter.Drafter`; the early-exit drafter also
overrides `verify`, because its verify pass reuses what its draft computed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..adapter import FINAL, DraftVocabulary, ModelAdapter, draft_head_size
from ..engine.drafter import Draft, Drafter, Processing, Verified, draft_chain
from ..engine.state import DecodeState
from ..engine.tree import CandidateTree
from ..lora import DraftLoRA
from .ngram import NGramDrafter

if TYPE_CHECKING:
    from ..heads import DraftHeads, MedusaHeads

NAMED_DRAFTERS = ("ngram", "hybrid")  # SelfSpeculative(drafter=...) by name


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
        self.lora = lora  # a draft-only LoRA on the shared LM head (`selfspec.lora`)
        self._hidden: list[torch.Tensor] = []

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
        return self.adapter.head_logits(hidden, self.vocab, self.lora)

    def _lower(self, state: DecodeState, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Layers 0..k-1 over `tokens` [batch, n] at sequence indices start..start+n-1."""
        count = tokens.shape[1]
        return self.adapter.run_lower(
            tokens, state.position_ids(start, count), state.cache, self.exit_layer, state.attention_mask(start + count)
        )

    def draft(self, state: DecodeState, gamma: int, process: Processing, do_sample: bool) -> Draft:
        start = state.length - 1  # index of the pending token
        self._hidden = []

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


class MedusaDrafter(Drafter):
    """Medusa heads read the target's last hidden state (the one that gave the pending token) and propose
    the next tokens at once; the verify pass is one ordinary pass of the full model over the pending token
    and the drafts, which also yields the hidden state the next proposals are read from."""

    hidden_layers = (FINAL,)
    check_drafts = False

    def __init__(
        self,
        adapter: ModelAdapter,
        heads: MedusaHeads,
        tree: CandidateTree | None = None,
        vocab: DraftVocabulary | None = None,
        confidence: float | None = None,
    ):
        super().__init__(confidence)
        if vocab is not None and heads.own_lm_head:
            raise ValueError(
                "draft_vocab and draft_quant apply to the shared LM head; these Medusa heads have their own LM heads."
            )
        self.adapter = adapter
        self.heads = heads
        self.vocab = vocab
        self.max_drafts = self.default_drafts = heads.num_heads
        self.tree = tree.to(adapter.device) if tree is not None else None
        self._hidden: torch.Tensor | None = None  # [batch, H]

    @property
    def name(self) -> str:
        return "medusa tree" if self.tree is not None else "medusa"

    def estimated_cost(self) -> float:
        """c from the weights: one head's blocks (and its own LM head) per draft token; the shared LM head
        is counted too, since each head's proposal goes through it."""
        layers = sum(p.numel() for p in self.adapter.layers.parameters())
        head = sum(p.numel() for p in self.adapter.lm_head.parameters())
        heads = self.heads
        per_head = sum(p.numel() for p in heads.blocks.parameters()) / heads.num_heads
        if heads.own_lm_head:
            per_head += sum(p.numel() for p in heads.lm_heads.parameters()) / heads.num_heads
        else:
            per_head += draft_head_size(self.adapter.lm_head, self.vocab, heads.draft_lora)
        return per_head / (layers + head)

    def begin(self, state: DecodeState, hidden: dict) -> None:
        self._hidden = hidden[FINAL][:, -1]  # [batch, H]: gave the first pending token

    def draft(self, state: DecodeState, gamma: int, process: Processing, do_sample: bool) -> Draft:
        proposals = self.heads.logits(self._hidden, self.adapter, gamma, self.vocab)  # [batch, G, V]
        return draft_chain(state, gamma, process, do_sample, lambda i, token: proposals[:, i], self.confidence)

    def draft_tree(self, state: DecodeState):
        """The tree, its candidate tokens [batch, N] (node (d, r): head d's r-th best), and the logits [batch,
        N+1, V] their children come from (a node at depth d: head d's; the deepest nodes: none)."""
        tree = self.tree
        proposals = self.heads.logits(self._hidden, self.adapter, tree.max_depth, self.vocab)  # [batch, D, V]
        padded = torch.cat([proposals, torch.zeros_like(proposals[:, :1])], dim=1)
        return tree, tree.node_tokens(proposals), padded[:, tree.depth]

    def accept(self, verified: Verified) -> None:
        """Keep the hidden state [batch, H] at the position (chain) or node (tree) that gave the new pending token."""
        hidden = verified.hidden[FINAL]
        gather = verified.last[:, None, None].expand(-1, 1, hidden.shape[-1])
        self._hidden = hidden.gather(1, gather).squeeze(1)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the hidden states of the rows still generating."""
        self._hidden = self._hidden[rows]


def build_drafters(
    adapter: ModelAdapter,
    drafter,
    heads: DraftHeads | None,
    exit_layer: int | None,
    tree: list | None,
    vocab: DraftVocabulary | None,
    confidence: float | None,
    ngram_options: dict,
) -> list[Drafter]:
    """The drafters of a `SelfSpeculative` (see its `drafter` argument), in order of preference. Raises
    ValueError for settings that do not apply to the chosen drafters."""
    model_options = {"heads": heads, "exit_layer": exit_layer, "tree": tree, "draft_vocab / draft_quant": vocab}
    given = [name for name, value in model_options.items() if value is not None]
    if ngram_options and drafter not in NAMED_DRAFTERS:
        raise ValueError(
            f"{', '.join(sorted(ngram_options))} configure n-gram drafting: pass drafter='ngram' or 'hybrid'."
        )
    if isinstance(drafter, Drafter) or (isinstance(drafter, list | tuple) and drafter):
        drafters = [drafter] if isinstance(drafter, Drafter) else list(drafter)
        wrong = [part for part in drafters if not isinstance(part, Drafter)]
        if wrong:
            raise TypeError(f"drafter must be a selfspec Drafter or a list of them; got {type(wrong[0]).__name__}.")
        if given or confidence is not None:
            raise ValueError(
                f"{', '.join(given) or 'draft_confidence'} configure selfspec's own drafter; with drafter=... "
                "configure your drafter itself."
            )
    elif drafter == "ngram":
        if given or confidence is not None:
            raise ValueError(f"drafter='ngram' drafts without the model: {', '.join(given) or 'draft_confidence'} "
                             "does not apply (drafter='hybrid' combines it with heads).")  # fmt: skip
        drafters = [NGramDrafter(**ngram_options)]
    elif drafter in (None, "hybrid"):
        own = model_drafter(adapter, heads, exit_layer, tree, vocab, confidence)
        drafters = [NGramDrafter(**ngram_options), own] if drafter == "hybrid" else [own]
    else:
        raise ValueError(f"drafter={drafter!r}: pass a Drafter, a list of them, {' or '.join(NAMED_DRAFTERS)}.")
    if len(drafters) > 1 and any(part.tree is not None for part in drafters):
        raise ValueError("A tree drafter drafts alone: combine chains only (tree=[] drafts a Medusa chain).")
    return drafters


def model_drafter(adapter, heads, exit_layer, tree, vocab, confidence) -> Drafter:
    """The drafter from the model's own weights: the heads' kind (`DraftHeads.drafter`), or the untrained
    exit (the model's final norm and LM head after a quarter of its layers by default)."""
    if heads is not None:
        return heads.drafter(adapter, exit_layer, tree, vocab, confidence)
    if tree:
        raise ValueError("A candidate tree needs Medusa or EAGLE heads: early exit drafts a chain.")
    layer = exit_layer if exit_layer is not None else max(1, adapter.num_layers // 4)
    return EarlyExitDrafter(adapter, layer, vocab=vocab, confidence=confidence)
