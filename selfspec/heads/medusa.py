"""Medusa heads: n heads on the target's last (normed) hidden state; head i proposes the token i+1 positions
after the next one. Each head is one or more residual blocks x + SiLU(W x), every block with its own
parameters, then the target's shared LM head (or the head's own). W starts at zero, so an untrained head
predicts what the target's own next-token head predicts."""

from __future__ import annotations

import torch
from torch import nn

from ..adapter import DraftVocabulary, ModelAdapter, ModelFingerprint
from ..engine.adaptive import expected_tokens
from .base import Costs, Draft, DraftHeads, DraftSetting, on_target


class ResidualBlock(nn.Module):
    """x + SiLU(W x + b), W zero-initialised (the block starts as the identity)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + nn.functional.silu(self.linear(hidden))


class MedusaHeads(DraftHeads):
    """`num_heads` heads of `num_layers` residual blocks each (independent parameters throughout), read by
    the target's shared LM head, or by each head's own LM head when `own_lm_head`."""

    kind = "medusa"
    setting_names = ("num_heads", "num_layers", "own_lm_head", "num_draft_tokens", "tree")

    def __init__(
        self,
        fingerprint: ModelFingerprint,
        num_heads: int,
        num_layers: int = 1,
        own_lm_head: bool = False,
        num_draft_tokens: int | None = None,
        tree: list[list[int]] | None = None,
        position_cost: float | None = None,
        draft_lora: dict | None = None,
    ):
        if own_lm_head and draft_lora:
            raise ValueError("a draft LoRA adapts the shared LM head; Medusa heads with their own LM heads have none")
        super().__init__(fingerprint, num_draft_tokens, position_cost, draft_lora)
        self.tree = [list(path) for path in tree] if tree is not None else None  # default candidate tree
        if num_heads < 1 or num_layers < 1:
            raise ValueError(f"MedusaHeads needs num_heads >= 1 and num_layers >= 1; got {num_heads}, {num_layers}.")
        self.num_heads, self.num_layers, self.own_lm_head = num_heads, num_layers, own_lm_head
        hidden = fingerprint.hidden_size
        # a fresh module per head and per block: never [module] * n, which would share one set of weights
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResidualBlock(hidden) for _ in range(num_layers))) for _ in range(num_heads)
        )
        self.lm_heads = (
            nn.ModuleList(nn.Linear(hidden, fingerprint.vocab_size, bias=False) for _ in range(num_heads))
            if own_lm_head
            else None
        )

    def init_own_lm_heads(self, lm_head: nn.Module) -> None:
        """Start each own LM head as a copy of the target's (so an untrained head is its next-token head)."""
        if self.lm_heads is not None:
            with torch.no_grad():
                for head in self.lm_heads:
                    head.weight.copy_(lm_head.weight)

    def logits(
        self,
        hidden: torch.Tensor,
        adapter: ModelAdapter,
        count: int | None = None,
        vocab: DraftVocabulary | None = None,
    ) -> torch.Tensor:
        """Proposal logits of the first `count` heads (all by default): normed last hidden state [batch, H]
        -> [batch, count, V]. A draft of gamma tokens needs only gamma heads' LM-head products; a draft
        `vocab` narrows each to that vocabulary's rows."""
        per_head = []
        for index, blocks in enumerate(self.blocks[:count]):
            state = blocks(hidden)
            own = self.lm_heads[index] if self.lm_heads is not None else None
            per_head.append(adapter.lm_logits(state, own, vocab, self.draft_lora))
        return torch.stack(per_head, dim=1)

    @classmethod
    def from_config(cls, config, adapter: ModelAdapter) -> MedusaHeads:
        heads = cls(
            adapter.fingerprint(), config.num_heads, config.num_layers, config.own_lm_head, config.num_draft_tokens
        )
        heads.init_own_lm_heads(adapter.lm_head)
        return heads

    def draft_names(self) -> list[str]:
        return [f"medusa_{i}" for i in range(self.num_heads)]

    def hidden_entries(self) -> tuple[int, ...]:
        return (self.fingerprint.num_hidden_layers,)  # the normed last one

    def distillation_drafts(self, adapter: ModelAdapter, hidden_states, vocab=None, learn=None) -> list[Draft]:
        # head i reads the normed last hidden state at position t and predicts the token at t+2+i: its teacher is
        # the target's distribution at t+1+i
        normed = self._as_input(hidden_states[-1])
        length = normed.shape[1]
        drafts = []
        for i, blocks in enumerate(self.blocks):
            shift = 1 + i
            if length <= shift:
                break
            own = self.lm_heads[i] if self.lm_heads is not None else None

            def logits(hidden, blocks=blocks, own=own):
                state = blocks(hidden)  # an own LM head has the heads' dtype; the shared one, the target's
                state = state if own is not None else on_target(state, adapter)
                return adapter.lm_logits(state, own, vocab, self.draft_lora)

            drafts.append(Draft(f"medusa_{i}", normed[:, : length - shift], shift, logits))
        return drafts

    def untrained_copy(self) -> MedusaHeads:
        # no own LM heads: an untrained one is a copy of the shared LM head, which drafts the same
        return self._alike(MedusaHeads(self.fingerprint, self.num_heads, self.num_layers))

    def cost_timers(self, adapter: ModelAdapter, ids, positions, hidden, vocab) -> dict:
        # all heads on one hidden state: they run together, once per iteration
        return {"medusa": (lambda _: self.logits(hidden[:, -1], adapter, vocab=vocab), self.draft_names())}

    def speedups(self, alphas: dict[str, float], costs: Costs, max_gamma: int) -> dict[str, dict]:
        # one chain of the first gamma heads: E = 1 + a_0 + a_0 a_1 + ..., cost v(gamma) + c (all heads run once
        # per iteration), reported on each head's row as the chain up to that head
        names, table = self.draft_names(), {}
        for gamma, name in enumerate(names, start=1):
            c = costs.c(name)
            tokens = expected_tokens([alphas[n] for n in names[:gamma]])
            table[name] = {"c": c, "gamma": gamma, "speedup": tokens / (costs.v(gamma) + c)}
        return table

    def draft_settings(self, num_layers: int, max_gamma: int) -> list[DraftSetting]:
        # the heads run together: one call drafts num_heads tokens (a chain of gamma drafts costs gamma heads' share
        # of its time), or one level of a candidate tree
        n = self.num_heads
        return [DraftSetting("medusa", "medusa chain", {"tree": []}, n, "medusa_0", n, 1.0, tree_depth=n)]

    def set_defaults(self, options: dict) -> None:
        self.tree = options["tree"] or None  # [] (a chain): no default tree

    def description(self) -> str:
        return f"{self.num_heads} Medusa heads"
