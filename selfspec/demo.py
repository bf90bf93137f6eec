"""`selfspec demo`, `selfspec bench` and `selfspec tune`: load a target and its heads, run, report.

The demo answers a few chat prompts with SmolLM2-135M-Instruct (`smollm2-135m-instruct`, the `[smollm2]` extra)
in bfloat16: plain `model.generate`, then selfspec's best modes for it (the bundled EAGLE head's chain with the
draft vocabulary, n-gram lookup, and their hybrid). It prints the completions and tokens/s, speedup and tokens per
target pass, and checks the greedy outputs against `model.generate`'s: in bfloat16 up to ties of its top-2 scores
(`selfspec.ties`), in float32 token for token. `--model demo` runs the bundled toy target instead (heads/demo-target,
trained by this project) on held-out code prompts, with every kind of its heads and alpha per exit depth (also as a
PNG). `bench` and `tune` take the same model arguments and run on the toy target without --model (see
`selfspec.bench` and `selfspec.tune` for what they measure).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import torch

from .adapter import read_token_ids
from .bench import (
    COLUMNS,
    Contender,
    eagle_contenders,
    generate_contender,
    markdown_table,
    plot_speedups,
    run_bench,
    selfspec_contender,
    standard_contenders,
    tree_for,
    write_json,
)
from .heads import DraftHeads, EagleHeads, ExitHeads, MedusaHeads, load_heads
from .specbench import (
    ChatPrompt,
    categories_of,
    category_report,
    first_per_category,
    read_prompts,
    summarize_by_category,
)
from .speculative import SelfSpeculative
from .targets import (
    DEFAULT_TARGET,
    DEMO_TARGET,
    KNOWN_TARGETS,
    TargetError,
    default_heads,
    load_model,
    target_folder,
)
from .ties import TIE, TIE_STEPS

REPOSITORY = Path(__file__).resolve().parent.parent
BUNDLED = KNOWN_TARGETS[DEFAULT_TARGET].folder  # heads/demo-target
BUNDLED_CONFIG = REPOSITORY / "configs" / "train_heads_demo.yaml"  # lists the demo target's held-out files
DEMO_COLUMNS = ["contender", "tokens_per_s", "speedup", "matched", "alpha_hat", "tokens_per_pass"]
THREADS_HELP = (
    "torch CPU threads; 0: torch's default (one per core). One by default: a small model at batch 1 gains little "
    "from more, and on a busy machine threads that wait for a core slow every step down"
)
# How the demo runs SmolLM2-135M-Instruct (other targets: float32 and every mode their heads allow). bfloat16: on a
# CPU its decoding is bound by reading the weights, so a verify pass over a few positions costs about one step.
# Its best modes only: each mode costs a run of a 135M model, and the demo is to stay under about 3 minutes.
DEMO_DTYPES = {DEMO_TARGET: "bfloat16"}
BEST_MODES_ONLY = {DEMO_TARGET}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where it has none or the help text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False) or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


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
    `demo`: for DEMO_TARGET instead, and --dtype defaults to the target's demo dtype (`demo_dtype`)."""
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
    if demo:
        parser.add_argument(
            "--dtype",
            help=f"float32 | bfloat16 | float16 | auto (default: bfloat16 for {DEMO_TARGET}, where the greedy check "
            "allows ties of the top-2 scores, selfspec.ties; float32, token for token, for other targets)",
        )
    else:
        parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 | auto")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    parser.add_argument("--num_threads", type=int, default=1, help=THREADS_HELP)
    parser.add_argument(
        "--draft_vocab",
        help="a JSON file with a list of token ids for reduced-vocabulary drafts (default: the model's "
        "draft_vocab.json if it has one; 'none' for full-vocabulary drafts only)",
    )


def load_target(args: argparse.Namespace):
    """(model, tokenizer, heads by kind, prompt strings, draft vocabulary or None) from the command line."""
    from .adapter import ModelAdapter

    set_threads(args.num_threads)
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
    if not prompts_path.exists():
        raise SystemExit(f"No prompts: {prompts_path} does not exist; pass --prompts FILE (.json or .jsonl)")
    vocab_path = Path(args.draft_vocab) if args.draft_vocab not in (None, "none") else Path(path) / "draft_vocab.json"
    if args.draft_vocab is not None and args.draft_vocab != "none" and not vocab_path.exists():
        raise SystemExit(f"--draft_vocab: {vocab_path} does not exist")
    use_vocab = args.draft_vocab != "none" and vocab_path.exists()
    vocab = read_token_ids(vocab_path) if use_vocab else None
    return model, tokenizer, heads, read_prompts(prompts_path, tokenizer), vocab


