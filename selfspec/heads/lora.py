"""Draft-only LoRA: a low-rank update of the target's LM head that drafts read and the verify pass never does.

With an adapter, a draft's logits are W h + s B (A h), where W is the target's own LM head (shared: never
copied, never changed), A [r, H] and B [V, r] the adapter's factors and s = lora_alpha / r (lora_alpha /
sqrt(r) with rsLoRA). Exit heads and Medusa heads both end in the shared LM head, so one adapter there lets
every draft move its q towards p in directions the head blocks alone cannot reach (the LM head's rows).

peft builds the adapter: `DraftLoRA.from_peft` applies a `peft.LoraConfig` to the LM head held by a small
wrapper module (so the target's own module tree is untouched: `model.lm_head` stays a plain layer) and
adopts the factors of peft's LoRA layer, initialised as peft initialises them. The factors then live in the
heads (trained, checkpointed and saved with them). Drafts compute the update themselves, because a reduced
draft vocabulary needs only some rows of B. The verify pass runs the model itself, so what is verified is
the unmodified target with the adapter switched off, by construction; the adapter moves q and with it
alpha, never the distribution of what is committed.
"""

from __future__ import annotations

import math

import torch
from torch import nn

TARGET = "lm_head"  # the only module a draft-only adapter may adapt (see `check_target`)


def check_target(target: str) -> None:
    """Only the LM head: the draft's lower layers write KV entries and hidden states that the verify pass
    reuses, so an adapter inside a decoder layer would change what is verified."""
    if target != TARGET:
        raise ValueError(
            f"draft-only LoRA adapts the shared LM head ({TARGET!r}) only, not {target!r}: an adapter on a decoder "
            "layer would change the KV entries and hidden states that the early-exit verify pass reuses, and the "
            "exit and Medusa head blocks are trained in full already."
        )


class _LMHeadHolder(nn.Module):
    """Holds the target's LM head under the name peft targets; peft swaps the holder's attribute, not the model's."""

    def __init__(self, lm_head: nn.Module):
        super().__init__()
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


class DraftLoRA(nn.Module):
    """The factors A and B of a LoRA adapter on the target's LM head, for drafts only."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        r: int,
        lora_alpha: float,
        lora_dropout: float = 0.0,
        use_rslora: bool = False,
    ):
        super().__init__()
        if r < 1:
            raise ValueError(f"draft LoRA rank r must be at least 1, got {r}")
        if not 0.0 <= lora_dropout < 1.0:
            raise ValueError(f"draft LoRA dropout must be in [0, 1), got {lora_dropout}")
        self.r, self.lora_alpha, self.lora_dropout, self.use_rslora = r, float(lora_alpha), lora_dropout, use_rslora
        self.lora_A = nn.Linear(hidden_size, r, bias=False)
        self.lora_B = nn.Linear(r, vocab_size, bias=False)
        nn.init.zeros_(self.lora_B.weight)  # a fresh adapter changes nothing
        self.dropout = nn.Dropout(lora_dropout)

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def settings(self) -> dict:
        """What `config.json` records (the constructor's keyword arguments besides the sizes)."""
        return {
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "lora_dropout": self.lora_dropout,
            "use_rslora": self.use_rslora,
            "target": TARGET,
        }

    @classmethod
    def from_settings(cls, hidden_size: int, vocab_size: int, settings: dict) -> DraftLoRA:
        settings = dict(settings)
        check_target(settings.pop("target", TARGET))
        return cls(hidden_size, vocab_size, **settings)

    @classmethod
    def from_peft(cls, lm_head: nn.Linear, config) -> DraftLoRA:
        """An adapter built by peft from `config` (a `peft.LoraConfig` whose target_modules is ["lm_head"])
        on `lm_head`, which stays as it is: these factors are the factors of peft's LoRA layer."""
        from peft import get_peft_model

        targets = config.target_modules
        targets = [targets] if isinstance(targets, str) else sorted(targets or [])
        if targets != [TARGET]:
            check_target(",".join(targets) or "(none)")
        for option in ("use_dora", "lora_bias"):
            if getattr(config, option, False):
                raise ValueError(f"draft LoRA does not support peft's {option}")
        if config.init_lora_weights not in (True, False, "gaussian"):  # pissa, olora, loftq ... rewrite W itself
            raise ValueError(
                f"draft LoRA needs an initialisation that leaves the LM head as it is (True, False or 'gaussian'), "
                f"not init_lora_weights={config.init_lora_weights!r}"
            )
        lm_head = getattr(lm_head, "base_layer", lm_head)  # a LoRA-tuned target's head: peft's layer wraps the base
        if not isinstance(lm_head, nn.Linear):
            raise ValueError(
                f"draft LoRA needs the target's LM head to be a linear layer, got {type(lm_head).__name__}"
            )
        requires_grad = [p.requires_grad for p in lm_head.parameters()]
        layer = get_peft_model(_LMHeadHolder(lm_head), config).base_model.model.lm_head
        for parameter, flag in zip(lm_head.parameters(), requires_grad, strict=True):
            parameter.requires_grad_(flag)  # peft freezes the base layer; leave the target's flags as they were
        name = next(iter(layer.lora_A))
        lora = cls(lm_head.in_features, lm_head.out_features, config.r, config.lora_alpha, config.lora_dropout,
                   config.use_rslora)  # fmt: skip
        lora.lora_A, lora.lora_B = layer.lora_A[name], layer.lora_B[name]
        if not math.isclose(layer.scaling[name], lora.scaling):
            raise RuntimeError(f"peft scales this adapter by {layer.scaling[name]}, selfspec by {lora.scaling}")
        return lora

    def delta(self, normed: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """s B A h for the LM head's input `normed` [..., H] -> [..., V] (or [..., len(rows)] for those rows of
        B only), in the dtype of `normed`."""
        weight = self.lora_A.weight
        low = nn.functional.linear(self.dropout(normed.to(weight.dtype)), weight)
        up = self.lora_B.weight if rows is None else self.lora_B.weight.index_select(0, rows)
        return (nn.functional.linear(low, up) * self.scaling).to(normed.dtype)

    def extra_repr(self) -> str:
        return f"r={self.r}, lora_alpha={self.lora_alpha}, scaling={self.scaling:g}, target={TARGET}"


def peft_lora_config(r: int, alpha: float, dropout: float = 0.0, rslora: bool = False, init: str = "default"):
    """The `peft.LoraConfig` of a draft-only adapter on the LM head (init: default | gaussian)."""
    from peft import LoraConfig

    return LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        use_rslora=rslora,
        init_lora_weights=True if init == "default" else init,
        target_modules=[TARGET],
        bias="none",
    )
