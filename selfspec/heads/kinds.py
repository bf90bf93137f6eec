"""The registry of head kinds (`KINDS`, kind name -> `DraftHeads` subclass) and the heads folder's loader.

A folder holds `config.json` (kind, sizes and the fingerprint of the target), `model.safetensors` (the heads'
weights only, never pickle) and a `README.md` card (docs/design.md, "Heads folders"). `load_heads` reads the kind
from `config.json` and builds that class, after checking the fingerprint against the target's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors.torch import load_file

from ..adapter import ModelAdapter
from .base import CONFIG_NAME, WEIGHTS_NAME, DraftHeads, HeadsMismatchError
from .eagle import EagleHeads
from .early_exit import ExitHeads
from .medusa import MedusaHeads

# A new kind is a module with a `DraftHeads` subclass, its entry here, its drafter (`selfspec.drafters.build`) and its
# settings in `selfspec.training.config.HeadsConfig`.
KINDS: dict[str, type[DraftHeads]] = {kind.kind: kind for kind in (ExitHeads, MedusaHeads, EagleHeads)}


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
    if not path.exists():  # most often a typo or a relative path from another folder: show where it looked
        raise FileNotFoundError(f"No heads folder at {path} (looked in {path.resolve()}).")
    if not path.is_dir():
        raise NotADirectoryError(f"Heads path {path} is a file; pass the folder that holds config.json.")
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (path / name).is_file():
            raise HeadsMismatchError(f"Heads folder {path} has no {name}.")
    try:
        config = json.loads((path / CONFIG_NAME).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise HeadsMismatchError(f"Heads config {path / CONFIG_NAME} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise HeadsMismatchError(f"Heads config {path / CONFIG_NAME} is not a JSON object.")
    kind = KINDS.get(config.get("kind"))
    exported = config.get("selfspec", {}).get("format") if isinstance(config.get("selfspec"), dict) else None
    if kind is None and "kind" not in config and (exported or "speculators_model_type" in config):
        raise HeadsMismatchError(
            f"{path} is an EAGLE draft checkpoint for vLLM/SGLang ({exported or 'speculators'} format, as `selfspec "
            "export` writes it), not a heads folder: pass the heads folder it was exported from, or read it back with "
            "selfspec.export.load_export(path, model), which returns the head and its draft vocabulary."
        )
    if kind is None and "kind" not in config and "model_type" in config:  # a model's config.json, not heads'
        raise HeadsMismatchError(
            f"{path} is a model folder (model_type {config['model_type']!r}), not a heads folder: pass it as the model "
            "(from_pretrained / --model), and as heads= a folder that `training/train_heads.py` wrote (its config.json "
            f"has a 'kind', one of {sorted(KINDS)})."
        )
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