def default_prompts(folder: Path) -> Path:
    """A target folder's prompts: `prompts.jsonl` (chat questions, rendered with the chat template) if it has one,
    else `prompts.json` (plain strings)."""
    chat = folder / "prompts.jsonl"
    return chat if chat.exists() else folder / "prompts.json"


def encode(tokenizer, prompts: list[str], device) -> list[torch.Tensor]:
    # a chat prompt holds its template's special tokens already
    return [tokenizer(prompt, return_tensors="pt", add_special_tokens=not isinstance(prompt, ChatPrompt))
            .input_ids.to(device) for prompt in prompts]  # fmt: skip


def demo_dtype(model: str) -> str:
    """The dtype the demo runs `model` in without --dtype: `DEMO_DTYPES`'s, else float32."""
    return DEMO_DTYPES.get(model, "float32")


def demo_contenders(model, heads: dict, vocab: list[int] | None, best_only: bool = False) -> list[Contender]:
    """model.generate, then selfspec (reduced-vocabulary drafts where `vocab` is given). `best_only`: the best
    modes (`best_contenders`); else the full field: the trained exit heads (the untrained exit without them),
    Medusa chain and tree, the EAGLE head's modes, n-gram lookup, and lookup with the Medusa heads where it has
    no match."""
    if best_only:
        return best_contenders(model, heads, vocab)
    exit_heads, medusa = heads.get(ExitHeads), heads.get(MedusaHeads)
    suffix = f", vocab {len(vocab)}" if vocab else ""
    contenders = [generate_contender(model, "model.generate", False, 1.0)]
    if exit_heads is not None:
        layer = exit_heads.default_exit_layer  # the tuned depth, if `selfspec tune` wrote one
        contenders.append(selfspec_contender(model, f"selfspec exit {layer} trained{suffix}", False, 1.0,
                                             heads=exit_heads, exit_layer=layer, draft_vocab=vocab))  # fmt: skip
    else:
        contenders.append(selfspec_contender(model, f"selfspec exit untrained{suffix}", False, 1.0, draft_vocab=vocab))
    if medusa is not None:
        for mode, tree in (("chain", []), ("tree", tree_for(medusa))):
            contenders.append(selfspec_contender(model, f"selfspec medusa {mode}{suffix}", False, 1.0,
                                                 heads=medusa, tree=tree, draft_vocab=vocab))  # fmt: skip
    eagle = heads.get(EagleHeads)
    if eagle is not None:
        contenders += eagle_contenders(model, eagle, vocab, None, {})
    contenders.append(selfspec_contender(model, "selfspec ngram", False, 1.0, drafter="ngram"))
    if medusa is not None:
        contenders.append(selfspec_contender(model, f"selfspec hybrid ngram + medusa chain{suffix}", False, 1.0,
                                             drafter="hybrid", heads=medusa, tree=[], draft_vocab=vocab))  # fmt: skip
    return contenders


def best_contenders(model, heads: dict, vocab: list[int] | None) -> list[Contender]:
    """model.generate, then the chain of each kind of heads loaded (the trained exit at its tuned depth, the Medusa
    chain, the EAGLE chain) with the draft vocabulary `vocab`, n-gram lookup, and its hybrid with each kind."""
    chains = []
    if ExitHeads in heads:
        layer = heads[ExitHeads].default_exit_layer
        chains.append((f"exit {layer} trained", {"heads": heads[ExitHeads], "exit_layer": layer}))
    if MedusaHeads in heads:
        chains.append(("medusa chain", {"heads": heads[MedusaHeads], "tree": []}))
    if EagleHeads in heads:
        chains.append(("eagle", {"heads": heads[EagleHeads]}))
    suffix = f", vocab {len(vocab)}" if vocab else ""
    contenders = [generate_contender(model, "model.generate", False, 1.0)]
    contenders += [selfspec_contender(model, f"selfspec {name}{suffix}", False, 1.0, draft_vocab=vocab, **options)
                   for name, options in chains]  # fmt: skip
    contenders.append(selfspec_contender(model, "selfspec ngram", False, 1.0, drafter="ngram"))
    contenders += [selfspec_contender(model, f"selfspec hybrid ngram + {name}{suffix}", False, 1.0, drafter="hybrid",
                                      draft_vocab=vocab, **options) for name, options in chains]  # fmt: skip
    return contenders


