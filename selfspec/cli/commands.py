"""`selfspec bench` and `selfspec tune` on the command line: load the target (`selfspec.cli.options`), run
`selfspec.measure.bench` or `selfspec.measure.tune`, print and write the results. Without --model they run on the
bundled toy target."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..adapter import ModelAdapter
from ..heads import EagleHeads, ExitHeads, MedusaHeads
from ..measure.bench import (
    category_report,
    markdown_table,
    plot_speedups,
    position_table,
    run_bench,
    summarize_by_category,
    write_json,
)
from ..measure.contenders import (
    chain_contenders,
    compiled_contenders,
    fixed_tree_contenders,
    generate_contender,
    memory_contenders,
    merged_contenders,
    selfspec_contender,
    standard_contenders,
    static_vocab_contenders,
    unpacked_contenders,
)
from ..measure.prompts import ChatPrompt, categories_of, first_per_category
from ..speculative import SelfSpeculative
from ..targets import DEFAULT_TARGET, default_heads
from .options import BUNDLED, check_plotting, check_prompt_lengths, encode, load_target, output_folder
from .parsers import BENCH_SEED, BENCH_TEMPERATURE, BENCH_WARMUP


def run_bench_command(args: argparse.Namespace) -> int:
    import platform

    import transformers

    if args.suffix_memory_tokens is not None and not args.suffix_memory:
        raise SystemExit("--suffix_memory_tokens limits --suffix_memory: pass the chat data set too")
    if args.warmup is not None and args.workload != "repeated":
        raise SystemExit("--warmup sets the untimed calls of --workload repeated: pass that too, or leave it out")
    args.warmup = BENCH_WARMUP if args.warmup is None else args.warmup
    if args.suffix_memory and args.batch_sizes:
        raise SystemExit("--suffix_memory adds contenders to the Spec-Bench or repeated runs, not to --batch_sizes")
    # the runs other than the Spec-Bench prompts' (None: those)
    other_run = "--batch_sizes" if args.batch_sizes else "--workload repeated" if args.workload == "repeated" else None
    variants = [flag for flag, _ in VARIANTS if getattr(args, flag)]
    if variants and other_run:
        raise SystemExit(f"--{variants[0]} adds variants to the Spec-Bench prompts' contenders, not to {other_run}")
    if args.temperature is not None and other_run:
        raise SystemExit(f"--temperature sets the sampling contenders of the Spec-Bench runs; {other_run} measures "
                         "greedy decoding")  # fmt: skip
    if args.temperature is not None and args.no_sampling:
        raise SystemExit("--temperature sets the sampling contenders, which --no_sampling leaves out")
    if args.seed is not None and other_run:
        raise SystemExit(f"--seed seeds the sampled contenders of the Spec-Bench runs; {other_run} measures greedy "
                         "decoding")  # fmt: skip
    if args.seed is not None and args.no_sampling:
        raise SystemExit("--seed seeds the sampled contenders, which --no_sampling leaves out")
    args.temperature = BENCH_TEMPERATURE if args.temperature is None else args.temperature
    args.seed = BENCH_SEED if args.seed is None else args.seed
    if other_run:
        check_other_run(args, other_run)
    if not args.batch_sizes:
        check_plotting()
    if args.assistant_exit_layers and args.no_transformers:
        raise SystemExit("--assistant_exit_layers sets transformers' early-exit contenders, which --no_transformers "
                         "leaves out")  # fmt: skip
    output = output_folder(args.output)
    model, tokenizer, heads, prompts, vocab = load_target(args, with_prompts=args.workload == "prompts")
    adapter = ModelAdapter(model)  # the layers and positions the engine goes by
    check_exit_layers(args, adapter.num_layers)
    if args.workload == "repeated":
        return run_repeated_workload(args, model, tokenizer, heads, vocab)
    if args.limit_per_category is not None:
        try:
            prompts = first_per_category(prompts, args.limit_per_category)
        except ValueError as error:
            raise SystemExit(f"--limit_per_category: {error}") from error
    prompts = prompts[: args.num_prompts]
    inputs = encode(tokenizer, prompts, model.device)
    check_prompt_lengths(inputs, args.max_new_tokens, adapter.max_positions)
    if args.batch_sizes:
        return run_batch_bench(args, model, heads, inputs, vocab)
    layers = args.assistant_exit_layers
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
    if args.compile:
        contenders += compiled_contenders(model, heads.get(MedusaHeads), heads.get(EagleHeads), vocab)
    if args.chains:
        if heads.get(EagleHeads) is None:
            raise SystemExit("--chains needs EAGLE heads (the bundled head of smollm2-135m-instruct, or --heads)")
        contenders += chain_contenders(model, heads.get(EagleHeads), vocab, args.chains)
    temperature = None if args.no_sampling else args.temperature
    contenders += merged_field(args, model, heads, vocab, temperature)
    if args.suffix_memory:
        contenders += memory_field(args, model, tokenizer, heads, vocab, temperature)
    if args.only:  # before the variants, which are built from what is kept: a part may name a variant too
        contenders = only_kept(args, contenders, variant_labels(args))
    if args.fixed_trees:
        contenders += fixed_tree_contenders(contenders)
    if args.unpacked:
        contenders += unpacked_contenders(contenders)
    if args.static_vocab:
        contenders += static_vocab_contenders(contenders)
    if args.only:
        contenders = only_kept(args, contenders)
    rows = run_bench(contenders, inputs, args.max_new_tokens, repeats=args.repeats, seed=args.seed)
    by_category = summarize_by_category(contenders, prompts) if categories_of(prompts) else None  # Spec-Bench
    table = category_report(by_category, prompts) if by_category else markdown_table(rows)
    if not by_category and any(row.get("proposed_per_position") for row in rows):
        table += "\n\n" + position_table(rows)
    print(table)
    if (output / "bench.json").exists():
        print(f"{output}: replacing an earlier run's results (--output names another folder)")
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
        "suffix_memory": args.suffix_memory,
        "suffix_memory_tokens": args.suffix_memory_tokens,
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


# the Spec-Bench runs' options that the other runs do not read: --batch_sizes measures one chain drafter (no
# contenders to choose, nor categories); --workload repeated asks its own prompts of its own field, greedy
SPEC_BENCH_OPTIONS = {
    "--batch_sizes": ("only", "chains", "merged_trees", "compile", "assistant_exit_layers", "untrained_exit_layer",
                      "limit_per_category", "no_transformers"),
    "--workload repeated": ("chains", "compile", "assistant_exit_layers", "untrained_exit_layer", "limit_per_category",
                            "prompts", "no_transformers"),
}  # fmt: skip


def check_other_run(args: argparse.Namespace, run: str) -> None:
    """`run` (--batch_sizes or --workload repeated) is a run of its own: the Spec-Bench runs' options it would
    ignore are refused, naming the first."""
    if args.batch_sizes and args.workload == "repeated":
        raise SystemExit("--batch_sizes and --workload repeated are separate runs: pass one of them")
    unread = SPEC_BENCH_OPTIONS[run]
    given = [name for name in unread if getattr(args, name) not in (None, False)]
    if given:
        raise SystemExit(f"--{given[0]} is an option of the Spec-Bench runs; {run} takes none of "
                         f"{', '.join('--' + name for name in unread)}")  # fmt: skip


def check_exit_layers(args: argparse.Namespace, layers: int) -> None:
    """--untrained_exit_layer and --assistant_exit_layers name layers below the model's last one (of `layers`)."""
    asked = [("--untrained_exit_layer", args.untrained_exit_layer)]
    asked += [("--assistant_exit_layers", layer) for layer in args.assistant_exit_layers or []]
    for option, layer in asked:
        if layer is not None and layer >= layers:
            raise SystemExit(f"{option} {layer}: an exit must come before the model's last layer (it has {layers}: "
                             f"1 to {layers - 1})")  # fmt: skip


