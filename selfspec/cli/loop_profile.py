"""Where one decoding iteration's time goes: a host timer per section of the loop, and torch's op view.

    python -m selfspec.cli.loop_profile --model demo --modes plain,medusa,exit,tree,ngram --gamma 3
    python -m selfspec.cli.loop_profile --model demo --modes plain,medusa,exit --before fbc8173   # against a git ref
    python -m selfspec.cli.loop_profile --model demo --modes plain,medusa,ngram --compile   # and with compile=True

Each mode runs with a fixed gamma (no adaptive drafting), so that every iteration has the same shape. The
loop's functions are wrapped for the run (nothing in the library is instrumented): the time inside each is
charged to its section, less the time of the sections it calls, so the sections of an iteration add up to
the iteration. What the loop does between the wrapped calls (softmaxes, index tensors) is "loop (rest)".

v = (iteration - draft) / plain iteration: what verifying gamma+1 positions costs, with everything the loop
does around it (processing, acceptance, commit, cache), over one plain step of the same loop. v(forward) is
the model pass alone over the plain step's pass: the part of v that the hardware sets.

`--before REF` loads the package as it was at git commit REF (from `git archive`) next to the working tree's
and runs both interleaved, prompt by prompt: the before/after figures come from one run, under one load.
`--compile` adds each mode that can run compiled (plain, medusa, ngram, eagle) with `compile=True`, interleaved with the
eager runs; its v is over the compiled plain step.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from ..measure.prompts import first_per_category
from .options import encode, load_target
from .parsers import HelpFormatter, add_model_arguments, merged_tree_shapes

ROOT = "iteration"
DRAFT_SECTIONS = ("draft", "draft check", "choose drafter")
# (owner, attribute, section): the owner is "loop" (the class that defines `SelfSpeculative`'s loop), None (a
# function of the loop's module) or a class the loop's module imports; missing ones are skipped, so that older
# versions of the loop (--before), whatever their modules, are timed by the same sections
WRAPPED = [
    ("loop", "speculative_step", ROOT),
    ("loop", "tree_step", ROOT),
    ("loop", "_prefill", "prefill"),
    ("loop", "_choose_drafter", "choose drafter"),
    (None, "check_draft", "draft check"),
    (None, "target_pass", "verify forward"),
    (None, "process_scores", "processing"),
    (None, "process_tree_scores", "processing"),
    ("TreeScores", "__call__", "processing"),
    ("Call", "process", "processing"),
    (None, "accept_greedy", "acceptance"),
    (None, "accept_sampling", "acceptance"),
    (None, "accept_tree", "acceptance"),
    (None, "pick", "acceptance"),
    ("Draft", "probabilities", "acceptance"),
    ("Call", "record_alpha", "alpha tally"),
    ("Call", "commit", "commit"),
    ("loop", "_hand_over", "hand over"),
    ("ModelAdapter", "crop", "cache"),
    ("ModelAdapter", "rearrange", "cache"),
    ("GenerationStats", "record_iteration", "stats"),
    ("DraftController", "update", "stats"),
]
MODES = ("plain", "medusa", "exit", "tree", "ngram", "eagle", "eagle_tree", "merged")
COMPILED_MODES = ("plain", "medusa", "ngram", "eagle")  # the modes compile=True runs (chains through full passes)
DRAFTER_METHODS = {"draft": "draft", "draft_tree": "draft", "verify": "verify forward", "verify_tree": "verify forward"}


class SectionTimer:
    """Exclusive wall time per section of each iteration; sections met between iterations (the drafter choice)
    are charged to the next one, the prefill's to none."""

    def __init__(self):
        self.iterations: list[dict[str, float]] = []  # per iteration: section -> seconds
        self._stack: list[list] = []  # [section, seconds spent in sections it called]
        self._pending: dict[str, float] = defaultdict(float)
        self.record = True

    def wrap(self, function, section: str):
        def timed(*args, **kwargs):
            if self._stack and self._stack[-1][0] == section:  # a section calling its own kind: one section
                return function(*args, **kwargs)
            if section == ROOT:  # speculative_step(self, call, index, gamma); a tree step: "tree"
                self._pending["gamma"] = args[3] if len(args) > 3 else "tree"
            self._stack.append([section, 0.0])
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                _, inner = self._stack.pop()
                if self._stack:
                    self._stack[-1][1] += elapsed
                self._charge(section, elapsed - inner)

        return timed

    def _charge(self, section: str, seconds: float) -> None:
        if section == ROOT:
            self._pending["loop (rest)"] += seconds
            if self.record:
                self.iterations.append(dict(self._pending))
            self._pending.clear()
        elif section != "prefill" and not any(frame[0] == "prefill" for frame in self._stack):
            self._pending[section] += seconds

    def generate(self, spec, prompt: torch.Tensor, **kwargs) -> None:
        """One `spec.generate` call; its first iteration, which is charged the prefill's commit, is left out."""
        first = len(self.iterations)
        spec.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
        del self.iterations[first : first + 1]