def alpha_by_depth(model, heads: ExitHeads, sequences: list[torch.Tensor]) -> list[dict]:
    """Analytic alpha per exit depth, untrained exit next to trained heads, on the given token sequences."""
    from .adapter import ModelAdapter
    from .profile import evaluate, report_rows, untrained_like

    adapter = ModelAdapter(model)
    length = min(s.shape[-1] for s in sequences)
    rows = torch.cat([s[..., :length].reshape(1, -1) for s in sequences])
    scores = evaluate(model, adapter, {"untrained": untrained_like(heads), "trained": heads}, rows, batch_size=4)
    return report_rows(heads, scores["untrained"], scores["trained"], None, max_gamma=0)


def demo_legend(vocab_size: int | None, ties: bool = False) -> str:
    """What the demo table's columns mean; `ties`: half precision, where "tie (n)" may show."""
    legend = [
        "tokens/s: new tokens per second; speedup: over model.generate in this run; greedy match: the same tokens",
        "as model.generate; alpha_hat: drafts accepted / drafts proposed; tokens/pass: new tokens per full-model",
        "pass (1.00 for plain decoding; each pass verifies the drafts and adds one token of its own).",
    ]
    if ties:
        legend.append("tie (n): the same tokens up to a tie on n prompts (see the greedy check below).")
    if vocab_size:
        legend += [
            f"vocab {vocab_size}: the drafts choose among {vocab_size} tokens only (a draft vocabulary: the target's "
            "most",
            "frequent tokens in its data); verification uses the whole vocabulary, so the output stays exact.",
        ]
    return "\n".join(legend)


DEPTH_LEGEND = (
    "alpha: mean over positions of sum_x min(p(x), q(x)), p the model's next-token distribution and q the draft's:\n"
    "the chance that a sampled draft is accepted. top-1: how often the draft's most likely token is the model's:\n"
    "the chance that a greedy draft is accepted. KL: KL(p || q)."
)


def greedy_check(contenders: list[Contender], dtype: torch.dtype) -> tuple[list[str], list[str]]:
    """The demo's greedy check over the selfspec contenders' runs: (report lines: the rule applied, each mode's
    count of prompts identical to model.generate and left at a tie, the verdict; failures: one line per mode whose
    output left model.generate's other than at a tie). The verdicts are `run_bench`'s, by
    `selfspec.ties.compare_greedy`: in float32 identical tokens, in half precision identical up to a tie."""
    name = str(dtype).removeprefix("torch.")
    if dtype == torch.float32:
        rule = f"Greedy check ({name}): each output must equal model.generate's, token for token."
        elsewhere = "differs from model.generate's output"
    else:
        rule = (f"Greedy check ({name}, the tie rule of selfspec.ties): each output must equal model.generate's up "
                f"to the first position where model.generate's top-2 scores are within {TIE_STEPS} {name} rounding "
                "steps of each other, and take one of those tokens there (a pass over several positions rounds "
                "differently from a one-token step).")  # fmt: skip
        elsewhere = "left model.generate's output other than at a tie"
    lines = textwrap.wrap(rule, width=112)
    failures, identical, tied, total = [], 0, 0, 0
    for contender in contenders:
        if contender.baseline or contender.sampling:
            continue
        verdicts = contender.matched
        same, ties = sum(verdict is True for verdict in verdicts), sum(verdict == TIE for verdict in verdicts)
        wrong = [contender.prompt_indices[i] + 1 for i, verdict in enumerate(verdicts) if verdict is False]
        line = f"  {contender.name}: {same} of {len(verdicts)} prompts identical"
        line += f", {ties} left it at a tie" if ties else ""
        line += f", {len(wrong)} NOT at a tie" if wrong and dtype != torch.float32 else ""
        lines.append(line)
        if wrong:
            failures.append(f"GREEDY CHECK FAILED: {contender.name} {elsewhere} on prompt(s) "
                            f"{', '.join(map(str, wrong))}: this is a bug in selfspec, please report it.")  # fmt: skip
        identical, tied, total = identical + same, tied + ties, total + len(verdicts)
    if failures:
        lines.append("Greedy outputs identical to model.generate: NO (see the failures below).")
    elif tied:
        lines.append(f"Greedy outputs identical to model.generate up to ties: yes: {identical} of {total} outputs "
                     f"identical, {tied} left it at a tie, none anywhere else.")  # fmt: skip
    else:
        lines.append("Greedy outputs identical to model.generate: yes, for every prompt and mode.")
    return lines, failures


