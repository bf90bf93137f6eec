"""What `selfspec demo`, `bench`, `tune` and `profile` share: the target options (--model, --heads, --prompts,
--dtype ...), loading the target with its heads, prompts and draft vocabulary, and encoding the prompts."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from ..adapter import read_token_ids
from ..adapter.packed import packed_by_default
from ..hardware import speculation_dtype
from ..heads import DraftHeads, load_heads
from ..heads.base import nearest_existing
from ..measure.prompts import ChatPrompt, read_prompts
from ..targets import DEFAULT_TARGET, TargetError, default_heads, load_model, target_folder
from .parsers import BUNDLED, HALF_PRECISION_TARGETS


def default_dtype(model: str | None, device: str = "cpu") -> tuple[str, str]:
    """(dtype, why) for --dtype left out: for `HALF_PRECISION_TARGETS`, the dtype in which speculation pays on
    `device` (`selfspec.hardware.speculation_dtype`); float32 for the others."""
    if model in HALF_PRECISION_TARGETS:
        return speculation_dtype(device)
    return "float32", "this target's default; --dtype changes it"


def resolve_dtype(args: argparse.Namespace) -> None:
    """Fill in --device (cuda where torch sees one) and --dtype (`default_dtype`) where they were left out, and say
    which dtype and why."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    check_device(args.device)
    if args.dtype is None:
        args.dtype, reason = default_dtype(args.model or DEFAULT_TARGET, args.device)
        print(f"dtype: {args.dtype} ({reason})", flush=True)


def check_device(device: str) -> None:
    """SystemExit where --device names no torch device, or a GPU this torch cannot reach."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise SystemExit(f"--device {device!r} is not a torch device: cpu, cuda or cuda:N") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: this torch ({torch.__version__}) sees no CUDA GPU; use --device cpu")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise SystemExit(f"--device {device}: torch sees {torch.cuda.device_count()} GPU(s), cuda:0 and on")


def output_folder(path: str, option: str = "--output", make: bool = True) -> Path:
    """The folder a command writes into, checked (and made, with `make`) before any work, so that a file in its
    place or a folder that cannot be made stops the command at once rather than after its run."""
    folder = Path(path)
    existing = nearest_existing(folder)
    if not existing.is_dir():
        raise SystemExit(f"{option} {path}: {existing} is a file; name a folder")
    if not os.access(existing, os.W_OK):
        raise SystemExit(f"{option} {path}: this user cannot write into {existing}")
    if make:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise SystemExit(f"{option} {path}: cannot make the folder ({error.strerror or error})") from None
    return folder


def target_path(model: str | None) -> str | Path:
    """The folder behind --model: a known target's (its prompts, draft vocabulary and heads; selfspec.targets),
    else the argument itself; without --model, the bundled demo target (which only a clone of the repository has)."""
    path = target_folder(model or DEFAULT_TARGET)
    if path != BUNDLED:
        return path
    if not (BUNDLED / "config.json").exists():
        raise SystemExit(
            f"The bundled demo target is not at {BUNDLED}: run from a clone of the selfspec repository "
            "(pip install -e .), or pass --model and --heads."
        )
    return BUNDLED


def load_cli_model(model: str | None, dtype: str, device: str | None = None):
    """(model, tokenizer) for --model: a known target's name, a model folder or a hub name (default: the demo
    target); a known target that is not installed stops the command, saying what to install."""
    try:
        return load_model(model or DEFAULT_TARGET, dtype, device)
    except TargetError as error:
        raise SystemExit(str(error)) from error


def check_plotting() -> None:
    """Import matplotlib now, so that a missing [demo] extra stops a command before its run, not at its plot."""
    import matplotlib  # noqa: F401


def set_threads(num_threads: int) -> None:
    """torch's intra-op threads for this process (0 leaves torch's default)."""
    if num_threads:
        torch.set_num_threads(num_threads)


def load_target(args: argparse.Namespace, with_prompts: bool = True):
    """(model, tokenizer, heads by kind, prompt strings, draft vocabulary or None) from the command line; no prompts
    (an empty list) without `with_prompts`."""
    from ..adapter import ModelAdapter

    set_threads(args.num_threads)
    resolve_dtype(args)
    path = target_path(args.model)
    model, tokenizer = load_cli_model(args.model, args.dtype, args.device)
    packing, why = packed_by_default(model)  # what selfspec's eager contenders do (`SelfSpeculative(packed_weights=)`)
    print(f"packed weights for passes over several positions: {'on' if packing else 'off'} ({why})", flush=True)
    heads_paths = args.heads if args.heads is not None else default_heads(args.model or DEFAULT_TARGET)
    adapter = ModelAdapter(model)
    heads: dict[type, DraftHeads] = {}
    for heads_path in heads_paths or []:
        loaded = load_heads(heads_path, adapter)
        if type(loaded) in heads:
            raise SystemExit(f"--heads: two {type(loaded).__name__} folders given; pass one of each kind")
        heads[type(loaded)] = loaded.to(device=adapter.device, dtype=adapter.dtype)
    prompts_path = Path(args.prompts) if args.prompts else default_prompts(Path(path))
    if with_prompts and not prompts_path.exists():
        raise SystemExit(f"No prompts: {prompts_path} does not exist; pass --prompts FILE (.json or .jsonl)")
    vocab_path = Path(args.draft_vocab) if args.draft_vocab not in (None, "none") else Path(path) / "draft_vocab.json"
    if args.draft_vocab is not None and args.draft_vocab != "none" and not vocab_path.exists():
        raise SystemExit(f"--draft_vocab: {vocab_path} does not exist")
    use_vocab = args.draft_vocab != "none" and vocab_path.exists()
    vocab = read_token_ids(vocab_path) if use_vocab else None
    return model, tokenizer, heads, read_prompts(prompts_path, tokenizer) if with_prompts else [], vocab


def default_prompts(folder: Path) -> Path:
    """A target folder's prompts: `prompts.jsonl` (chat questions, rendered with the chat template) if it has one,
    else `prompts.json` (plain strings)."""
    chat = folder / "prompts.jsonl"
    return chat if chat.exists() else folder / "prompts.json"


def encode(tokenizer, prompts: list[str], device) -> list[torch.Tensor]:
    # a chat prompt holds its template's special tokens already
    return [tokenizer(prompt, return_tensors="pt", add_special_tokens=not isinstance(prompt, ChatPrompt))
            .input_ids.to(device) for prompt in prompts]  # fmt: skip


def check_prompt_lengths(inputs: list, max_new_tokens: int, limit: int | None) -> None:
    """Every prompt and its new tokens fit the model's `limit` positions (None: no limit), as `generate` will
    require: checked before any run, naming the prompt."""
    for number, ids in enumerate(inputs, 1):
        if limit is not None and ids.shape[1] + max_new_tokens > limit:
            raise SystemExit(
                f"prompt {number} ({ids.shape[1]} tokens) plus --max_new_tokens {max_new_tokens} exceeds the "
                f"model's {limit} positions: shorten it or lower --max_new_tokens"
            )
