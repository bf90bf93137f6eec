"""`selfspec demo`: load a target and its heads, run its best modes next to `model.generate`, report.

The demo answers a few chat prompts with SmolLM2-135M-Instruct (`smollm2-135m-instruct`, the `[smollm2]` extra)
in bfloat16 where the machine multiplies it natively and in float32 elsewhere (`selfspec.cli.options.default_dtype`):
plain `model.generate`, then selfspec's best modes for it (the bundled EAGLE head's chain with the draft
vocabulary, n-gram lookup, their hybrid, lookup merged into the head's tree, and that tree with suffix drafting
that remembers the model's own answers to a chat data set, `KnownTarget.memory`, as a third part). It prints the
completions and tokens/s, speedup and tokens per target pass, and checks the greedy outputs against
`model.generate`'s: in bfloat16 up to ties of its top-2 scores (`selfspec.measure.ties`), in float32 token for
token. `--model demo` runs the bundled toy target instead (heads/demo-target, trained by this project) on held-out
code prompts, with every kind of its heads and alpha per exit depth (also as a PNG).
"""

from __future__ import annotations

import argparse
import sys
import textwrap

import torch

from ..adapter import ModelAdapter
from ..heads import EagleHeads, ExitHeads, MedusaHeads
from ..measure.bench import COLUMNS, markdown_table, run_bench
from ..measure.contenders import (
    MERGED_TREE,
    Contender,
    eagle_contenders,
    generate_contender,
    memory_merged_contenders,
    merged_contenders,
    selfspec_contender,
    tree_for,
)
from ..measure.ties import TIE, TIE_STEPS
from ..targets import DEMO_TARGET, known_target
from .options import (
    check_plotting,
    check_prompt_lengths,
    default_dtype,
    encode,
    load_target,
    output_folder,
    resolve_dtype,
)

DEMO_COLUMNS = ["contender", "tokens_per_s", "speedup", "matched", "alpha_hat", "tokens_per_pass"]
# How the demo runs SmolLM2-135M-Instruct (other targets: every mode their heads allow): its best modes only, as each
# mode costs a run of a 135M model and the demo is to stay under about 3 minutes.
BEST_MODES_ONLY = {DEMO_TARGET}


def demo_dtype(model: str, device: str = "cpu") -> str:
    """The dtype the demo runs `model` in without --dtype (`selfspec.cli.options.default_dtype`)."""
    return default_dtype(model, device)[0]


def demo_contenders(
    model, heads: dict, vocab: list[int] | None, best_only: bool = False, memory: list[list[int]] | None = None
) -> list[Contender]:
    """model.generate, then selfspec (reduced-vocabulary drafts where `vocab` is given). `best_only`: the best
    modes (`best_contenders`, with `memory`); else the full field: the trained exit heads (the untrained exit
    without them), Medusa chain and tree, the EAGLE head's modes, n-gram lookup, and lookup with the Medusa heads
    where it has no match."""
    if best_only:
        return best_contenders(model, heads, vocab, memory)
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


def best_contenders(model, heads: dict, vocab: list[int] | None, memory: list[list[int]] | None = None):
    """model.generate, then the chain of each kind of heads loaded (the trained exit at its tuned depth, the Medusa
    chain, the EAGLE chain) with the draft vocabulary `vocab`, n-gram lookup, its hybrid with each kind, and with
    an EAGLE head, lookup merged into the head's tree (`MERGED_TREE`), and with `memory` (answers' token ids) too,
    that tree with the chain of suffix drafting that remembers them as a third part."""
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
    if EagleHeads in heads:
        contenders += merged_contenders(model, heads[EagleHeads], vocab, [MERGED_TREE])
        if memory:
            contenders += memory_merged_contenders(model, memory, heads[EagleHeads], vocab, MERGED_TREE, lookup=True)
    return contenders


def demo_memory(name: str, tokenizer) -> list[list[int]] | None:
    """The answers (token ids) that the known target `name`'s suffix drafting remembers in the demo
    (`KnownTarget.memory`), saying so; None, saying why, where its file is not here."""
    import time

    from ..chat import chat_answers

    path = known_target(name).memory
    if path is None:
        return None
    if not path.exists():
        print(f"suffix memory: {path} is not here (a clone of the repository has it); the merged tree with it is "
              "left out")  # fmt: skip
        return None
    started = time.perf_counter()
    answers = chat_answers(path, tokenizer)
    print(f"suffix memory: {sum(map(len, answers)):,} tokens, the model's own answers in {path.name} "
          f"({len(answers):,} turns, read in {time.perf_counter() - started:.0f} s)")  # fmt: skip
    return answers