def run_demo(args: argparse.Namespace) -> int:
    from .profile import format_table, plot_alpha

    check_plotting()
    args.dtype = args.dtype or demo_dtype(args.model)
    model, tokenizer, heads, prompts, vocab = load_target(args)
    prompts = prompts[: args.num_prompts]
    inputs = encode(tokenizer, prompts, model.device)
    contenders = demo_contenders(model, heads, vocab, best_only=args.model in BEST_MODES_ONLY)
    dtype = str(model.dtype).removeprefix("torch.")
    print(f"{args.model}: {len(prompts)} prompts, {args.max_new_tokens} new tokens each, greedy, {dtype}")
    rows = run_bench(contenders, inputs, args.max_new_tokens, repeats=1)
    outputs = contenders[0].outputs  # model.generate's, prompt by prompt
    for prompt, ids, output in zip(prompts, inputs, outputs, strict=True):
        tail = "\n".join(prompt.rstrip("\n").splitlines()[-4:])
        completion = tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)
        print(f"\n----- prompt (last lines) -----\n{tail}\n----- completion -----\n{completion}")
    print("\n" + markdown_table(rows, [c for c in COLUMNS if c[0] in DEMO_COLUMNS]))
    print(demo_legend(len(vocab) if vocab else None, ties=model.dtype != torch.float32))
    report, failures = greedy_check(contenders, model.dtype)
    print("\n" + "\n".join(report))
    if ExitHeads in heads:
        output_dir = Path(args.output)
        output_dir.mkdir(parents=True, exist_ok=True)
        depth_rows = alpha_by_depth(model, heads[ExitHeads], outputs)
        print("\nalpha per exit depth on these prompts and completions:\n" + format_table(depth_rows))
        print(DEPTH_LEGEND)
        plot_alpha(depth_rows, output_dir / "alpha_by_depth.png", "demo target: acceptance rate per exit depth")
        print(f"plot: {output_dir / 'alpha_by_depth.png'}")
    if failures:
        sys.stdout.flush()  # the failures come last, also where stdout and stderr go to one terminal
        print("\n".join(failures), file=sys.stderr)
        return 1
    return 0


def run_bench_command(args: argparse.Namespace) -> int:
    import platform

    import transformers

    if not args.batch_sizes:
        check_plotting()
    model, tokenizer, heads, prompts, vocab = load_target(args)
    if args.limit_per_category is not None:
        try:
            prompts = first_per_category(prompts, args.limit_per_category)
        except ValueError as error:
            raise SystemExit(f"--limit_per_category: {error}") from error
    prompts = prompts[: args.num_prompts]
    inputs = encode(tokenizer, prompts, model.device)
    if args.batch_sizes:
        return run_batch_bench(args, model, heads, inputs, vocab)
    layers = [int(x) for x in args.assistant_exit_layers.split(",")] if args.assistant_exit_layers else None
    contenders = standard_contenders(
        model,
        heads.get(ExitHeads),
        heads.get(MedusaHeads),
        assistant_exit_layers=layers,
        temperature=args.temperature,
        sampling=not args.no_sampling,
        transformers_modes=not args.no_transformers,
        draft_vocab=vocab,
        untrained_exit_layer=args.untrained_exit_layer,
        eagle_heads=heads.get(EagleHeads),
    )
    if args.only:
        wanted = [part.strip() for part in args.only.split(",") if part.strip()]
        contenders = [c for c in contenders if c.baseline or any(part in c.name for part in wanted)]
    rows = run_bench(contenders, inputs, args.max_new_tokens, repeats=args.repeats, seed=args.seed)
    by_category = summarize_by_category(contenders, prompts) if categories_of(prompts) else None  # Spec-Bench
    table = category_report(by_category, prompts) if by_category else markdown_table(rows)
    print(table)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "selfspec " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("selfspec") else None,
        "model": str(args.model or BUNDLED),
        "heads": [str(h) for h in args.heads or []],
        "draft_vocab": len(vocab) if vocab else None,
        "prompts": len(inputs),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "device": str(model.device),
        "dtype": str(model.dtype),
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    write_json(rows, output / "bench.json", meta)
    if by_category:
        flat = [{"category": category, **row} for category, summaries in by_category.items() for row in summaries]
        write_json(flat, output / "bench_by_category.json", meta)
    (output / "bench.md").write_text(table + "\n", encoding="utf-8")
    plot_speedups(rows, output / "bench.png", f"{Path(str(args.model or BUNDLED)).name} on {meta['device']}")
    names = ["bench.json", *(["bench_by_category.json"] if by_category else []), "bench.md", "bench.png"]
    print("wrote " + ", ".join(str(output / name) for name in names))
    mismatched = [row["contender"] for row in rows if row["matched"] is False]
    if mismatched:
        print(f"GREEDY OUTPUT DIFFERS from model.generate: {', '.join(mismatched)}", file=sys.stderr)
        return 1
    return 0


