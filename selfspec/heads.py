"""Trained exit heads and their artifact folder (DESIGN.md section 5).

An exit head is a small residual block in front of the target's own final norm and LM head:
h -> h + W_down SiLU(W_up RMSNorm(h)), with W_down zero-initialised so an untrained head is the identity
(the draft then equals the untrained exit). A folder holds `config.json` (kind, sizes, exit layers and
the fingerprint of the target), `model.safetensors` (the heads' weights only) and a `README.md` card.
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

from .adapter import ModelAdapter, ModelFingerprint

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CARD_NAME = "README.md"


class HeadsMismatchError(ValueError):
    """Heads trained for another target, or a heads folder that is incomplete or corrupted."""


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


class ExitHeads(nn.Module):
    """One `ExitHead` per exit depth, each with its own parameters, for one target model."""

    kind = "exit"

    def __init__(
        self,
        fingerprint: ModelFingerprint,
        exit_layers: list[int],
        intermediate_size: int | None = None,
        num_draft_tokens: int | None = None,
    ):
        super().__init__()
        if not exit_layers:
            raise ValueError("ExitHeads needs at least one exit layer.")
        for layer in exit_layers:
            if not 1 <= layer < fingerprint.num_hidden_layers:
                raise ValueError(
                    f"exit layer {layer} is out of range for a target with {fingerprint.num_hidden_layers} layers "
                    f"(1 to {fingerprint.num_hidden_layers - 1})."
                )
        self.fingerprint = fingerprint
        self.exit_layers = sorted(set(exit_layers))
        self.intermediate_size = intermediate_size or 2 * fingerprint.hidden_size
        self.num_draft_tokens = num_draft_tokens
        self.heads = nn.ModuleDict(
            {str(layer): ExitHead(fingerprint.hidden_size, self.intermediate_size) for layer in self.exit_layers}
        )

    @property
    def default_exit_layer(self) -> int:
        return self.exit_layers[0]

    def head_for(self, exit_layer: int) -> ExitHead:
        if str(exit_layer) not in self.heads:
            raise ValueError(f"These heads were trained for exit layers {self.exit_layers}, not for exit_layer={exit_layer}.")
        return self.heads[str(exit_layer)]

    def config_dict(self) -> dict:
        return {
            "kind": self.kind,
            "exit_layers": self.exit_layers,
            "hidden_size": self.fingerprint.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_draft_tokens": self.num_draft_tokens,
            "target": self.fingerprint.to_dict(),
        }

    def save_pretrained(self, path: str | os.PathLike, card: str | None = None) -> None:
        """Write config, weights and card atomically: a crash leaves the old folder or the new one."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        (staging / CONFIG_NAME).write_text(json.dumps(self.config_dict(), indent=2) + "\n")
        state = {name: tensor.detach().contiguous().cpu() for name, tensor in self.state_dict().items()}
        save_file(state, staging / WEIGHTS_NAME, metadata={"format": "pt", "kind": self.kind})
        (staging / CARD_NAME).write_text(card or f"# selfspec exit heads\n\nTarget: {self.fingerprint.name_or_path}\n")
        if path.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
            os.replace(path, retired / path.name)
            os.replace(staging, path)
            shutil.rmtree(retired)
        else:
            os.replace(staging, path)


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


def load_heads(path: str | os.PathLike, adapter: ModelAdapter) -> ExitHeads:
    """Load a heads folder for the target behind `adapter` (safetensors only; the fingerprint is checked)."""
    path = Path(path)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (path / name).is_file():
            raise HeadsMismatchError(f"Heads folder {path} has no {name}.")
    try:
        config = json.loads((path / CONFIG_NAME).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise HeadsMismatchError(f"Heads config {path / CONFIG_NAME} is not valid JSON: {error}") from error
    if config.get("kind") != ExitHeads.kind:
        raise HeadsMismatchError(f"Heads at {path} are of kind {config.get('kind')!r}; expected {ExitHeads.kind!r}.")
    check_fingerprint(config.get("target", {}), adapter, path)
    heads = ExitHeads(
        adapter.fingerprint(),
        config["exit_layers"],
        intermediate_size=config["intermediate_size"],
        num_draft_tokens=config.get("num_draft_tokens"),
    )
    try:
        state = load_file(path / WEIGHTS_NAME)
    except Exception as error:  # safetensors raises its own error types for truncated or corrupted files
        raise HeadsMismatchError(f"Heads weights {path / WEIGHTS_NAME} cannot be read: {error}") from error
    missing, unexpected = heads.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise HeadsMismatchError(f"Heads weights {path / WEIGHTS_NAME} do not match {CONFIG_NAME}: missing {missing}, unexpected {unexpected}.")
    return heads