def only_kept(args: argparse.Namespace, contenders: list, labels: list[str] = ("",)) -> list:
    """The baselines and the contenders `--only` names: a comma-separated part of it occurs in the name, or in the
    name of one of its variants (`variant_labels`); SystemExit where it names none. A name holds commas itself
    ("suffix 6, memory 2,986,068 tokens"), so where the whole of `--only` occurs in one, it is one part."""
    named = lambda part, c: any(part in c.name + label for label in labels)  # noqa: E731
    whole = args.only.strip()
    one = any(named(whole, c) for c in contenders if not c.baseline)
    parts = [whole] if one else [part.strip() for part in whole.split(",") if part.strip()]
    kept = [c for c in contenders if c.baseline or any(named(part, c) for part in parts)]
    if all(c.baseline for c in kept):
        names = ", ".join(repr(c.name) for c in contenders if not c.baseline)
        raise SystemExit(f"--only {args.only!r} names no contender of this run; they are: {names}")
    return kept


VARIANTS = (("fixed_trees", "fixed"), ("unpacked", "unpacked"), ("static_vocab", "static vocab"))  # flag, label


def variant_labels(args: argparse.Namespace) -> list[str]:
    """The labels of the variants this run adds ("... (fixed)" and the like), with no label for the contender
    itself, combined as the variants are built (a fixed tree without packed weights: "... (fixed) (unpacked)")."""
    labels = [""]
    for flag, label in VARIANTS:
        if getattr(args, flag):
            labels += [f"{known} ({label})" for known in labels]
    return labels