def add_demo_parser(commands) -> None:
    demo = commands.add_parser(
        "demo",
        help=f"answer a few chat prompts with {DEMO_TARGET}, plainly and with selfspec's best modes for it "
        "(--model demo: held-out code prompts with the bundled toy target)",
        formatter_class=HelpFormatter,
    )
    add_model_arguments(demo, bundled=True, demo=True)
    demo.add_argument("--num_prompts", type=int, default=3, help="prompts to complete")
    demo.add_argument("--output", default="runs/demo", help="folder for alpha_by_depth.png")


def add_bench_parser(commands) -> None:
    bench = commands.add_parser(
        "bench", help="tokens/s of selfspec's modes against model.generate and its peers", formatter_class=HelpFormatter
    )
    add_model_arguments(bench, bundled=True)
    bench.add_argument(
        "--output",
        default="runs/bench",
        help="folder for bench.json, bench.md and bench.png (bench_batch.json and bench_batch.md with --batch_sizes)",
    )
    bench.add_argument("--num_prompts", type=int, help="prompts used (the first N; default: all)")
    bench.add_argument(
        "--limit_per_category",
        type=int,
        help="Spec-Bench prompts: the first N of each category (MT-bench's eight count as one), for a quick run",
    )
    bench.add_argument("--repeats", type=int, default=2, help="runs per prompt and contender (medians reported)")
    bench.add_argument("--temperature", type=float, default=0.8, help="temperature of the sampling contenders")
    bench.add_argument("--no_sampling", action="store_true", help="greedy contenders only")
    bench.add_argument("--no_transformers", action="store_true", help="leave out transformers' assisted modes")
    bench.add_argument("--assistant_exit_layers", help="transformers early-exit layers to try, e.g. 3,6")
    bench.add_argument("--seed", type=int, default=0, help="seed of the sampled runs")
    bench.add_argument("--untrained_exit_layer", type=int, help="depth of the untrained-exit contender")
    bench.add_argument("--only", help="keep contenders whose name contains one of these (comma-separated)")
    bench.add_argument(
        "--batch_sizes", help="instead: batched throughput at these batch sizes, e.g. 1,2,4,8,16 (greedy, chain)"
    )


def run_batch_bench(args: argparse.Namespace, model, heads: dict, inputs, vocab) -> int:
    """`selfspec bench --batch_sizes`: batched model.generate against selfspec's best chain drafter, adaptive."""
    from .bench import batch_table, batch_throughput

    medusa, exit_heads = heads.get(MedusaHeads), heads.get(ExitHeads)
    if medusa is not None:
        spec, label = SelfSpeculative(model, heads=medusa, tree=[], draft_vocab=vocab), "Medusa chain"
    else:
        spec, label = SelfSpeculative(model, heads=exit_heads, draft_vocab=vocab), "exit layer"
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    rows = batch_throughput(spec, inputs, sizes, args.max_new_tokens, repeats=args.repeats)
    table = batch_table(rows)
    print(f"selfspec: {label}{', draft vocabulary ' + str(len(vocab)) if vocab else ''}, adaptive gamma\n{table}")
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "bench_batch.md").write_text(table + "\n", encoding="utf-8")
    write_json(rows, output / "bench_batch.json", {"mode": label, "max_new_tokens": args.max_new_tokens})
    return 0 if all(row["matched"] for row in rows) else 1


