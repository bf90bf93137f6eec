"""The `selfspec` command line's parsers, apart from what the commands run: building them imports neither torch nor
transformers, so `selfspec --help` (and any subcommand's) answers at once. Each command's code is imported when it
runs (`selfspec.cli.main`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..targets import DEFAULT_TARGET, DEMO_TARGET, KNOWN_TARGETS

REPOSITORY = Path(__file__).resolve().parents[2]
BUNDLED = KNOWN_TARGETS[DEFAULT_TARGET].folder  # heads/demo-target
BUNDLED_CONFIG = REPOSITORY / "configs" / "train_heads_demo.yaml"  # lists the demo target's held-out files
THREADS_HELP = (
    "torch CPU threads; 0: torch's default (one per core). One by default: a small model at batch 1 gains little "
    "from more, and on a busy machine threads that wait for a core slow every step down"
)


def counted(least: int):
    """An argparse type: an integer of at least `least` (argparse names the option in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be {least} or more, got {value}")
        return value

    return parse


positive, non_negative = counted(1), counted(0)


def positive_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers of 1 or more, each once ("1,2,4"; one given twice would run or
    report twice under one name)."""
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as 1,2,4, got {text!r}")
    values = [positive(part) for part in parts]
    repeated = next((value for number, value in enumerate(values) if value in values[:number]), None)
    if repeated is not None:
        raise argparse.ArgumentTypeError(f"{repeated} is given twice in {text!r}")
    return values


def merged_tree_shapes(text: str) -> list[tuple[dict, int]]:
    """An argparse type: [(an EAGLE tree, lookup's chain length)] from NODES-TOP_K-DEPTH/LOOKUP_TOKENS, comma-separated
    ("2-2-1/6,6-2-4/10")."""
    usage = "expected NODES-TOP_K-DEPTH/LOOKUP_TOKENS such as 2-2-1/6, comma-separated"
    shapes = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        try:
            tree, lookup = item.split("/")
            nodes, top_k, depth, lookup = (*(int(value) for value in tree.split("-")), int(lookup))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{usage}; got {item!r}") from None
        if min(nodes, top_k, depth, lookup) < 1:
            raise argparse.ArgumentTypeError(f"every number of {item!r} must be 1 or more")
        shape = ({"nodes": nodes, "top_k": top_k, "depth": depth}, lookup)
        if shape in shapes:
            raise argparse.ArgumentTypeError(f"{item!r} is given twice in {text!r}")
        shapes.append(shape)
    if not shapes:
        raise argparse.ArgumentTypeError(f"{usage}; got {text!r}")
    return shapes


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where it has none or the help text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False) or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


# targets that run in bfloat16 where the machine multiplies it natively (`selfspec.hardware`), in float32 elsewhere;
# every other target runs in float32 unless --dtype says otherwise (the toy target's checks are token for token)
HALF_PRECISION_TARGETS = {DEMO_TARGET}
BENCH_TEMPERATURE = 0.8  # selfspec bench's sampling contenders, when --temperature is not given
BENCH_SEED = 0  # selfspec bench's sampled runs, when --seed is not given
BENCH_WARMUP = 3  # selfspec bench --workload repeated: untimed calls per task, when --warmup is not given
PROFILE_PROJECT = "selfspec-profile"  # selfspec profile --report_to wandb: the W&B project, when --project is not given

TARGET_CHOICES = f"a known target ({', '.join(KNOWN_TARGETS)}), a model folder or a hub name"


def add_command(commands, name: str, help: str, **options) -> argparse.ArgumentParser:
    """A subcommand whose one-line help (in `selfspec --help`) is also its description (in `selfspec NAME --help`)."""
    return commands.add_parser(name, help=help, description=help, **options)


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
    parser.add_argument("--max_new_tokens", type=positive, default=128, help="tokens generated per prompt")
    parser.add_argument(
        "--dtype",
        help="float32 | bfloat16 | float16 | auto (default: for "
        f"{', '.join(sorted(HALF_PRECISION_TARGETS))}, bfloat16 on a GPU or a CPU with native bf16 (avx512_bf16, "
        "amx_bf16) and float32 on other CPUs, where bf16 passes over several positions cost several steps and "
        "speculation loses; float32 for other targets). In half precision the greedy check allows ties of the top-2 "
        "scores (selfspec.measure.ties); in float32 it is token for token",
    )
    parser.add_argument("--device", help="cpu or cuda (default: cuda where torch sees one, else cpu)")
    parser.add_argument("--num_threads", type=non_negative, default=1, help=THREADS_HELP)
    parser.add_argument(
        "--draft_vocab",
        help="a JSON file with a list of token ids for reduced-vocabulary drafts (default: the model's "
        "draft_vocab.json if it has one; 'none' for full-vocabulary drafts only)",
    )


def add_demo_parser(commands) -> None:
    demo = add_command(
        commands,
        "demo",
        help=f"answer a few chat prompts with {DEMO_TARGET}, plainly and with selfspec's best modes for it "
        "(--model demo: held-out code prompts with the bundled toy target)",
        formatter_class=HelpFormatter,
    )
    add_model_arguments(demo, bundled=True, demo=True)
    demo.add_argument("--num_prompts", type=positive, default=3, help="prompts to complete")
    demo.add_argument("--output", default="runs/demo", help="folder for alpha_by_depth.png")


def add_bench_parser(commands) -> None:
    bench = add_command(
        commands,
        "bench",
        help="tokens/s of selfspec's modes against model.generate and its peers",
        formatter_class=HelpFormatter,
    )
    add_model_arguments(bench, bundled=True)
    bench.add_argument(
        "--output",
        default="runs/bench",
        help="folder for bench.json, bench.md and bench.png (bench_batch.json and bench_batch.md with --batch_sizes)",
    )
    bench.add_argument("--num_prompts", type=positive, help="prompts used (the first N; default: all)")
    bench.add_argument(
        "--limit_per_category",
        type=positive,
        help="Spec-Bench prompts: the first N of each category (MT-bench's eight count as one), for a quick run",
    )
    bench.add_argument("--repeats", type=positive, default=2, help="runs per prompt and contender (medians reported)")
    bench.add_argument(
        "--temperature",
        type=positive_float,
        help=f"temperature of the sampling contenders (default {BENCH_TEMPERATURE}; the Spec-Bench runs only)",
    )
    bench.add_argument("--no_sampling", action="store_true", help="greedy contenders only")
    bench.add_argument("--no_transformers", action="store_true", help="leave out transformers' assisted modes")
    bench.add_argument(
        "--assistant_exit_layers", type=positive_list, help="transformers early-exit layers to try, e.g. 3,6"
    )
    bench.add_argument("--seed", type=int, help=f"seed of the sampled runs (default {BENCH_SEED})")
    bench.add_argument("--untrained_exit_layer", type=positive, help="depth of the untrained-exit contender")
    bench.add_argument(
        "--compile",
        action="store_true",
        help="also run compiled: model.generate with transformers' static cache and torch.compile, and selfspec's "
        "chains with compile=True (each compiles on its first calls, untimed)",
    )
    bench.add_argument(
        "--only",
        help="keep contenders whose name contains one of these (comma-separated), as the table prints it: "
        "'(fixed)' keeps --fixed_trees' variants alone; text that occurs whole in a name, commas and all, is not split",
    )
    bench.add_argument(
        "--chains",
        type=positive_list,
        help="also run the EAGLE head's greedy chains at these fixed lengths, e.g. 1,2,3,4,5 (the adaptive "
        "controller off): tokens per pass and acceptance by position, which do not depend on the machine",
    )
    bench.add_argument(
        "--merged_trees",
        type=merged_tree_shapes,
        help="also run n-gram lookup merged into the EAGLE head's dynamic trees of these shapes, "
        "NODES-TOP_K-DEPTH/LOOKUP_TOKENS, comma-separated, e.g. 2-2-1/6,6-2-4/10 (one verify pass per tree)",
    )
    bench.add_argument(
        "--fixed_trees",
        action="store_true",
        help="also run each tree contender with adaptive=False, named '... (fixed)': a tree verified every "
        "iteration, beside the default that takes plain steps where trees do not pay",
    )
    bench.add_argument(
        "--unpacked",
        action="store_true",
        help="also run each selfspec contender that multiplies passes over several positions with packed weights "
        "(the default for float32 targets on x86 CPUs) without them, named '... (unpacked)'",
    )
    bench.add_argument(
        "--static_vocab",
        action="store_true",
        help="also run each selfspec contender with a draft vocabulary again without the call's own tokens joining "
        "it (draft_vocab_context=False, as engines with a fixed draft vocabulary draft), named '... (static vocab)'",
    )
    bench.add_argument(
        "--suffix_memory",
        help="also run suffix drafting (alone, and before an EAGLE head where there is one) that remembers the "
        "assistant turns of this chat data set (.jsonl or .jsonl.gz rows with `messages`, e.g. the model's own "
        "answers: training/data/smollm2-chat/train.jsonl.gz) before the first prompt; with --merged_trees, also its "
        "chain of LOOKUP_TOKENS merged into each of those trees, alone and beside n-gram lookup's",
    )
    bench.add_argument(
        "--suffix_memory_tokens",
        type=positive,
        help="--suffix_memory: stop reading after the row whose answers reach this many tokens (default: all)",
    )
    bench.add_argument(
        "--workload",
        choices=["prompts", "repeated"],
        default="prompts",
        help="prompts: the --prompts (Spec-Bench questions by category, or plain prompts); repeated: the same task "
        "over many standard-library functions and two-turn revisions, after --warmup untimed calls per task "
        "(selfspec.workload; needs a chat model), greedy",
    )
    bench.add_argument(
        "--warmup",
        type=non_negative,
        help=f"--workload repeated: untimed functions per task (default {BENCH_WARMUP})",
    )
    bench.add_argument(
        "--batch_sizes",
        type=positive_list,
        help="instead: batched throughput at these batch sizes, e.g. 1,2,4,8,16 (greedy, chain)",
    )


def add_tune_parser(commands) -> None:
    tune = add_command(
        commands,
        "tune",
        help="pick exit layer, gamma and tree from measured alpha, c and v; write them into the heads",
        formatter_class=HelpFormatter,
    )
    add_model_arguments(tune, bundled=True)
    tune.add_argument("--num_prompts", type=positive, default=4, help="prompts used (the first N)")
    tune.add_argument("--max_gamma", type=positive, default=8, help="largest gamma considered for early exit")
    tune.add_argument("--do_sample", action="store_true", help="tune for sampling (default: greedy)")
    tune.add_argument("--timing_repeats", type=positive, default=20, help="timed repetitions of c and v (median)")
    tune.add_argument("--measure_grid", action="store_true", help="also time the candidates against model.generate")
    tune.add_argument("--dry_run", action="store_true", help="print the choice without writing it into the heads")
    tune.add_argument("--batch_sizes", type=positive_list, default="1",
                      help="batch sizes to fit the position cost r at, comma-separated (e.g. 1,4,16,64: those you "
                      "generate with); one r per size, interpolated between them")  # fmt: skip


def add_profile_parser(commands) -> None:
    profile = add_command(
        commands,
        "profile",
        help="held-out alpha per exit depth (untrained exit and trained heads), measured c, predicted speedup",
        formatter_class=HelpFormatter,
    )
    profile.add_argument(
        "--model",
        help=f"the target: {TARGET_CHOICES} (default: the bundled toy target demo, {BUNDLED}; selfspec demo "
        f"defaults to {DEMO_TARGET})",
    )
    profile.add_argument(
        "--heads",
        help="a trained heads folder for the model (default: the demo target's exit heads without --model and "
        "--exit_layers, else none: the untrained exit only)",
    )
    profile.add_argument(
        "--data",
        help="held-out text: comma-separated file globs or a folder (default without --model: the demo target's "
        "held-out files, as configs/train_heads_demo.yaml lists them)",
    )
    profile.add_argument(
        "--exit_layers", type=positive_list, help="without --heads: exit depths to profile, e.g. 2,4,6 (default spread)"
    )
    profile.add_argument("--text_field", default="text", help="jsonl / parquet text column")
    profile.add_argument(
        "--bad_rows",
        default="stop",
        choices=["stop", "skip"],
        help="rows without usable text: stop, naming the first, or skip them",
    )
    profile.add_argument("--seq_len", type=positive, default=256, help="tokens per evaluated row")
    profile.add_argument("--max_rows", type=positive, default=64, help="rows evaluated")
    profile.add_argument("--batch_size", type=positive, default=8, help="rows per forward")
    profile.add_argument(
        "--timing_context", type=positive, default=64, help="cached tokens while timing one-token steps"
    )
    profile.add_argument("--timing_repeats", type=positive, default=20, help="timed repetitions (median)")
    profile.add_argument("--max_gamma", type=positive, default=8, help="largest gamma for the predicted speedup")
    profile.add_argument("--measure_v", action="store_true", help="measure v(gamma) instead of assuming 1")
    profile.add_argument(
        "--answer_tokens", type=non_negative, default=128,
        help="chat data: also score the first N tokens of each answer alone, where a benchmark of N new tokens "
        "drafts; 0: not",
    )  # fmt: skip
    profile.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | auto")
    profile.add_argument("--num_threads", type=non_negative, default=1, help=THREADS_HELP + " (and skew the timed c)")
    profile.add_argument("--output", default="runs/profile", help="folder for alpha_by_depth.png")
    profile.add_argument("--draft_vocab", help="a JSON file of token ids: also profile drafts from these rows only")
    profile.add_argument("--draft_quant", choices=["int8"], help="also profile drafts through an int8 LM head")
    profile.add_argument("--report_to", default="none", choices=["none", "wandb"], help="also log a W&B run")
    profile.add_argument("--project", help=f"--report_to wandb: the W&B project (default {PROFILE_PROJECT})")


def add_export_parser(commands) -> None:
    export = add_command(
        commands,
        "export",
        help="write the target as a Hugging Face folder (--format hf), or an EAGLE heads folder as a vLLM / SGLang "
        "EAGLE draft checkpoint (Llama targets)",
        formatter_class=HelpFormatter,
    )
    export.add_argument("--model", required=True, help=f"the target: {TARGET_CHOICES}")
    export.add_argument(
        "--format",
        required=True,
        choices=["hf", "eagle", "eagle3", "speculators"],
        help="hf: the target's weights (dequantized from GGUF), config, generation config and tokenizer; eagle / "
        "eagle3: an EAGLE-1 / EAGLE-3 draft checkpoint; speculators: the EAGLE-3 checkpoint in vLLM's speculators "
        "format, naming --verifier, so that `vllm serve OUTPUT` serves target and draft",
    )
    export.add_argument("--heads", help="eagle, eagle3, speculators: a trained EAGLE heads folder for the model")
    export.add_argument(
        "--engine",
        choices=["vllm", "sglang"],
        help="eagle, eagle3: the engine whose names and aux layer ids to write (required for eagle, and for eagle3 "
        "heads on other layers than EAGLE's default)",
    )
    export.add_argument("--draft_vocab", help="eagle3, speculators: a JSON file of token ids the draft's LM head keeps")
    export.add_argument(
        "--verifier",
        help="speculators: the target vLLM serves, its folder (written by --format hf) or a hub name",
    )
    export.add_argument(
        "--dtype",
        default="auto",
        help="the weights' dtype: float32 | bfloat16 | float16 | auto (default: auto, the checkpoint's own; float32 "
        "for a GGUF file such as smollm2-135m-instruct's)",
    )
    export.add_argument("--output", required=True, help="the folder to write")
    export.add_argument(
        "--overwrite", action="store_true", help="replace --output where it exists, everything in it included"
    )
