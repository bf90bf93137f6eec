"""What `selfspec demo`, `bench`, `tune` and `profile` share: the target options (--model, --heads, --prompts,
--dtype ...), loading the target with its heads, prompts and draft vocabulary, and encoding the prompts."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..adapter import read_token_ids
from ..hardware import speculation_dtype
from ..heads import DraftHeads, load_heads
from ..measure.prompts import ChatPrompt, read_prompts
from ..targets import DEFAULT_TARGET, DEMO_TARGET, KNOWN_TARGETS, TargetError, default_heads, load_model, target_folder

REPOSITORY = Path(__file__).resolve().parents[2]
BUNDLED = KNOWN_TARGETS[DEFAULT_TARGET].folder  # heads/demo-target
BUNDLED_CONFIG = REPOSITORY / "configs" / "train_heads_demo.yaml"  # lists the demo target's held-out files
THREADS_HELP = (
    "torch CPU threads; 0: torch's default (one per core). One by default: a small model at batch 1 gains little "
    "from more, and on a busy machine threads that wait for a core slow every step down"
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where it has none or the help text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False) or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


# targets that run in bfloat16 where the machine multiplies it natively (`selfspec.hardware`), in float32 elsewhere;
# every other target runs in float32 unless --dtype says otherwise (the toy target's checks are token for token)
HALF_PRECISION_TARGETS = {DEMO_TARGET}


def default_dtype(model: str | None, device: str = "cpu") -> tuple[str, str]:
    """(dtype, why) for --dtype left out: for `HALF_PRECISION_TARGETS`, the dtype in which speculation pays on
    `device` (`selfspec.hardware.speculation_dtype`); float32 for the others."""
    if model in HALF_PRECISION_TARGETS:
        return speculation_dtype(device)
    return "float32", "this target's default; --dtype changes it"


def resolve_dtype(args: argparse.Namespace) -> None:
    """Fill in --dtype where it was left out (`default_dtype`), and say which and why."""
    if args.dtype is None:
        args.dtype, reason = default_dtype(args.model or DEFAULT_TARGET, args.device)
        print(f"dtype: {args.dtype} ({reason})", flush=True)


TARGET_CHOICES = f"a known target ({', '.join(KNOWN_TARGETS)}), a model folder or a hub name"


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


def add_model_arguments(parser: argparse.ArgumentParser, bundled: bool, demo: bool = False) -> None:
    """The target options. `bundled`: --model may be left out for the bundled toy target (bench, tune);
    `demo`: for DEMO_TARGET instead. Without --dtype, `load_target` chooses one (`default_dtype`) and says why."""
    if demo:
        where = f" (default: {DEMO_TARGET}; demo: the bundled toy target, {BUNDLED})"
    elif bundled:
        where = f" (default: the bundled toy target demo, {BUNDLED}; selfspec demo defaults to {DEMO_TARGET})"
    else:
        where = ""
    parser.add_argument(
        "--model",
        default=DEMO_TARGET if demo else None,
        required=not (bundled or demo),
        help=f"the target: {TARGET_CHOICES}{where}",
    )
    parser.add_argument(
        "--heads",
        action="append",
        help="a trained heads folder for the model (exit, Medusa or EAGLE); repeat for several kinds",
    )
    parser.add_argument(
        "--prompts",
        help="prompts: a .json list or a .jsonl file, or Spec-Bench questions (.jsonl rows with category and turns: "
        "the first turn through the chat template) (default: the model's prompts.jsonl or prompts.json)",
    )
    parser.add_argument("--max_new_tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument(
        "--dtype",
        help="float32 | bfloat16 | float16 | auto (default: for "
        f"{', '.join(sorted(HALF_PRECISION_TARGETS))}, bfloat16 on a GPU or a CPU with native bf16 (avx512_bf16, "
        "amx_bf16) and float32 on other CPUs, where bf16 passes over several positions cost several steps and "
        "speculation loses; float32 for other targets). In half precision the greedy check allows ties of the top-2 "
        "scores (selfspec.measure.ties); in float32 it is token for token",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    parser.add_argument("--num_threads", type=int, default=1, help=THREADS_HELP)
    parser.add_argument(
        "--draft_vocab",
        help="a JSON file with a list of token ids for reduced-vocabulary drafts (default: the model's "
        "draft_vocab.json if it has one; 'none' for full-vocabulary drafts only)",
    )


def load_target(args: argparse.Namespace, with_prompts: bool = True):
    """(model, tokenizer, heads by kind, prompt strings, draft vocabulary or None) from the command line; no prompts
    (an empty list) without `with_prompts`."""
    from ..adapter import ModelAdapter

    set_threads(args.num_threads)
    resolve_dtype(args)
    path = target_path(args.model)
    model, tokenizer = load_cli_model(args.model, args.dtype, args.device)
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