def add_tune_parser(commands) -> None:
    tune = commands.add_parser(
        "tune",
        help="pick exit layer, gamma and tree from measured alpha, c and v; write them into the heads",
        formatter_class=HelpFormatter,
    )
    add_model_arguments(tune, bundled=True)
    tune.add_argument("--num_prompts", type=int, default=4, help="prompts used (the first N)")
    tune.add_argument("--max_gamma", type=int, default=8, help="largest gamma considered for early exit")
    tune.add_argument("--do_sample", action="store_true", help="tune for sampling (default: greedy)")
    tune.add_argument("--timing_repeats", type=int, default=20, help="timed repetitions of c and v (median)")
    tune.add_argument("--measure_grid", action="store_true", help="also time the candidates against model.generate")
    tune.add_argument("--dry_run", action="store_true", help="print the choice without writing it into the heads")
    tune.add_argument("--batch_sizes", default="1",
                      help="batch sizes to fit the position cost r at, comma-separated (e.g. 1,4,16,64: those you "
                      "generate with); one r per size, interpolated between them")  # fmt: skip


def run_tune_command(args: argparse.Namespace) -> int:
    from .heads import CARD_NAME
    from .tune import apply_choice, format_choices, tune, tuned_card

    model, tokenizer, heads, prompts, vocab = load_target(args)
    if not heads:
        raise SystemExit("selfspec tune needs trained heads: pass --heads PATH")
    inputs = encode(tokenizer, prompts[: args.num_prompts], model.device)
    batch_sizes = tuple(int(size) for size in args.batch_sizes.split(","))
    paths = args.heads or default_heads(args.model or DEFAULT_TARGET)
    for path, draft_heads in zip(paths, heads.values(), strict=True):
        choices, position_cost = tune(model, draft_heads, inputs, args.max_new_tokens, args.max_gamma, args.do_sample,
                       args.timing_repeats, vocab, batch_sizes)  # fmt: skip
        measured = (
            measure_grid(model, draft_heads, choices, inputs, args.max_new_tokens, vocab) if args.measure_grid else None
        )
        table = format_choices(choices, measured)
        best = choices[0]
        print(f"\n{path}:\n{table}\n\nchoice: {best.label}, predicted speedup {best.predicted:.2f}x")
        per_size = position_cost if isinstance(position_cost, dict) else {1: position_cost}
        costs = ", ".join(f"{r:.3f} at {rows} row(s)" for rows, r in per_size.items())
        print(f"position cost r = {costs} (v(gamma, rows) = (1 + r rows (gamma+1)) / (1 + r rows))")
        if measured:
            top = max(measured.values())
            print(f"measured: the choice {measured[best.label]:.2f}x, the best candidate {top:.2f}x "
                  f"({measured[best.label] / top:.1%} of it)")  # fmt: skip
        if best.predicted <= 1.0:
            print("no configuration is predicted to beat plain decoding here; adaptive drafting will fall back to it")
        if not args.dry_run:
            apply_choice(draft_heads, best, position_cost)
            card_path = Path(path) / CARD_NAME
            card = card_path.read_text(encoding="utf-8") if card_path.exists() else ""
            command = "selfspec " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("selfspec") else "selfspec tune"
            draft_heads.save_pretrained(path, card=tuned_card(card, table, best, command))
            print(f"wrote the defaults into {Path(path) / 'config.json'}")
    return 0


def measure_grid(model, heads, choices, inputs, max_new_tokens: int, vocab) -> dict[str, float]:
    """Realised speedup over model.generate of a grid of the candidates (gamma 1, 2, 3, 4, 6, 8 and trees)."""
    grid = [c for c in choices if c.tree is not None or c.gamma in (1, 2, 3, 4, 6, 8)]
    contenders = [generate_contender(model, "generate", False, 1.0)]
    contenders += [selfspec_contender(model, c.label, False, 1.0, draft_vocab=vocab, heads=heads, **c.options())
                   for c in grid]  # fmt: skip
    rows = run_bench(contenders, inputs, max_new_tokens)
    return {row["contender"]: row["speedup"] for row in rows[1:]}
