"""Trained draft heads and their artifact folder (DESIGN.md section 5).

- Exit heads: a small residual block in front of the target's own final norm and LM head,
  h -> h + W_down SiLU(W_up RMSNorm(h)), one per exit depth. W_down starts at zero, so an untrained head
  is the identity and the draft equals the untrained exit.
- Medusa heads: n heads on the target's last (normed) hidden state; head i proposes the token i+1
  positions after the next one. Each head is one or more residual blocks x + SiLU(W x), every block
  with its own parameters, then the target's shared LM head (or the head's own). W starts at zero, so
  an untrained head predicts what the target's own next-token head predicts.

A folder holds `config.json` (kind, sizes and the fingerprint of the target), `model.safetensors` (the
heads' weights only, never pickle) and a `README.md` card. It is written atomically.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .adapter import DraftVocabulary, ModelAdapter, ModelFingerprint
from .lora import DraftLoRA

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CARD_NAME = "README.md"


class HeadsMismatchError(ValueError):
    """Heads trained for another target, or a heads folder that is incomplete or corrupted."""


class DraftHeads(nn.Module):
    """What every kind of heads shares: the target fingerprint, a default gamma, an optional draft-only LoRA
    on the shared LM head (`selfspec.lora`), the folder format."""

    kind = ""

    def __init__(
        self,
        fingerprint: ModelFingerprint,
        num_draft_tokens: int | None = None,
        position_cost: float | None = None,
        draft_lora: dict | None = None,
    ):
        super().__init__()
        self.fingerprint = fingerprint
        self.num_draft_tokens = num_draft_tokens
        self.position_cost = position_cost  # measured by `selfspec tune`: see SelfSpeculative(position_cost=)
        self.draft_lora = (
            DraftLoRA.from_settings(fingerprint.hidden_size, fingerprint.vocab_size, draft_lora) if draft_lora else None
        )

    def settings(self) -> dict:
        """The constructor arguments (besides the fingerprint) that rebuild these heads."""
        raise NotImplementedError

    def config_dict(self) -> dict:
        lora = self.draft_lora.settings() if self.draft_lora is not None else None
        settings = {**self.settings(), "position_cost": self.position_cost, "draft_lora": lora}
        return {"kind": self.kind, **settings, "target": self.fingerprint.to_dict()}

    def save_pretrained(self, path: str | os.PathLike, card: str | None = None) -> None:
        """Write config, weights and card atomically: a crash leaves the old folder or the new one."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        (staging / CONFIG_NAME).write_text(json.dumps(self.config_dict(), indent=2) + "\n")
        state = {name: tensor.detach().contiguous().cpu() for name, tensor in self.state_dict().items()}
        save_file(state, staging / WEIGHTS_NAME, metadata={"format": "pt", "kind": self.kind})
        (staging / CARD_NAME).write_text(
            card or f"# selfspec {self.kind} heads\n\nTarget: {self.fingerprint.name_or_path}\n"
        )
        if path.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
            os.replace(path, retired / path.name)
            os.replace(staging, path)
            shutil.rmtree(retired)
        else:
            os.replace(staging, path)


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

    def settings(self) -> dict:
        return {
            "exit_layers": self.exit_layers,
            "intermediate_size": self.intermediate_size,
            "num_draft_tokens": self.num_draft_tokens,
            "exit_layer": self.exit_layer,
        }


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

    def settings(self) -> dict:
        return {
            "num_heads": self.num_heads,
            "num_layers": self.num_layers,
            "own_lm_head": self.own_lm_head,
            "num_draft_tokens": self.num_draft_tokens,
            "tree": self.tree,
        }

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


KINDS: dict[str, type[DraftHeads]] = {ExitHeads.kind: ExitHeads, MedusaHeads.kind: MedusaHeads}


def check_fingerprint(recorded: dict, adapter: ModelAdapter, path: str | os.PathLike) -> None:
    """Raise `HeadsMismatchError` naming both sides when heads were trained for another target."""
    actual = adapter.fingerprint().to_dict()
    for key in ("model_type", "num_hidden_layers", "hidden_size", "vocab_size"):
        if recorded.get(key) != actual[key]:
            raise HeadsMismatchError(
                f"Heads at {path} were trained for a target with {key}={recorded.get(key)!r} "
                f"({recorded.get('name_or_path') or 'unnamed'}), but this model has {key}={actual[key]!r} "
                f"({actual['name_or_path'] or 'unnamed'})."
            )


def load_heads(path: str | os.PathLike, adapter: ModelAdapter) -> DraftHeads:
    """Load a heads folder for the target behind `adapter` (safetensors only; the fingerprint is checked)."""
    path = Path(path)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (path / name).is_file():
            raise HeadsMismatchError(f"Heads folder {path} has no {name}.")
    try:
        config = json.loads((path / CONFIG_NAME).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise HeadsMismatchError(f"Heads config {path / CONFIG_NAME} is not valid JSON: {error}") from error
    kind = KINDS.get(config.get("kind"))
    if kind is None:
        raise HeadsMismatchError(
            f"Heads at {path} are of kind {config.get('kind')!r}; expected one of {sorted(KINDS)}."
        )
    check_fingerprint(config.get("target", {}), adapter, path)
    settings = {name: value for name, value in config.items() if name not in {"kind", "target", "hidden_size"}}
    try:
        heads = kind(adapter.fingerprint(), **settings)
    except TypeError as error:
        raise HeadsMismatchError(f"Heads config {path / CONFIG_NAME} has unexpected fields: {error}") from error
    try:
        state = load_file(path / WEIGHTS_NAME)
    except Exception as error:  # safetensors raises its own error types for truncated or corrupted files
        raise HeadsMismatchError(f"Heads weights {path / WEIGHTS_NAME} cannot be read: {error}") from error
    try:
        missing, unexpected = heads.load_state_dict(state, strict=False)
    except RuntimeError as error:  # a tensor of the wrong shape
        raise HeadsMismatchError(f"Heads weights {path / WEIGHTS_NAME} do not match {CONFIG_NAME}: {error}") from error
    if missing or unexpected:
        raise HeadsMismatchError(
            f"Heads weights {path / WEIGHTS_NAME} do not match {CONFIG_NAME}: "
            f"missing {missing}, unexpected {unexpected}."
        )
    return heads.eval()  # inference: no dropout (a draft LoRA trained with dropout has some)
