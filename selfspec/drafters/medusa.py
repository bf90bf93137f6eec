"""The Medusa drafter: `selfspec.heads.MedusaHeads` on the target's last hidden state propose the next tokens at once,
as a chain or as a candidate tree that one pass verifies."""

from __future__ import annotations

import torch

from ..adapter import FINAL, CallVocabulary, DraftVocabulary, ModelAdapter, draft_head_size
from ..engine.drafter import Draft, Drafter, Processing, Verified, draft_chain
from ..engine.state import DecodeState
from ..engine.tree import CandidateTree
from ..heads import MedusaHeads


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
        self._vocab = CallVocabulary(vocab, adapter.lm_head)  # joined by each call's tokens (vocab.context)
        self.max_drafts = self.default_drafts = heads.num_heads
        self.tree = tree.to(adapter.device) if tree is not None else None
        self._hidden: torch.Tensor | None = None  # [batch, H]

    @classmethod
    def from_heads(cls, heads: MedusaHeads, adapter: ModelAdapter, exit_layer, tree, vocab, confidence):
        """The drafter of Medusa heads: a chain, or the candidate `tree` (default: the heads' own; [] a chain)."""
        if exit_layer is not None:
            raise ValueError("exit_layer does not apply to Medusa heads: they draft from the last hidden state.")
        if isinstance(tree, dict):
            raise ValueError(
                f"tree={tree!r}: Medusa heads draft a fixed candidate tree, given as paths of sibling ranks such as "
                "[[0], [1], [0, 0]] (a dict of nodes, top_k and depth shapes an EAGLE head's dynamic tree)."
            )
        tree = tree if tree is not None else heads.tree  # the heads may carry a default tree; [] forces a chain
        candidates = CandidateTree.from_paths(tree, heads.num_heads) if tree else None
        if candidates is not None and max(candidates.top_k) > adapter.vocab_size:
            raise ValueError(
                f"tree: a path takes a head's candidate of rank {max(candidates.top_k) - 1}, but the model has "
                f"{adapter.vocab_size} tokens (ranks 0 to {adapter.vocab_size - 1})."
            )
        return cls(adapter, heads, candidates, vocab, confidence)

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
        self._vocab.begin(state.sequences, state.mask)

    def draft(self, state: DecodeState, gamma: int, process: Processing, do_sample: bool) -> Draft:
        vocab = self._vocab.follow(state.sequences)
        proposals = self.heads.logits(self._hidden, self.adapter, gamma, vocab)  # [batch, G, V]
        return draft_chain(state, gamma, process, do_sample, lambda i, token: proposals[:, i], self.confidence)

    def draft_tree(self, state: DecodeState):
        """The tree, its candidate tokens [batch, N] (node (d, r): head d's r-th best), and the logits [batch,
        N+1, V] their children come from (a node at depth d: head d's; the deepest nodes: none)."""
        tree = self.tree
        vocab = self._vocab.follow(state.sequences)
        proposals = self.heads.logits(self._hidden, self.adapter, tree.max_depth, vocab)  # [batch, D, V]
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