def alpha_by_depth(model, heads: ExitHeads, sequences: list[torch.Tensor]) -> list[dict]:
    """Analytic alpha per exit depth, untrained exit next to trained heads, on the given token sequences."""
    from ..measure.profile import evaluate, report_rows, untrained_like

    adapter = ModelAdapter(model)
    length = min(s.shape[-1] for s in sequences)
    rows = torch.cat([s[..., :length].reshape(1, -1) for s in sequences])
    scores = evaluate(model, adapter, {"untrained": untrained_like(heads), "trained": heads}, rows, batch_size=4)
    return report_rows(heads, scores["untrained"], scores["trained"], None, max_gamma=0)


def demo_legend(vocab_size: int | None, ties: bool = False, memory: bool = False) -> str:
    """What the demo table's columns mean; `ties`: half precision, where "tie (n)" may show; `memory`: a
    contender remembers earlier answers."""
    legend = [
        "tokens/s: new tokens per second; speedup: over model.generate in this run; greedy match: the same tokens",
        "as model.generate; alpha_hat: drafts accepted / drafts proposed; tokens/pass: new tokens per full-model",
        "pass (1.00 for plain decoding; each pass verifies the drafts and adds one token of its own).",
    ]
    if ties:
        legend.append("tie (n): the same tokens up to a tie on n prompts (see the greedy check below).")
    if vocab_size:
        legend += [
            f"vocab {vocab_size}: the drafts choose among {vocab_size} tokens (a draft vocabulary: the target's most "
            "frequent",
            "tokens in its data) and those of the prompt and the answer so far; verification uses the whole",
            "vocabulary, so the output stays exact.",
        ]
    if memory:
        legend += [
            f"suffix {MERGED_TREE[1]}, memory N tokens: suffix drafting's chain of up to {MERGED_TREE[1]} tokens, from "
            "the longest match of the",
            "text's end in the prompt, the answer so far and the model's own earlier answers (N tokens, read before",
            "the first prompt; each answer of the run joins them).",
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
    `selfspec.measure.ties.compare_greedy`: in float32 identical tokens, in half precision identical up to a tie."""
    name = str(dtype).removeprefix("torch.")
    if dtype == torch.float32:
        rule = f"Greedy check ({name}): each output must equal model.generate's, token for token."
        elsewhere = "differs from model.generate's output"
    else:
        rule = (f"Greedy check ({name}, the tie rule of selfspec.measure.ties): each output must equal "
                f"model.generate's up to the first position where model.generate's top-2 scores are within "
                f"{TIE_STEPS} {name} rounding steps of each other, and take one of those tokens there (a pass over "
                "several positions rounds differently from a one-token step).")  # fmt: skip
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
    from ..measure.profile import format_table, plot_alpha

    check_plotting()
    output_folder(args.output, make=False)  # written only with exit heads (the demo target's plot)
    resolve_dtype(args)
    model, tokenizer, heads, prompts, vocab = load_target(args)
    prompts = prompts[: args.num_prompts]
    inputs = encode(tokenizer, prompts, model.device)
    check_prompt_lengths(inputs, args.max_new_tokens, ModelAdapter(model).max_positions)
    best_only = args.model in BEST_MODES_ONLY
    memory = demo_memory(args.model, tokenizer) if best_only and EagleHeads in heads else None
    contenders = demo_contenders(model, heads, vocab, best_only=best_only, memory=memory)
    dtype = str(model.dtype).removeprefix("torch.")
    print(f"{args.model}: {len(prompts)} prompts, {args.max_new_tokens} new tokens each, greedy, {dtype}")
    rows = run_bench(contenders, inputs, args.max_new_tokens, repeats=1)
    outputs = contenders[0].outputs  # model.generate's, prompt by prompt
    for prompt, ids, output in zip(prompts, inputs, outputs, strict=True):
        tail = "\n".join(prompt.rstrip("\n").splitlines()[-4:])
        completion = tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)
        print(f"\n----- prompt (last lines) -----\n{tail}\n----- completion -----\n{completion}")
    print("\n" + markdown_table(rows, [c for c in COLUMNS if c[0] in DEMO_COLUMNS]))
    print(demo_legend(len(vocab) if vocab else None, ties=model.dtype != torch.float32, memory=bool(memory)))
    report, failures = greedy_check(contenders, model.dtype)
    print("\n" + "\n".join(report))
    if ExitHeads in heads:
        output_dir = output_folder(args.output)
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