@contextmanager
def instrumented(package, spec, timer: SectionTimer):
    """The loop of `package` (selfspec or an older copy) with its sections timed by `timer` while inside."""
    with ExitStack() as stack:
        loop = next(owner for owner in type(spec).__mro__ if "speculative_step" in vars(owner))
        module = sys.modules[loop.__module__]  # the loop's functions, and the classes it imports
        owners = {"loop": loop, None: module}
        targets = [(owners[owner] if owner in owners else getattr(module, owner, None), name, section)
                   for owner, name, section in WRAPPED]  # fmt: skip
        targets += [(type(part), name, section) for part in spec.drafters for name, section in DRAFTER_METHODS.items()]
        done = set()
        for owner, name, section in targets:
            if owner is None or (id(owner), name) in done or name not in dir(owner):
                continue
            done.add((id(owner), name))
            original = inspect.getattr_static(owner, name)
            function = original.__func__ if isinstance(original, staticmethod) else original
            wrapped = timer.wrap(function, section)
            setattr(owner, name, staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped)
            stack.callback(setattr, owner, name, original)
        yield


def load_package(ref: str | None):
    """selfspec from the working tree (ref None), or as it was at git commit `ref`, imported as `selfspec_<ref>`."""
    if ref is None:
        return importlib.import_module("selfspec")
    repository = Path(__file__).resolve().parents[2]
    name = "selfspec_" + "".join(ch if ch.isalnum() else "_" for ch in ref)
    root = Path(tempfile.mkdtemp(prefix="selfspec_before_"))
    archive = subprocess.run(["git", "-C", str(repository), "archive", ref, "selfspec"], check=True,
                             capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    (root / "selfspec").rename(root / name)
    sys.path.insert(0, str(root))
    return importlib.import_module(name)


def contenders(package):
    """`package`'s module of benchmark contenders: `measure.contenders`, or `bench` in versions before it."""
    for name in ("measure.contenders", "bench"):
        try:
            return importlib.import_module(f"{package.__name__}.{name}")
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(f"{package.__name__} has no module of benchmark contenders")


def mode_options(package, mode: str, heads: dict, gamma: int, merged: tuple[dict, int], vocab=None) -> dict:
    """SelfSpeculative arguments of one mode, with `package`'s own heads objects; `merged`: the EAGLE tree and
    lookup's chain length of the modes eagle_tree (the tree) and merged (both, one merged tree). The EAGLE modes
    draft from the draft vocabulary `vocab` (token ids; None: the whole vocabulary), as `selfspec bench` runs them."""
    chain = {"num_draft_tokens": gamma, "adaptive": False}
    eagle = {"heads": heads.get("eagle"), "draft_vocab": vocab}
    if mode == "plain":
        return {"num_draft_tokens": 0}
    if mode == "ngram":
        return {"drafter": "ngram", **chain}
    if mode == "exit":
        return {"heads": heads["exit"], **chain}
    if mode == "medusa":
        return {"heads": heads["medusa"], "tree": [], **chain}
    if mode == "tree":
        return {"heads": heads["medusa"], "tree": contenders(package).tree_for(heads["medusa"])}
    if mode == "eagle":
        return {**eagle, **chain}
    if mode == "eagle_tree":
        return {**eagle, "tree": merged[0]}
    if mode == "merged":
        return {"drafter": "hybrid", **eagle, "tree": merged[0], "prompt_lookup_num_tokens": merged[1]}
    raise SystemExit(f"unknown mode {mode!r}: {', '.join(MODES)}")


def build_runs(args, model, heads_paths: dict, vocab=None) -> list[tuple[str, object, object]]:
    """(label, package, spec) per mode and package version; the EAGLE modes draft from `vocab` (`mode_options`)."""
    packages = [load_package(None)] + ([load_package(args.before)] if args.before else [])
    runs = []
    for package in packages:
        # submodules by import: the package's lazy exports do not name them, and a copy (--before) has none loaded yet
        adapter = importlib.import_module(f"{package.__name__}.adapter").ModelAdapter(model)
        load_heads = importlib.import_module(f"{package.__name__}.heads").load_heads
        heads = {kind: load_heads(path, adapter) for kind, path in heads_paths.items()}
        for mode in args.modes.split(","):
            label = mode if package.__name__ == "selfspec" else f"{mode} @{args.before}"
            options = mode_options(package, mode, heads, args.gamma, args.merged_tree, vocab)
            runs.append((label, package, package.SelfSpeculative(model, **options)))
            if args.compile and package.__name__ == "selfspec" and mode in COMPILED_MODES:
                runs.append((f"{mode} compiled", package, package.SelfSpeculative(model, compile=True, **options)))
    return runs


def measure(runs, prompts, args) -> dict[str, SectionTimer]:
    """Every run on every prompt, interleaved (the order rotating each repeat), the first pass a warm-up."""
    timers = {label: SectionTimer() for label, _, _ in runs}
    for repeat in range(args.repeats + 1):
        for index, prompt in enumerate(prompts):
            shift = (repeat * len(prompts) + index) % len(runs)
            for label, package, spec in runs[shift:] + runs[:shift]:
                timers[label].record = repeat > 0
                with instrumented(package, spec, timers[label]):
                    timers[label].generate(spec, prompt, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample)
    return timers


def summarize(timers: dict[str, SectionTimer]) -> tuple[list[str], dict[str, dict[str, float]]]:
    """Mean microseconds per iteration and section, per run, over the iterations of the run's usual shape (the
    token budget's last ones ask for fewer drafts, a tree's for a chain)."""
    table = {}
    for label, timer in timers.items():
        if not timer.iterations:
            continue
        gamma = statistics.mode(it["gamma"] for it in timer.iterations)
        full = [{k: v for k, v in it.items() if k != "gamma"} for it in timer.iterations if it["gamma"] == gamma]
        sections = sorted({name for it in full for name in it})
        table[label] = {name: 1e6 * statistics.fmean(it.get(name, 0.0) for it in full) for name in sections}
        table[label]["total"] = sum(table[label].values())
        table[label]["iterations"] = len(full)
    names = sorted({name for row in table.values() for name in row} - {"total", "iterations"})
    return names, table


def ratios(table: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """v and v(forward) of every run against the plain run of the same package (and compilation)."""
    out = {}
    for label, row in table.items():
        plain = table.get(label.replace(label.split(" ")[0], "plain", 1))
        if plain is None or label.startswith("plain"):
            continue
        verify = row["total"] - sum(row.get(name, 0.0) for name in DRAFT_SECTIONS)
        out[label] = {"v": verify / plain["total"], "v_forward": row["verify forward"] / plain["verify forward"]}
    return out


def print_tables(names, table, rates) -> None:
    labels = list(table)
    print("| section (us per iteration) | " + " | ".join(labels) + " |")
    print("|---|" + "---|" * len(labels))
    for name in [*names, "total"]:
        print(f"| {name} | " + " | ".join(f"{table[label].get(name, 0.0):.0f}" for label in labels) + " |")
    print("| iterations timed | " + " | ".join(str(table[label]["iterations"]) for label in labels) + " |")
    for key, what in (("v", "v (verify incl. loop work / plain iteration)"), ("v_forward", "v(forward)")):
        values = [f"{rates[label][key]:.3f}" if label in rates else "-" for label in labels]
        print(f"| {what} | " + " | ".join(values) + " |")


def op_view(runs, prompt, args) -> None:
    """torch.profiler's busiest ops per iteration (self CPU time) for each run, one generate call each."""
    from torch.profiler import ProfilerActivity, profile

    for label, _, spec in runs:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            spec.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.max_new_tokens,
                          do_sample=args.do_sample)  # fmt: skip
        iterations = max(spec.stats.iterations, 1)
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[: args.ops]
        total = sum(e.self_cpu_time_total for e in prof.key_averages())
        print(f"\n{label}: {iterations} iterations, {total / iterations:.0f} us self CPU per iteration (profiled)")
        print("| op | calls per iteration | self CPU us per iteration |")
        print("|---|---|---|")
        for event in events:
            print(f"| {event.key} | {event.count / iterations:.1f} | {event.self_cpu_time_total / iterations:.0f} |")


def speed(model, runs, prompts, args) -> None:
    """End to end, uninstrumented: tokens/s of every run and of `model.generate`, interleaved
    (`selfspec.measure.bench.run_bench`)."""
    from ..measure.bench import run_bench
    from ..measure.contenders import Contender, generate_contender

    def runner(spec):
        return lambda ids, new: spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                              do_sample=args.do_sample)  # fmt: skip

    contenders = [generate_contender(model, "generate", args.do_sample, 1.0)]
    contenders += [Contender(label, args.do_sample, runner(spec), spec=spec) for label, _, spec in runs]
    rows = run_bench(contenders, prompts, args.max_new_tokens, repeats=args.speed_repeats, progress=False)
    print(f"\nend to end, {args.speed_repeats} interleaved repeats (median tokens/s):\n")
    print("| run | tokens/s | speedup over generate | greedy match | tokens/pass |")
    print("|---|---|---|---|---|")
    for row in rows:
        per_pass = f"{row['tokens_per_pass']:.2f}" if row.get("tokens_per_pass") else "-"
        cells = [row["contender"], f"{row['tokens_per_s']:.1f}", f"{row['speedup']:.3f}x", row["matched"], per_pass]
        print("| " + " | ".join(str(cell) for cell in cells) + " |")