def merged_field(args: argparse.Namespace, model, heads: dict, vocab, temperature=None) -> list:
    """`--merged_trees`' contenders (`merged_contenders`): none without the option, SystemExit without EAGLE heads."""
    if not args.merged_trees:
        return []
    if heads.get(EagleHeads) is None:
        raise SystemExit("--merged_trees needs EAGLE heads (the bundled head of smollm2-135m-instruct, or --heads)")
    return merged_contenders(model, heads[EagleHeads], vocab, args.merged_trees, temperature)


def memory_field(args: argparse.Namespace, model, tokenizer, heads: dict, vocab, temperature=None) -> list:
    """`--suffix_memory`'s contenders (`memory_contenders`), merged into the `--merged_trees` shapes where given,
    greedy and at `temperature` (None: greedy only)."""
    shapes = args.merged_trees or ()
    answers = suffix_memory(args, tokenizer)
    return memory_contenders(model, answers, heads.get(EagleHeads), vocab, shapes, temperature)


def suffix_memory(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    """The answers of `--suffix_memory` (`selfspec.chat.chat_answers`), or SystemExit naming what is wrong."""
    from ..chat import chat_answers

    try:
        return chat_answers(args.suffix_memory, tokenizer, args.suffix_memory_tokens)
    except (OSError, ValueError) as error:
        raise SystemExit(f"--suffix_memory: {error}") from error


def run_repeated_workload(args: argparse.Namespace, model, tokenizer, heads: dict, vocab) -> int:
    """`selfspec bench --workload repeated` (`selfspec.workload`): warm-up calls, then the timed prompts by kind."""
    from ..measure.workload import repeated_contenders, revision_prompts, same_task_prompts, warm_up

    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit("--workload repeated asks a chat model its tasks, and this tokenizer has no chat template "
                         "(a base model?): pass a chat model's --model")  # fmt: skip
    warm, timed = same_task_prompts(tokenizer, args.warmup)

    def answer(text: str) -> str:
        (ids,) = encode(tokenizer, [ChatPrompt(text, "revision")], model.device)
        output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                do_sample=False)  # fmt: skip
        return tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)

    timed += revision_prompts(tokenizer, answer, args.warmup + 2)
    prompts = timed[: args.num_prompts]
    contenders = repeated_contenders(model, heads.get(EagleHeads), vocab) + merged_field(args, model, heads, vocab)
    if args.suffix_memory:
        contenders += memory_field(args, model, tokenizer, heads, vocab)
    if args.only:
        contenders = only_kept(args, contenders)
    warm_up(contenders, encode(tokenizer, warm, model.device), args.max_new_tokens)
    rows = run_bench(contenders, encode(tokenizer, prompts, model.device), args.max_new_tokens, repeats=args.repeats)
    by_category = summarize_by_category(contenders, prompts)
    table = category_report(by_category, prompts)
    print(table)
    output = output_folder(args.output)
    (output / "bench_repeated.md").write_text(table + "\n", encoding="utf-8")
    flat = [{"category": category, **row} for category, summaries in by_category.items() for row in summaries]
    meta = {"workload": "repeated", "warmup": len(warm), "prompts": len(prompts), "dtype": str(model.dtype),
            "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
            "suffix_memory": args.suffix_memory, "suffix_memory_tokens": args.suffix_memory_tokens}  # fmt: skip
    write_json(flat, output / "bench_repeated.json", meta)
    print(f"wrote {output / 'bench_repeated.md'}, {output / 'bench_repeated.json'}")
    mismatched = [row["contender"] for row in rows if row["matched"] is False]
    if mismatched:
        print(f"GREEDY OUTPUT DIFFERS from model.generate: {', '.join(mismatched)}", file=sys.stderr)
        return 1
    return 0


