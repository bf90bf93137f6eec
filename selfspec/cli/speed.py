"""`selfspec speed`: `model.generate`, `SelfSpeculative(model)` and `SelfSpeculative(model, heads=BUNDLE)` side by side
(`selfspec.measure.speed`)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from .parsers import TARGET_CHOICES, add_command, positive


def add_speed_parser(commands) -> None:
    parser = add_command(commands, "speed", help="the one-line calls side by side: generate, selfspec, its bundle")
    parser.add_argument("--model", required=True, help=f"the target: {TARGET_CHOICES}")
    parser.add_argument("--bundle", help="a bundle folder for the model (default: none, SelfSpeculative(model) only)")
    parser.add_argument("--prompts", required=True, help="Spec-Bench questions (.jsonl) or a prompts file")
    parser.add_argument("--limit_per_category", type=positive, help="the first N questions of each category")
    parser.add_argument("--max_new_tokens", type=positive, default=128, help="tokens generated per prompt")
    parser.add_argument("--temperature", type=float, help="sample at this temperature (default: greedy)")
    parser.add_argument("--dtype", help="float32 | bfloat16 (default: the one in which speculation pays here)")
    parser.add_argument("--num_threads", type=positive, default=1, help="torch threads")
    parser.add_argument("--output", help="a folder for results.json and speedup_by_category.png")


def run_speed(args: argparse.Namespace) -> int:
    import torch

    from ..measure.prompts import first_per_category, read_prompts
    from ..measure.speed import measure_speed, save_speed, speed_table
    from ..targets import load_model

    torch.set_num_threads(args.num_threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    prompts = read_prompts(args.prompts, tokenizer)
    if args.limit_per_category:
        prompts = first_per_category(prompts, args.limit_per_category)
    print(f"{args.model} in {model.dtype}, {len(prompts)} prompts, {args.max_new_tokens} new tokens")
    results, startup = measure_speed(model, tokenizer, prompts, args.bundle, args.max_new_tokens, args.temperature)
    print(speed_table(results, startup, args.temperature))
    if args.output:
        save_speed(results, startup, Path(args.output), shlex.join(["selfspec", *sys.argv[1:]]))
    return 0