MERGED_TREE = "6-2-4/10"  # --merged_tree when not given


def one_merged_tree(text: str) -> tuple[dict, int]:
    """An argparse type: one shape of `merged_tree_shapes` (eagle_tree and merged each time one tree per run)."""
    shapes = merged_tree_shapes(text)
    if len(shapes) > 1:
        raise argparse.ArgumentTypeError(f"takes one shape, got {len(shapes)} in {text!r}: profile each in its own run")
    return shapes[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    add_model_arguments(parser, bundled=True)
    parser.set_defaults(max_new_tokens=64)
    parser.add_argument("--modes", default="plain,medusa,exit,tree,ngram", help=", ".join(MODES))
    parser.add_argument(
        "--merged_tree",
        type=one_merged_tree,
        help="NODES-TOP_K-DEPTH/LOOKUP_TOKENS: the EAGLE tree of eagle_tree and merged, and lookup's chain in merged "
        f"(default {MERGED_TREE})",
    )
    parser.add_argument("--gamma", type=int, default=3, help="drafts per iteration of the chain modes")
    parser.add_argument("--num_prompts", type=int, default=4, help="prompts used (the first N)")
    parser.add_argument(
        "--limit_per_category", type=int, help="Spec-Bench prompts: the first N per category (then --num_prompts)"
    )
    parser.add_argument("--repeats", type=int, default=2, help="timed passes over the prompts (after a warm-up)")
    parser.add_argument("--do_sample", action="store_true", help="sample (default: greedy)")
    parser.add_argument("--before", help="also time the loop as it was at this git commit, interleaved")
    parser.add_argument(
        "--compile", action="store_true", help="also time plain, medusa, ngram and eagle with compile=True"
    )
    parser.add_argument("--ops", type=int, default=0, help="print torch.profiler's N busiest ops per mode")
    parser.add_argument("--speed_repeats", type=int, default=0, help="also time every run end to end, N repeats")
    args = parser.parse_args(argv)
    if args.merged_tree is not None and not {"eagle_tree", "merged"} & set(args.modes.split(",")):
        parser.error(f"--merged_tree shapes the modes eagle_tree and merged; --modes {args.modes} has neither")
    args.merged_tree = one_merged_tree(MERGED_TREE) if args.merged_tree is None else args.merged_tree
    model, tokenizer, heads, prompt_texts, vocab = load_target(args)
    from ..heads import EagleHeads, ExitHeads, MedusaHeads
    from ..targets import default_heads

    paths = args.heads or default_heads(args.model or "demo")
    kinds = {ExitHeads: "exit", MedusaHeads: "medusa", EagleHeads: "eagle"}
    heads_paths = {kinds[type(loaded)]: path for path, loaded in zip(paths, heads.values(), strict=True)}
    if args.limit_per_category:
        prompt_texts = first_per_category(prompt_texts, args.limit_per_category)
    prompts = encode(tokenizer, prompt_texts[: args.num_prompts], model.device)
    runs = build_runs(args, model, heads_paths, vocab)
    names, table = summarize(measure(runs, prompts, args))
    mode = "sampling" if args.do_sample else "greedy"
    lengths = sorted(prompt.shape[1] for prompt in prompts)
    threads = torch.get_num_threads()
    print(f"\nmean over {len(prompts)} prompts ({lengths[0]}-{lengths[-1]} tokens) x {args.repeats} repeats, "
          f"{args.max_new_tokens} new tokens, gamma {args.gamma}, {mode}, {threads} thread(s)\n")  # fmt: skip
    print_tables(names, table, ratios(table))
    if args.ops:
        op_view(runs, prompts[0], args)
    if args.speed_repeats:
        speed(model, runs, prompts, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