def run_batch_bench(args: argparse.Namespace, model, heads: dict, inputs, vocab) -> int:
    """`selfspec bench --batch_sizes`: batched model.generate against selfspec's best chain drafter, adaptive."""
    from ..measure.bench import batch_table, batch_throughput

    medusa, eagle, exit_heads = heads.get(MedusaHeads), heads.get(EagleHeads), heads.get(ExitHeads)
    if medusa is not None:
        spec, label = SelfSpeculative(model, heads=medusa, tree=[], draft_vocab=vocab), "Medusa chain"
    elif eagle is not None:
        spec, label = SelfSpeculative(model, heads=eagle, draft_vocab=vocab), "EAGLE chain"
    else:
        name = "exit layer" if exit_heads is not None else "untrained exit layer (no heads given)"
        spec, label = SelfSpeculative(model, heads=exit_heads, draft_vocab=vocab), name
    rows = batch_throughput(spec, inputs, args.batch_sizes, args.max_new_tokens, repeats=args.repeats)
    table = batch_table(rows)
    print(f"selfspec: {label}{', draft vocabulary ' + str(len(vocab)) if vocab else ''}, adaptive gamma\n{table}")
    output = output_folder(args.output)
    (output / "bench_batch.md").write_text(table + "\n", encoding="utf-8")
    write_json(rows, output / "bench_batch.json", {"mode": label, "max_new_tokens": args.max_new_tokens})
    return 0 if all(row["matched"] for row in rows) else 1


def run_tune_command(args: argparse.Namespace) -> int:
    from ..heads import CARD_NAME
    from ..measure.tune import apply_choice, format_choices, tune, tuned_card

    model, tokenizer, heads, prompts, vocab = load_target(args)
    if not heads:
        raise SystemExit("selfspec tune needs trained heads: pass --heads PATH")
    inputs = encode(tokenizer, prompts[: args.num_prompts], model.device)
    check_prompt_lengths(inputs, args.max_new_tokens, ModelAdapter(model).max_positions)
    batch_sizes = tuple(args.batch_sizes)
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
        if isinstance(best.tree, dict):  # an EAGLE tree: asked for per call, so the best chain is what gets written
            written = next(choice for choice in choices if choice.tree is None)
            print(f"an EAGLE head's default is a chain, so {written.label} is written; the tree is "
                  f"SelfSpeculative(model, heads=..., tree={best.tree})")  # fmt: skip
            best = written
        if not args.dry_run:
            apply_choice(draft_heads, best, position_cost)
            card_path = Path(path) / CARD_NAME
            card = card_path.read_text(encoding="utf-8") if card_path.exists() else ""
            command = "selfspec " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("selfspec") else "selfspec tune"
            draft_heads.save_defaults(path, card=tuned_card(card, table, best, command))  # the weights as they are
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
