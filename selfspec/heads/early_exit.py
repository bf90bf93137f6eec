"""Exit heads: a small residual block in front of the target's own final norm and LM head,
h -> h + W_down SiLU(W_up RMSNorm(h)), one per exit depth. W_down starts at zero, so an untrained head is
the identity and the draft equals the untrained exit."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..adapter import ModelAdapter, ModelFingerprint
from ..engine.adaptive import best_gamma
from .base import Costs, Draft, DraftHeads, DraftSetting, on_target


class ExitHead(nn.Module):
    """h + down(SiLU(up(norm(h)))): a zero-initialised residual block before the shared final norm."""

    def __init__(self, hidden_size: int, intermediate_size: int, eps: float = 1e-6):
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.up = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)
        nn.init.zeros_(self.down.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.down(nn.functional.silu(self.up(self.norm(hidden))))


class ExitHeads(DraftHeads):
    """One `ExitHead` per exit depth, each with its own parameters, for one target model."""

    kind = "exit"
    setting_names = ("exit_layers", "intermediate_size", "num_draft_tokens", "exit_layer")

    def __init__(
        self,
        fingerprint: ModelFingerprint,
        exit_layers: list[int],
        intermediate_size: int | None = None,
        num_draft_tokens: int | None = None,
        exit_layer: int | None = None,
        position_cost: float | None = None,
        draft_lora: dict | None = None,
    ):
        super().__init__(fingerprint, num_draft_tokens, position_cost, draft_lora)
        if not exit_layers:
            raise ValueError("ExitHeads needs at least one exit layer.")
        for layer in exit_layers:
            if not 1 <= layer < fingerprint.num_hidden_layers:
                raise ValueError(
                    f"exit layer {layer} is out of range for a target with {fingerprint.num_hidden_layers} layers "
                    f"(1 to {fingerprint.num_hidden_layers - 1})."
                )
        self.exit_layers = sorted(set(exit_layers))
        self.intermediate_size = intermediate_size or 2 * fingerprint.hidden_size
        self.heads = nn.ModuleDict(
            {str(layer): ExitHead(fingerprint.hidden_size, self.intermediate_size) for layer in self.exit_layers}
        )
        if exit_layer is not None and exit_layer not in self.exit_layers:
            raise ValueError(f"default exit_layer {exit_layer} is not one of the trained depths {self.exit_layers}.")
        self.exit_layer = exit_layer  # the default depth (`selfspec tune` writes it); None: the first trained one

    @property
    def default_exit_layer(self) -> int:
        return self.exit_layer if self.exit_layer is not None else self.exit_layers[0]

    def head_for(self, exit_layer: int) -> ExitHead:
        if str(exit_layer) not in self.heads:
            raise ValueError(
                f"These heads were trained for exit layers {self.exit_layers}, not for exit_layer={exit_layer}."
            )
        return self.heads[str(exit_layer)]

    @classmethod
    def from_config(cls, config, adapter: ModelAdapter) -> ExitHeads:
        layers = config.exit_layers or default_exit_layers(adapter.num_layers)
        return cls(adapter.fingerprint(), layers, config.intermediate_size, config.num_draft_tokens)

    def draft_names(self) -> list[str]:
        return [f"exit_{k}" for k in self.exit_layers]

    def hidden_entries(self) -> tuple[int, ...]:
        return tuple(self.exit_layers)

    def distillation_drafts(self, adapter: ModelAdapter, hidden_states, vocab=None, learn=None) -> list[Draft]:
        # exit head k reads the pre-norm hidden state after layer k and predicts the next token: its teacher is
        # the target's distribution at the same position
        def logits(block: ExitHead) -> Callable[[torch.Tensor], torch.Tensor]:
            return lambda hidden: adapter.head_logits(on_target(block(hidden), adapter), vocab, self.draft_lora)

        return [
            Draft(f"exit_{k}", self._as_input(hidden_states[k]), 0, logits(self.head_for(k))) for k in self.exit_layers
        ]

    def untrained_copy(self) -> ExitHeads:
        return self._alike(ExitHeads(self.fingerprint, self.exit_layers, self.intermediate_size))

    def cost_timers(self, adapter: ModelAdapter, ids, positions, hidden, vocab) -> dict:
        def timer(k: int) -> Callable[[object], object]:  # layers 0..k-1 and exit head k for one token
            block = self.head_for(k)
            return lambda cache: adapter.head_logits(
                block(adapter.run_lower(ids, positions, cache, k)), vocab, self.draft_lora
            )

        return {f"exit_{k}": (timer(k), [f"exit_{k}"]) for k in self.exit_layers}

    def speedups(self, alphas: dict[str, float], costs: Costs, max_gamma: int) -> dict[str, dict]:
        table = {}  # each depth drafts chains of its own, one call per draft token: S(gamma) with its alpha
        for name, alpha in alphas.items():
            c = costs.c(name)
            gamma, speedup = best_gamma(alpha, c, max_gamma, costs.v)
            table[name] = {"c": c, "gamma": gamma, "speedup": speedup}
        return table

    def draft_settings(self, num_layers: int, max_gamma: int) -> list[DraftSetting]:
        settings = []
        for k in self.exit_layers:
            # the verify pass runs the lower k layers for one position only (their KV entries come from the
            # draft): its extra positions cost in the upper layers alone
            upper = (num_layers - k) / num_layers
            settings.append(DraftSetting(f"exit_{k}", f"exit {k}", {"exit_layer": k}, max_gamma, f"exit_{k}", 1, upper))
        return settings

    def set_defaults(self, options: dict) -> None:
        self.exit_layer = options["exit_layer"]

    def description(self) -> str:
        return "exit heads (one per exit depth)"


def default_exit_layers(num_layers: int) -> list[int]:
    """About L/6, L/4, L/3, L/2 and 2L/3 (2, 3, 4, 6, 8 of 12), within 1..L-1, without repeats."""
    depths = {min(num_layers - 1, max(1, round(num_layers * share))) for share in (1 / 6, 1 / 4, 1 / 3, 1 / 2, 2 / 3)}
    return sorted(depths)
