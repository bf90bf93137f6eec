"""A target's bundle: one folder that `SelfSpeculative(model, heads=FOLDER)` takes whole.

`bundle.json` names what the folder holds (a heads folder, a draft vocabulary, a memory of the model's own answers)
and the drafting that measured best, per dtype where they differ, with the command that chose it. Arguments given
to `SelfSpeculative` override what the bundle records: a `drafter` given replaces the recorded drafting (drafters,
tree and lookup length) as a whole, any other argument only itself.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

BUNDLE_NAME = "bundle.json"
DRAFTING = ("drafter", "tree", "prompt_lookup_num_tokens")  # the settings one recorded drafting holds
DEFAULT_DRAFTING = "default"  # the drafting for dtypes the bundle records none for


GENERATE_PY = '''"""selfspec's exact speculative decoding as a transformers `custom_generate` loop:
model.generate(**inputs, custom_generate=THIS_FOLDER, trust_remote_code=True[, bundle=THIS_FOLDER])."""

from selfspec.custom_generate import bundle_generate

BUNDLE = "{name}"  # the bundle selfspec ships under this name; bundle=FOLDER names another


def generate(model, **kwargs):
    return bundle_generate(model, BUNDLE, **kwargs)
'''


class BundleError(ValueError):
    """A bundle folder that cannot be used: a missing file, a malformed bundle.json, another target's bundle."""


@dataclass
class Bundle:
    """What `bundle.json` records; paths are relative to the folder."""

    path: Path
    target: dict
    heads: str | None = None
    draft_vocab: str | None = None
    memory: str | None = None
    suffix: dict = field(default_factory=dict)  # SuffixDrafter settings for the "suffix" drafter
    drafting: dict = field(default_factory=dict)  # dtype name (or "default") -> {drafter, tree, ...}
    chosen_by: str | None = None  # the command that chose the drafting

    def __post_init__(self):
        self.path = Path(self.path)
        for name, drafting in self.drafting.items():
            if not isinstance(drafting, dict) or set(drafting) - set(DRAFTING):
                raise BundleError(
                    f"{self.path / BUNDLE_NAME}: drafting {name!r} must be an object of {', '.join(DRAFTING)}; got "
                    f"{drafting!r}."
                )

    def file(self, name: str | None) -> Path | None:
        if name is None:
            return None
        path = self.path / name
        if not path.exists():
            raise BundleError(f"The bundle {self.path} names {name}, which it does not hold.")
        return path

    def drafting_for(self, dtype) -> dict:
        """The recorded drafting for a model in `dtype` (a torch dtype): its own entry, else the default one."""
        name = str(dtype).removeprefix("torch.")
        return dict(self.drafting.get(name, self.drafting.get(DEFAULT_DRAFTING, {})))

    def to_dict(self) -> dict:
        return {
            "kind": "bundle",
            "target": self.target,
            "heads": self.heads,
            "draft_vocab": self.draft_vocab,
            "memory": self.memory,
            "suffix": self.suffix,
            "drafting": self.drafting,
            "chosen_by": self.chosen_by,
        }

    def save(self) -> None:
        """bundle.json, and `custom_generate/` so that the folder also serves `model.generate(custom_generate=...)`."""
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / BUNDLE_NAME).write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        (self.path / "custom_generate").mkdir(exist_ok=True)
        (self.path / "custom_generate" / "generate.py").write_text(GENERATE_PY.format(name=self.path.name))
        (self.path / "custom_generate" / "requirements.txt").write_text("selfspec\n")


def is_bundle(path) -> bool:
    return isinstance(path, str | os.PathLike) and (Path(path) / BUNDLE_NAME).is_file()


def load_bundle(path: str | os.PathLike) -> Bundle:
    path = Path(path)
    try:
        config = json.loads((path / BUNDLE_NAME).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise BundleError(f"{path / BUNDLE_NAME} is not valid JSON: {error}") from error
    if not isinstance(config, dict) or config.get("kind") != "bundle":
        raise BundleError(f"{path / BUNDLE_NAME} is not a selfspec bundle (its 'kind' must be 'bundle').")
    config.pop("kind")
    known = set(Bundle.__dataclass_fields__) - {"path"}
    unknown = sorted(set(config) - known)
    if unknown:
        raise BundleError(f"{path / BUNDLE_NAME} has unknown fields: {', '.join(unknown)}.")
    return Bundle(path=path, **config)
