"""Drafters: where the proposals x_1..x_G and their distribution q come from, and the verify pass that
matches them. A drafter owns both halves because the early-exit verify pass reuses what its draft wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .adapter import DraftVocabulary, ModelAdapter
from .heads import DraftHeads, MedusaHeads
from .lora import DraftLoRA
from .state import DecodeState
from .tree import CandidateTree

MAX_DRAFT_TOKENS = 32  # more drafts per iteration cannot pay: alpha^32 is negligible for any real draft

# process(tokens [batch, G], logits [batch, P, V], offset) -> processed scores [batch, P, V] of the P
# positions after the committed tokens and tokens[:, :offset + i]
Processing = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass
class Draft:
    tokens: torch.Tensor  # [batch, G] long
    scores: torch.Tensor  # [batch, G, V] float32 processed draft scores (q = softmax(scores))


def pick(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """A token per row from processed scores [batch, V]: sampled from softmax, or the argmax."""
    if do_sample:
        return torch.multinomial(scores.softmax(dim=-1), 1).squeeze(1)
    return scores.argmax(dim=-1)


def draft_tokens(
    state: DecodeState,
    gamma: int,
    process: Processing,
    do_sample: bool,
    next_logits: Callable[[int, torch.Tensor], torch.Tensor],
    stop_below: float | None = None,
) -> Draft:
    """Draft up to gamma tokens one after the other. `next_logits(i, token)` gives the raw draft logits
    [batch, V] for draft position i, given the token [batch, 1] before it (the pending token for i = 0).
    Each position is processed with its own prefix, as the target's positions will be. With `stop_below`,
    drafting stops early once every row's drafted token has a draft probability below it (one host sync
    per position): a draft that is unsure of itself is likely rejected, and a shorter verify costs less.
    The stop depends on the drafts alone, so the accept-reject rule stays exact."""
    token, drafted, scores = state.sequences[:, -1:], [], []
    for i in range(gamma):
        logits = next_logits(i, token)[:, None]  # [batch, 1, V]
        drafts = torch.cat(drafted, dim=1) if drafted else state.sequences[:, :0]
        score = process(drafts, logits, i)[:, 0]  # [batch, V]
        token = pick(score, do_sample)[:, None]
        drafted.append(token)
        scores.append(score)
        if stop_below is not None and i + 1 < gamma:
            confidence = score.softmax(dim=-1).gather(1, token)  # [batch, 1]: q of the drafted token
            if bool((confidence < stop_below).all()):
                break
    return Draft(torch.cat(drafted, dim=1), torch.stack(scores, dim=1))


class EarlyExitDrafter:
    """q from layers 0..k-1 and an exit head (the model's own final norm and LM head, optionally after a
    trained block). The draft writes the lower-layer KV entries of its positions into the one shared
    cache; the verify pass runs the lower layers only for the last draft token and the upper layers for
    all G+1 positions."""

    needs_hidden = False  # drafts from the lower layers, not from the target's last hidden state

    def __init__(
        self,
        adapter: ModelAdapter,
        exit_layer: int,
        head: nn.Module | None = None,
        vocab: DraftVocabulary | None = None,
        lora: DraftLoRA | None = None,
    ):
        self.adapter = adapter
        self.exit_layer = exit_layer
        self.head = head
        self.vocab = vocab
        self.lora = lora  # a draft-only LoRA on the shared LM head (`selfspec.lora`)
        self.stop_below: float | None = None  # draft confidence under which a chain stops early
        self._hidden: list[torch.Tensor] = []

    def estimated_cost(self) -> float:
        """c from the weights a draft token reads (the memory-bound regime): layers 0..k-1, the exit head
        and the LM head, over all layers and the LM head."""
        layers = [sum(p.numel() for p in layer.parameters()) for layer in self.adapter.layers]
        head = sum(p.numel() for p in self.adapter.lm_head.parameters())
        extra = sum(p.numel() for p in self.head.parameters()) if self.head is not None else 0
        return (sum(layers[: self.exit_layer]) + extra + draft_head_size(self.adapter, self.vocab, self.lora)) / (
            sum(layers) + head
        )

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

        return draft_tokens(state, gamma, process, do_sample, next_logits, self.stop_below)

    def verify(self, state: DecodeState, draft: Draft) -> torch.Tensor:
        """Target logits [batch, G+1, V] for the pending token and the G drafts."""
        start, gamma = state.length - 1, draft.tokens.shape[1]
        last = self._lower(state, draft.tokens[:, -1:], start + gamma)
        hidden = torch.cat([*self._hidden, last], dim=1)  # [batch, G+1, H]
        tokens = torch.cat([state.sequences[:, -1:], draft.tokens], dim=1)
        logits = self.adapter.run_upper(
            hidden,
            tokens,
            state.position_ids(start, gamma + 1),
            state.cache,
            self.exit_layer,
            state.attention_mask(start + gamma + 1),
        )
        self._hidden = []
        return logits

    def accept(self, num_accepted: torch.Tensor) -> None:
        """Nothing to carry over: the next draft starts from the pending token."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Nothing held per row between iterations."""


