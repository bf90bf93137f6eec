"""`selfspec bundle FOLDER --model M`: make a target's folder a bundle that `SelfSpeculative(model, heads=FOLDER)` takes
whole: the heads folder and draft vocabulary it holds, a memory of the model's own answers read from chat data, and
the drafting to record (as the bench measured it), with the command that chose it."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from .parsers import TARGET_CHOICES, add_command, positive

DRAFTING_HELP = (
    'a JSON object: dtype name (or "default") -> {"drafter": [...], "tree": ..., "prompt_lookup_num_tokens": N}, '
    "the SelfSpeculative arguments that measured best"
)


def add_bundle_parser(commands) -> None:
    parser = add_command(commands, "bundle", help="make a target's folder a bundle: heads, memory, recorded drafting")
    parser.add_argument("folder", help="the bundle folder: it holds the heads folder and draft_vocab.json, if any")
    parser.add_argument("--model", required=True, help=f"the target: {TARGET_CHOICES}")
    parser.add_argument("--memory", help="chat data (.jsonl or .jsonl.gz of messages, comma-separated) whose answers "
                        "the memory holds, as the model's tokenizer renders them")  # fmt: skip
    parser.add_argument("--memory_tokens", type=positive, help="the memory's bound in tokens (default: every answer)")
    parser.add_argument("--drafting", type=json.loads, required=True, help=DRAFTING_HELP)
    parser.add_argument("--chosen_by", required=True, help="the command (the bench run) that chose the drafting")
    parser.add_argument("--suffix_tokens", type=positive, default=6, help="suffix drafting's longest chain")


def run_bundle(args: argparse.Namespace) -> int:
    from ..adapter import ModelAdapter
    from ..bundle import Bundle
    from ..chat import chat_answers
    from ..drafters.memory import SuffixMemory
    from ..heads.base import CONFIG_NAME
    from ..targets import load_model

    folder = Path(args.folder)
    heads = sorted(
        p.name for p in folder.iterdir() if (p / CONFIG_NAME).is_file() and (p / "model.safetensors").is_file()
    )
    if len(heads) > 1:
        raise ValueError(f"{folder} holds several heads folders ({', '.join(heads)}); a bundle records one")
    model, tokenizer = load_model(args.model, dtype="float32")
    bundle = Bundle(
        path=folder,
        target=ModelAdapter(model).fingerprint().to_dict(),
        heads=heads[0] if heads else None,
        draft_vocab="draft_vocab.json" if (folder / "draft_vocab.json").is_file() else None,
        suffix={"num_speculative_tokens": args.suffix_tokens},
        drafting=args.drafting,
        chosen_by=args.chosen_by,
    )
    if args.memory:
        started = time.perf_counter()
        answers = []
        for path in args.memory.split(","):
            answers += chat_answers(path, tokenizer, args.memory_tokens and args.memory_tokens - sum(map(len, answers)))
            if args.memory_tokens and sum(map(len, answers)) >= args.memory_tokens:
                break
        memory = SuffixMemory.from_answers(answers)
        memory.save(folder / "memory.safetensors")
        bundle.memory = "memory.safetensors"
        print(f"memory: {memory.tokens:,} tokens of {len(memory):,} answers ({time.perf_counter() - started:.0f} s)")
    bundle.save()
    print(
        f"wrote {folder / 'bundle.json'} and {folder / 'custom_generate'} ({shlex.join(['selfspec', *sys.argv[1:]])})"
    )
    return 0
