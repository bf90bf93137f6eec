"""The `selfspec` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import SUPPORTED_ARCHITECTURES, __version__
from .demo import add_bench_parser, add_demo_parser, add_tune_parser, run_bench_command, run_demo, run_tune_command


def add_profile_parser(commands) -> None:
    profile = commands.add_parser(
        "profile",
        help="held-out alpha per exit depth (untrained exit and trained heads), measured c, predicted speedup",
    )
    profile.add_argument("--model", required=True, help="the target: a model folder or hub name")
    profile.add_argument("--heads", help="a trained heads folder for the model (else the untrained exit only)")
    profile.add_argument("--data", required=True, help="held-out text: comma-separated file globs or a folder")
    profile.add_argument("--exit_layers", help="without --heads: exit depths to profile, e.g. 2,4,6 (default spread)")
    profile.add_argument("--text_field", default="text", help="jsonl / parquet text column")
    profile.add_argument("--seq_len", type=int, default=256, help="tokens per evaluated row")
    profile.add_argument("--max_rows", type=int, default=64, help="rows evaluated")
    profile.add_argument("--batch_size", type=int, default=8, help="rows per forward")
    profile.add_argument("--timing_context", type=int, default=64, help="cached tokens while timing one-token steps")
    profile.add_argument("--timing_repeats", type=int, default=20, help="timed repetitions (median)")
    profile.add_argument("--max_gamma", type=int, default=8, help="largest gamma for the predicted speedup")
    profile.add_argument("--measure_v", action="store_true", help="measure v(gamma) instead of assuming 1")
    profile.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | auto")
    profile.add_argument("--num_threads", type=int, help="torch threads (1 on a busy CPU: waiting threads skew c)")
    profile.add_argument("--output", default="runs/profile", help="folder for alpha_by_depth.png")
    profile.add_argument("--draft_vocab", help="a JSON list of token ids: also profile drafts from these rows only")
    profile.add_argument("--draft_quant", choices=["int8"], help="also profile drafts through an int8 LM head")
    profile.add_argument("--report_to", default="none", choices=["none", "wandb"], help="also log a W&B run")
    profile.add_argument("--project", default="selfspec-profile", help="W&B project")


def run_profile(args: argparse.Namespace) -> int:
    """`selfspec profile`: print the table, write the plot, optionally log a W&B run."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .adapter import ModelAdapter
    from .config import DataConfig, EvalConfig, default_exit_layers
    from .data import load_rows, row_tensor
    from .heads import ExitHeads, load_heads
    from .profile import configure_wandb, format_table, plot_alpha, profile_heads, wandb_objects

    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    adapter = ModelAdapter(model)
    if args.heads:
        heads, trained = load_heads(args.heads, adapter), True
    else:
        layers = [int(x) for x in args.exit_layers.split(",")] if args.exit_layers else None
        heads, trained = ExitHeads(adapter.fingerprint(), layers or default_exit_layers(adapter.num_layers)), False
    heads.to(device=adapter.device, dtype=adapter.dtype)
    data = DataConfig(source=args.data, text_field=args.text_field, seq_len=args.seq_len)
    heldout = load_rows(data, tokenizer, split=False).heldout
    rows_tensor = row_tensor(heldout, range(min(args.max_rows, len(heldout))))
    config = EvalConfig(
        max_rows=args.max_rows,
        batch_size=args.batch_size,
        timing_context=args.timing_context,
        timing_repeats=args.timing_repeats,
        max_gamma=args.max_gamma,
        measure_v=args.measure_v,
    )
    vocab = None
    if args.draft_vocab or args.draft_quant:
        ids = json.loads(Path(args.draft_vocab).read_text(encoding="utf-8")) if args.draft_vocab else None
        vocab = adapter.draft_vocabulary(ids, args.draft_quant)
    rows = profile_heads(model, heads, rows_tensor, config, trained=trained, vocab=vocab)
    print(f"{args.model}: {rows_tensor.shape[0]} rows of {args.seq_len} tokens from {args.data}")
    print(format_table(rows))
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    plot_alpha(rows, output / "alpha_by_depth.png", f"{args.model}: alpha per draft depth")
    print(f"plot: {output / 'alpha_by_depth.png'}")
    if args.report_to == "wandb":
        import wandb

        configure_wandb("auto")
        run = wandb.init(project=args.project, dir=str(output), config=vars(args))
        run.log(wandb_objects(rows))
        run.summary.update({f"alpha/{row['draft']}": row.get("alpha", row["untrained_alpha"]) for row in rows})
        run.finish()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="selfspec", description="Exact self-speculative decoding for causal LMs.")
    parser.add_argument("--version", action="version", version=f"selfspec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    add_demo_parser(commands)
    add_bench_parser(commands)
    add_tune_parser(commands)
    commands.add_parser("architectures", help="list the supported model types")
    add_profile_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "architectures":
        print("\n".join(sorted(SUPPORTED_ARCHITECTURES)))
        return 0
    if args.command == "profile":
        return run_profile(args)
    if args.command == "demo":
        return run_demo(args)
    if args.command == "bench":
        return run_bench_command(args)
    if args.command == "tune":
        return run_tune_command(args)
    return 1


if __name__ == "__main__":
    sys.exit(main())