class MedusaDrafter:
    """Medusa heads read the target's last hidden state (the one that gave the pending token) and propose
    the next tokens at once; the verify pass is one ordinary pass of the full model over the pending token
    and the drafts, which also yields the hidden state the next proposals are read from."""

    needs_hidden = True  # every target pass hands its last normed hidden state to `observe`

    def __init__(
        self,
        adapter: ModelAdapter,
        heads: MedusaHeads,
        tree: CandidateTree | None = None,
        vocab: DraftVocabulary | None = None,
    ):
        if vocab is not None and heads.own_lm_head:
            raise ValueError(
                "draft_vocab and draft_quant apply to the shared LM head; these Medusa heads have their own LM heads."
            )
        self.adapter = adapter
        self.heads = heads
        self.vocab = vocab
        self.stop_below: float | None = None  # draft confidence under which a chain stops early
        self.tree = tree.to(adapter.device) if tree is not None else None
        self._hidden: torch.Tensor | None = None  # [batch, H]
        self._verified: torch.Tensor | None = None  # [batch, G+1, H]

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
            per_head += draft_head_size(self.adapter, self.vocab, heads.draft_lora)
        return per_head / (layers + head)

    def observe(self, hidden: torch.Tensor) -> None:
        """The normed hidden state [batch, H] whose LM-head output gave the pending token."""
        self._hidden = hidden

    def draft(self, state: DecodeState, gamma: int, process: Processing, do_sample: bool) -> Draft:
        proposals = self.heads.logits(self._hidden, self.adapter, gamma, self.vocab)  # [batch, G, V]
        return draft_tokens(state, gamma, process, do_sample, lambda i, token: proposals[:, i], self.stop_below)

    def verify(self, state: DecodeState, draft: Draft) -> torch.Tensor:
        start, gamma = state.length - 1, draft.tokens.shape[1]
        tokens = torch.cat([state.sequences[:, -1:], draft.tokens], dim=1)
        logits, self._verified = self.adapter.forward_with_hidden(
            tokens, state.position_ids(start, gamma + 1), state.cache, state.attention_mask(start + gamma + 1)
        )
        return logits

    def draft_tree(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidate tokens [batch, N] of the tree's nodes, and the logits [batch, D, V] of the D heads it uses."""
        proposals = self.heads.logits(self._hidden, self.adapter, self.tree.max_depth, self.vocab)  # [batch, D, V]
        return self.tree.node_tokens(proposals), proposals

    def verify_tree(self, state: DecodeState, node_tokens: torch.Tensor) -> torch.Tensor:
        """Target logits [batch, N+1, V] of the root and every node, in one pass with a tree mask."""
        start = state.length - 1
        tokens = torch.cat([state.sequences[:, -1:], node_tokens], dim=1)
        positions = state.position_ids(start, 1) + self.tree.depth[None, :]  # [batch, N+1]
        mask = self.adapter.tree_attention_mask(state.cache, start, self.tree, state.attention_mask(start))
        logits, self._verified = self.adapter.forward_with_hidden(tokens, positions, state.cache, mask)
        return logits

    def accept(self, index: torch.Tensor) -> None:
        """Keep the hidden state [batch] at the verified position (chain) or node (tree) whose distribution
        gave the new pending token."""
        gather = index[:, None, None].expand(-1, 1, self._verified.shape[-1])
        self.observe(self._verified.gather(1, gather).squeeze(1))
        self._verified = None

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the hidden states of the rows still generating."""
        self._hidden = self._hidden[rows]


def frequent_tokens(token_ids, count: int, always=()) -> torch.Tensor:
    """The `count` most frequent token ids in `token_ids` (a tensor, or an iterable of tensors, e.g. your
    tokenised data), plus `always` (e.g. the EOS id): a draft vocabulary for `SelfSpeculative(draft_vocab=)`.
    Ties go to the smaller id; the result is sorted."""
    parts = [token_ids] if isinstance(token_ids, torch.Tensor) else list(token_ids)
    flat = torch.cat([torch.as_tensor(part).flatten() for part in parts]).long()
    order = torch.sort(torch.bincount(flat), descending=True, stable=True).indices[:count]  # ties: smaller id
    return torch.cat([order, torch.as_tensor(list(always), dtype=torch.long)]).unique()


def draft_head_size(adapter: ModelAdapter, vocab: DraftVocabulary | None, lora: DraftLoRA | None = None) -> int:
    """Parameters of the LM head a draft token reads: all of it, or the draft vocabulary's rows, and the
    draft LoRA's factors (B's rows for the draft vocabulary only)."""
    if vocab is None:
        size = sum(p.numel() for p in adapter.lm_head.parameters())
    else:
        # in the model's dtype's units: an int8 copy reads a quarter of float32's bytes
        weight = vocab.weight.numel() * vocab.weight.element_size() / adapter.dtype.itemsize
        size = weight + (vocab.bias.numel() if vocab.bias is not None else 0)
    if lora is not None:
        rows = adapter.vocab_size if vocab is None else vocab.ids.numel()
        size += lora.r * (lora.lora_A.in_features + rows)
    return size


def build_drafter(
    adapter: ModelAdapter,
    heads: DraftHeads | None,
    exit_layer: int | None,
    tree: list | None,
    vocab: DraftVocabulary | None = None,
):
    """The drafter for these heads (None: the untrained exit), the exit layer it uses (None for Medusa)
    and the most drafts it can propose per iteration. Raises ValueError on settings that do not fit."""
    if isinstance(heads, MedusaHeads):
        if exit_layer is not None:
            raise ValueError("exit_layer does not apply to Medusa heads: they draft from the last hidden state.")
        tree = tree if tree is not None else heads.tree  # the heads may carry a default tree
        candidates = CandidateTree.from_paths(tree, heads.num_heads) if tree else None  # [] forces a chain
        return MedusaDrafter(adapter, heads, candidates, vocab), None, heads.num_heads
    if tree:
        raise ValueError("A candidate tree needs Medusa heads: early exit drafts a chain.")
    num_layers = adapter.num_layers
    if num_layers < 2:
        raise ValueError(f"Early exit needs at least 2 decoder layers; this model has {num_layers}.")
    if exit_layer is None:
        exit_layer = heads.default_exit_layer if heads is not None else max(1, num_layers // 4)
    if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or not 1 <= exit_layer < num_layers:
        raise ValueError(
            f"exit_layer={exit_layer!r} is out of range: this model has {num_layers} decoder layers, so "
            f"exit_layer must be an integer from 1 to {num_layers - 1}."
        )
    head = heads.head_for(exit_layer) if heads is not None else None
    lora = heads.draft_lora if heads is not None else None
    return EarlyExitDrafter(adapter, exit_layer, head, vocab, lora), exit_layer, MAX_DRAFT_TOKENS
