"""The `selfspec` command line."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from .. import __version__
from ..families import REFUSED_ARCHITECTURES, SUPPORT_RULE, SUPPORTED_ARCHITECTURES
from .bundle import add_bundle_parser, run_bundle
from .parsers import (
    BUNDLED,
    BUNDLED_CONFIG,
    PROFILE_PROJECT,
    add_bench_parser,
    add_command,
    add_demo_parser,
    add_export_parser,
    add_profile_parser,
    add_tune_parser,
)
from .speed import add_speed_parser, run_speed


# The commands, imported when they run (torch, transformers and the rest load then, not for --help)
def run_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def run_bench_command(args: argparse.Namespace) -> int:
    from .commands import run_bench_command

    return run_bench_command(args)


def run_tune_command(args: argparse.Namespace) -> int:
    from .commands import run_tune_command

    return run_tune_command(args)


def load_cli_model(model: str | None, dtype: str, device: str | None = None):
    """`selfspec.cli.options.load_cli_model` (profile and export load their target through this name)."""
    from .options import load_cli_model

    return load_cli_model(model, dtype, device)


def run_profile(args: argparse.Namespace) -> int:
    """`selfspec profile`: print the table, write the plot, optionally log a W&B run."""
    from ..adapter import ModelAdapter
    from ..heads import ExitHeads, default_exit_layers, load_heads
    from ..measure.profile import configure_wandb, format_table, plot_alpha, profile_heads, wandb_objects
    from ..training.config import DataConfig, EvalConfig
    from ..training.data import load_rows, row_tensors
    from .options import check_plotting, output_folder, set_threads, target_path

    if args.project is not None and args.report_to != "wandb":
        raise SystemExit("selfspec profile: --project names the W&B project of --report_to wandb: pass that too, or "
                         "leave it out")  # fmt: skip
    args.project = PROFILE_PROJECT if args.project is None else args.project
    check_plotting()
    if args.report_to == "wandb":
        import wandb  # now: a missing [train] extra stops the command before its run, not after it
    if args.heads and args.exit_layers:
        raise SystemExit("selfspec profile: --exit_layers profiles untrained exits; trained --heads have their own "
                         "layers: pass one of them")  # fmt: skip
    output = output_folder(args.output)
    set_threads(args.num_threads)
    path = target_path(args.model)
    bundled = path == BUNDLED  # the demo target, by default or by name: its exit heads and held-out files
    bundled_heads = bundled and args.exit_layers is None  # --exit_layers asks for untrained exits
    heads_path = args.heads or (BUNDLED / "exit-heads" if bundled_heads else None)
    source = args.data or (bundled_heldout() if bundled else None)
    if source is None:
        raise SystemExit("selfspec profile --model needs --data: held-out text for that model (file globs or a folder)")
    model, tokenizer = load_cli_model(args.model, args.dtype)
    adapter = ModelAdapter(model)
    if adapter.max_positions is not None and args.seq_len > adapter.max_positions:
        raise SystemExit(f"selfspec profile: --seq_len {args.seq_len} exceeds the model's {adapter.max_positions} "
                         "positions: lower it")  # fmt: skip
    check_timing_positions(args, adapter.max_positions)
    if heads_path:
        heads, trained = load_heads(heads_path, adapter), True
    else:
        layers = args.exit_layers or default_exit_layers(adapter.num_layers)
        heads, trained = ExitHeads(adapter.fingerprint(), layers), False
    heads.to(device=adapter.device, dtype=adapter.dtype)
    data = DataConfig(source=source, text_field=args.text_field, seq_len=args.seq_len, bad_rows=args.bad_rows)
    try:
        heldout = load_rows(data, tokenizer, split=False).heldout
    except ValueError as error:  # the data's own errors name the config key; here it is an option
        message = str(error).replace("set data.bad_rows: skip", "pass --bad_rows skip")
        message = message.replace("set data.loss_on: all to learn every token", "give text rows to score every token")
        raise SystemExit(f"selfspec profile: {message}") from error
    rows_tensor, masks = row_tensors(heldout, range(min(args.max_rows, len(heldout))))  # masks: a chat's answers
    timed = args.timing_context + (args.max_gamma if args.measure_v else 1) + 1  # the tokens `measure` times on
    if rows_tensor.numel() < timed:  # else the context would shrink to what the rows hold, without a word
        raise SystemExit(f"selfspec profile: --timing_context {args.timing_context} needs {timed} held-out tokens to "
                         f"time on; {rows_tensor.shape[0]} row(s) of {args.seq_len} hold {rows_tensor.numel()}: raise "
                         "--max_rows or --seq_len, or lower --timing_context")  # fmt: skip
    config = EvalConfig(
        max_rows=args.max_rows,
        batch_size=args.batch_size,
        timing_context=args.timing_context,
        timing_repeats=args.timing_repeats,
        max_gamma=args.max_gamma,
        measure_v=args.measure_v,
        answer_tokens=args.answer_tokens,
    )
    vocab = None
    if args.draft_vocab or args.draft_quant:
        vocab = adapter.draft_vocabulary(args.draft_vocab, args.draft_quant)  # a JSON file's path, or None
    rows = profile_heads(model, heads, rows_tensor, config, trained=trained, vocab=vocab, masks=masks)
    where = args.data or "the demo target's held-out files"
    print(f"{path}: {rows_tensor.shape[0]} rows of {args.seq_len} tokens from {where}")
    print(format_table(rows))
    plot_alpha(rows, output / "alpha_by_depth.png", f"{Path(path).name}: acceptance rate per draft depth")
    print(f"plot: {output / 'alpha_by_depth.png'}")
    if args.report_to == "wandb":
        configure_wandb("auto")
        run = wandb.init(project=args.project, dir=str(output), config=vars(args))
        run.log(wandb_objects(rows))
        run.summary.update({f"alpha/{row['draft']}": row.get("alpha", row["untrained_alpha"]) for row in rows})
        run.finish()
    return 0


def check_timing_positions(args: argparse.Namespace, limit: int | None) -> None:
    """The timed passes of `selfspec profile` fit the model's `limit` positions (None: no limit): one-token steps
    after --timing_context cached tokens, and with --measure_v a pass over --max_gamma + 1 new positions
    (`selfspec.measure.costs.measure_costs`)."""
    new = args.max_gamma + 1 if args.measure_v else 1
    if limit is not None and args.timing_context + new > limit:
        after = f"--max_gamma {args.max_gamma} + 1 new positions (--measure_v)" if args.measure_v else "one new token"
        fix = f"lower it to {limit - new} or less" if limit > new else "lower --max_gamma"
        raise SystemExit(f"selfspec profile: --timing_context {args.timing_context} does not fit the model's {limit} "
                         f"positions: the timed passes run on the cached context, then {after}: "
                         f"{args.timing_context + new} positions; {fix}")  # fmt: skip


# `selfspec export`: the options each --format takes, and those it needs
EXPORT_OPTIONS = {
    "hf": (),
    "eagle": ("heads", "engine"),
    "eagle3": ("heads", "engine", "draft_vocab"),
    "speculators": ("heads", "draft_vocab", "verifier"),
}
EXPORT_REQUIRED = {"eagle": ("heads",), "eagle3": ("heads",), "speculators": ("heads", "verifier")}


def run_export(args: argparse.Namespace) -> int:
    """`selfspec export`: load the model (and its heads), write the folder."""
    from ..adapter import ModelAdapter
    from ..export import export_eagle, export_target
    from ..heads import load_heads

    given = {name: getattr(args, name) for name in ("heads", "engine", "draft_vocab", "verifier")}
    problems = [f"needs --{name}" for name in EXPORT_REQUIRED.get(args.format, ()) if given[name] is None]
    problems += [f"takes no --{name}" for name, value in given.items()
                 if value is not None and name not in EXPORT_OPTIONS[args.format]]  # fmt: skip
    if problems:
        raise SystemExit(f"selfspec export: --format {args.format} {' and '.join(problems)}")
    output = Path(args.output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())) and not args.overwrite:
        what = "is a file" if not output.is_dir() else "is a folder with files in it"
        raise SystemExit(f"selfspec export: --output {output} {what}; the export replaces it whole: pass "
                         "--overwrite, or name a new folder")  # fmt: skip
    model, tokenizer = load_cli_model(args.model, args.dtype)
    try:  # what the engines cannot load as the head drafts (wrong layout, family, missing --engine) is refused
        if args.format == "hf":
            export_target(model, tokenizer, args.output)
        else:
            heads = load_heads(args.heads, ModelAdapter(model))
            export_eagle(heads, model, args.output, args.format, args.engine, args.draft_vocab, args.verifier)
    except ValueError as error:
        raise SystemExit(f"selfspec export: {error}") from error
    engines = args.engine or "vLLM and SGLang"
    written = {"hf": "the target as a Hugging Face folder", "speculators": "speculators checkpoint for vLLM"}
    print(f"{written.get(args.format, f'{args.format} checkpoint for {engines}')}: {args.output}")
    return 0


TRACEBACK_VARIABLE = "SELFSPEC_TRACEBACK"  # set: a command's errors keep their traceback

# modules the commands import beyond the inference install -> the extra that installs them
EXTRAS = {"matplotlib": "demo", "tqdm": "demo", "yaml": "demo", "datasets": "train", "wandb": "train", "peft": "train"}


def bundled_heldout() -> str:
    """The demo target's held-out files that this Python's standard library has, comma-separated (the list is
    CPython 3.11's; a few of the files are missing in other versions)."""
    from ..training.config import TrainHeadsConfig, load_config
    from ..training.data import expand_globs

    patterns = load_config(TrainHeadsConfig, BUNDLED_CONFIG).data.heldout_files
    files = expand_globs(patterns, required=False)
    if not files:
        raise SystemExit(f"None of the demo target's held-out files ({BUNDLED_CONFIG}) is on this machine: pass --data")
    return ",".join(files)


def architectures_text() -> str:
    """`selfspec architectures`: the supported model types, one a line, the refused ones and the rule."""
    refused = [f"  {name}: {reason}" for name, reason in sorted(REFUSED_ARCHITECTURES.items())]
    return "\n".join(
        ["Supported model types:", *(f"  {name}" for name in sorted(SUPPORTED_ARCHITECTURES)), ""]
        + ["Refused (known to break the rule):", *refused, "", SUPPORT_RULE]
    )


def build_parser() -> argparse.ArgumentParser:
    """The `selfspec` command line: one subcommand per task."""
    parser = argparse.ArgumentParser(prog="selfspec", description="Exact self-speculative decoding for causal LMs.")
    parser.add_argument("--version", action="version", version=f"selfspec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    add_demo_parser(commands)
    add_bench_parser(commands)
    add_tune_parser(commands)
    add_command(commands, "architectures", help="list the supported model types and the rule that decides them")
    add_profile_parser(commands)
    add_export_parser(commands)
    add_bundle_parser(commands)
    add_speed_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "architectures":
        print(architectures_text())
        return 0
    run = {
        "profile": run_profile,
        "demo": run_demo,
        "bench": run_bench_command,
        "tune": run_tune_command,
        "export": run_export,
        "bundle": run_bundle,
        "speed": run_speed,
    }
    try:
        return run[args.command](args)
    except ModuleNotFoundError as error:  # a lean install (inference only) lacks what these commands import
        extra = EXTRAS.get(error.name)
        if extra is None:
            raise
        raise SystemExit(
            f"selfspec {args.command} needs {error.name}, which is in selfspec's [{extra}] extra: "
            f"pip install -e '.[{extra}]' in the repository"
        ) from error
    except (OSError, ValueError) as error:  # mostly a path, a file or a value the user gave: the message names it
        if os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0"):
            raise
        where = traceback.extract_tb(error.__traceback__)[-1]  # where it was raised, should it be a bug
        raise SystemExit(
            f"selfspec {args.command}: {error}\n({type(error).__name__} at {Path(where.filename).name}:{where.lineno}; "
            f"{TRACEBACK_VARIABLE}=1 shows the traceback)"
        ) from error


if __name__ == "__main__":
    sys.exit(main())
