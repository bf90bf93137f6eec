"""Side-by-side speed: every contender runs on the same prompts and token budget, interleaved run by run.

Contenders are plain `model.generate` (greedy and sampling), transformers' own assisted modes (its early
exit, prompt lookup) and selfspec's modes (the plain loop with gamma = 0, early exit with the untrained and
the trained exit, Medusa chain and tree). Runs interleave (prompt by prompt, the contenders' order rotating
each repeat), so a machine that slows down or speeds up mid-way affects every contender alike; each figure
is a median over runs, and each ratio compares figures from the same session.

For each selfspec contender the measured costs are put back into the speedup equation of docs/design.md:
c = draft time per drafted token and v = time per full pass, both over the plain loop's time per token,
and S = E(alpha, gamma) / (v + gamma c) with the measured analytic alpha and the mean gamma, next to the
speedup realised.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from ..adapter.static import compiled_generate_options
from ..engine.adaptive import predicted_speedup
from ..engine.stats import sum_stats
from ..heads import EagleHeads, ExitHeads, MedusaHeads
from ..speculative import SelfSpeculative
from .ties import TIE, compare_greedy

# A small candidate tree for Medusa heads that carry none: two candidates for the next token, then chains.
DEFAULT_TREE = [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


def cut_tree(tree: list[list[int]], depth: int) -> list[list[int]]:
    """The paths of `tree` no deeper than `depth` (the number of Medusa heads)."""
    return [path for path in tree if len(path) <= depth]


def tree_for(heads: MedusaHeads) -> list[list[int]]:
    """The heads' own tree, else DEFAULT_TREE cut to their depth."""
    return heads.tree or cut_tree(DEFAULT_TREE, heads.num_heads)


@dataclass
class Contender:
    """One way of generating. `run(input_ids, max_new_tokens)` returns the output ids; `spec` is the
    SelfSpeculative behind it (its `stats` describe the last run), None for transformers' own modes."""

    name: str
    sampling: bool
    run: Callable[[torch.Tensor, int], torch.Tensor]
    spec: SelfSpeculative | None = None
    baseline: bool = False  # plain model.generate: what the speedups are relative to
    model: nn.Module | None = None  # a baseline's model: where a greedy divergence is checked for a tie
    plain_loop: bool = False  # selfspec with gamma = 0: the unit of c and v (of the compiled ones, if `compiled`)
    tree: bool = False
    compiled: bool = False  # torch.compile'd passes: compared with the compiled model.generate too
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    stats: list[dict] = field(default_factory=list)
    matched: list[bool] = field(default_factory=list)
    prompt_indices: list[int] = field(default_factory=list)  # the prompt of each timed run
    outputs: list[torch.Tensor] = field(default_factory=list)  # a greedy baseline's output ids of each timed run

    def runs_on(self, prompts: set[int]) -> Contender:
        """A copy holding only the runs on the prompts with these indices (for per-category summaries)."""
        keep = [i for i, index in enumerate(self.prompt_indices) if index in prompts]

        def pick(values: list) -> list:  # per-run lists; empty where they do not apply (stats, matched, outputs)
            return [values[i] for i in keep] if values else []

        return replace(self, seconds=pick(self.seconds), tokens=pick(self.tokens), stats=pick(self.stats),
                       matched=pick(self.matched), prompt_indices=pick(self.prompt_indices),
                       outputs=pick(self.outputs))  # fmt: skip


def generate_contender(model: nn.Module, name: str, sampling: bool, temperature: float, **options) -> Contender:
    """`model.generate` itself, with transformers' own options (assistant_early_exit, prompt lookup ...)."""
    settings = {"do_sample": True, "temperature": temperature, "top_k": 0} if sampling else {"do_sample": False}

    def run(input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        mask = torch.ones_like(input_ids)
        return model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, **settings, **options)

    return Contender(name, sampling, run, baseline=not options, model=model)


def selfspec_contender(model: nn.Module, name: str, sampling: bool, temperature: float, **options) -> Contender:
    """selfspec with `SelfSpeculative(model, **options)`."""
    spec = SelfSpeculative(model, **options)
    settings = {"do_sample": True, "temperature": temperature, "top_k": 0} if sampling else {"do_sample": False}

    def run(input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        mask = torch.ones_like(input_ids)
        return spec.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, **settings)

    plain = options.get("num_draft_tokens") == 0
    tree = spec.drafter.tree is not None
    return Contender(name, sampling, run, spec=spec, plain_loop=plain, tree=tree, compiled=spec.compiled)


def compiled_contenders(
    model: nn.Module,
    medusa_heads: MedusaHeads | None = None,
    eagle_heads: EagleHeads | None = None,
    draft_vocab: list[int] | None = None,
    prompt_lookup_num_tokens: int = 10,
) -> list[Contender]:
    """Greedy, compiled: `model.generate` with transformers' static cache and torch.compile (the fair baseline for
    a compiled selfspec), then selfspec with compile=True: the plain loop (the unit of c and v of the compiled
    contenders), n-gram lookup, the Medusa chain and the EAGLE chain (with `draft_vocab`), and each one's hybrid with
    n-gram lookup."""
    suffix = f", vocab {len(draft_vocab)}" if draft_vocab is not None else ""
    field_ = [replace(generate_contender(model, "generate compiled", False, 1.0, **compiled_generate_options()),
                      compiled=True)]  # fmt: skip
    options = [("plain loop", {"num_draft_tokens": 0}),
               ("ngram", {"drafter": "ngram", "prompt_lookup_num_tokens": prompt_lookup_num_tokens})]  # fmt: skip
    hybrid = {"drafter": "hybrid", "prompt_lookup_num_tokens": prompt_lookup_num_tokens}
    for kind, heads, extra in (("medusa chain", medusa_heads, {"tree": []}), ("eagle", eagle_heads, {})):
        if heads is not None:
            settings = {"heads": heads, "draft_vocab": draft_vocab, **extra}
            options += [(f"{kind}{suffix}", settings), (f"hybrid ngram + {kind}{suffix}", {**settings, **hybrid})]
    for name, settings in options:
        field_.append(selfspec_contender(model, f"selfspec {name} compiled", False, 1.0, compile=True, **settings))
    return field_


def standard_contenders(
    model: nn.Module,
    exit_heads: ExitHeads | None = None,
    medusa_heads: MedusaHeads | None = None,
    assistant_exit_layers: list[int] | None = None,
    temperature: float = 0.8,
    sampling: bool = True,
    transformers_modes: bool = True,
    draft_vocab: list[int] | None = None,
    untrained_exit_layer: int | None = None,
    prompt_lookup_num_tokens: int = 10,
    eagle_heads: EagleHeads | None = None,
) -> list[Contender]:
    """The full field: plain generate, transformers' assisted modes, and every selfspec mode the heads allow:
    the untrained exit at the heads' first depth, each trained depth, Medusa chain and tree, sampling; with a
    `draft_vocab`, the Medusa modes and the middle trained depth once more with reduced-vocabulary drafts; the
    Medusa chain and the middle trained depth once more with an int8 draft LM head; n-gram lookup alone
    (transformers' prompt lookup settings) and hybrid with each kind of heads; an EAGLE head's chain (with the
    `draft_vocab` too), its hybrid with lookup and its sampling."""
    num_layers = model.config.get_text_config().num_hidden_layers
    exit_layer = exit_heads.exit_layers[0] if exit_heads is not None else max(1, num_layers // 4)
    exit_layer = untrained_exit_layer or exit_layer
    field_ = [generate_contender(model, "generate", False, temperature)]
    if sampling:
        field_.append(generate_contender(model, f"generate T={temperature}", True, temperature))
    if transformers_modes:
        for layer in assistant_exit_layers or sorted({max(1, num_layers // 4), max(1, num_layers // 2)}):
            field_.append(generate_contender(model, f"transformers early exit {layer}", False, temperature,
                                             assistant_early_exit=layer))  # fmt: skip
        field_.append(generate_contender(model, "transformers prompt lookup", False, temperature,
                                         prompt_lookup_num_tokens=10))  # fmt: skip
    field_.append(selfspec_contender(model, "selfspec plain loop", False, temperature, num_draft_tokens=0))
    lookup = {"prompt_lookup_num_tokens": prompt_lookup_num_tokens}  # transformers' prompt lookup settings
    field_.append(selfspec_contender(model, "selfspec ngram", False, temperature, drafter="ngram", **lookup))
    if exit_heads is not None:
        field_.append(selfspec_contender(model, "selfspec hybrid ngram + exit trained", False, temperature,
                                         drafter="hybrid", heads=exit_heads, **lookup))  # fmt: skip
    if medusa_heads is not None:
        field_.append(selfspec_contender(model, "selfspec hybrid ngram + medusa chain", False, temperature,
                                         drafter="hybrid", heads=medusa_heads, tree=[], **lookup))  # fmt: skip
    field_.append(selfspec_contender(model, f"selfspec exit {exit_layer} untrained", False, temperature,
                                     exit_layer=exit_layer))  # fmt: skip
    if exit_heads is not None:
        for layer in exit_heads.exit_layers:
            field_.append(selfspec_contender(model, f"selfspec exit {layer} trained", False, temperature,
                                             heads=exit_heads, exit_layer=layer))  # fmt: skip
        if draft_vocab is not None:
            layer = exit_heads.exit_layers[len(exit_heads.exit_layers) // 2]
            field_.append(selfspec_contender(model, f"selfspec exit {layer} trained, vocab {len(draft_vocab)}", False,
                                             temperature, heads=exit_heads, exit_layer=layer,
                                             draft_vocab=draft_vocab))  # fmt: skip
        layer = exit_heads.exit_layers[len(exit_heads.exit_layers) // 2]
        field_.append(selfspec_contender(model, f"selfspec exit {layer} trained, int8 head", False, temperature,
                                         heads=exit_heads, exit_layer=layer, draft_quant="int8"))  # fmt: skip
    if medusa_heads is not None:
        tree = tree_for(medusa_heads)
        field_.append(selfspec_contender(model, "selfspec medusa chain", False, temperature,
                                         heads=medusa_heads, tree=[]))  # fmt: skip
        field_.append(selfspec_contender(model, "selfspec medusa tree", False, temperature,
                                         heads=medusa_heads, tree=tree))  # fmt: skip
        if draft_vocab is not None:
            size = len(draft_vocab)
            field_.append(selfspec_contender(model, f"selfspec medusa chain, vocab {size}", False, temperature,
                                             heads=medusa_heads, tree=[], draft_vocab=draft_vocab))  # fmt: skip
            field_.append(selfspec_contender(model, f"selfspec medusa tree, vocab {size}", False, temperature,
                                             heads=medusa_heads, tree=tree, draft_vocab=draft_vocab))  # fmt: skip
        field_.append(selfspec_contender(model, "selfspec medusa chain, int8 head", False, temperature,
                                         heads=medusa_heads, tree=[], draft_quant="int8"))  # fmt: skip
        if draft_vocab is not None:
            field_.append(selfspec_contender(model, f"selfspec medusa chain, vocab {size}, int8 head", False,
                                             temperature, heads=medusa_heads, tree=[], draft_vocab=draft_vocab,
                                             draft_quant="int8"))  # fmt: skip
        if sampling:
            suffix = f", vocab {len(draft_vocab)}" if draft_vocab is not None else ""
            field_.append(selfspec_contender(model, f"selfspec medusa chain T={temperature}{suffix}", True,
                                             temperature, heads=medusa_heads, tree=[],
                                             draft_vocab=draft_vocab))  # fmt: skip
    elif sampling:
        field_.append(selfspec_contender(model, f"selfspec exit {exit_layer} T={temperature}", True, temperature,
                                         heads=exit_heads, exit_layer=exit_layer))  # fmt: skip
    if eagle_heads is not None:
        field_ += eagle_contenders(model, eagle_heads, draft_vocab, temperature if sampling else None, lookup)
    return field_


EAGLE_TREE = {"nodes": 6, "top_k": 2, "depth": 4}  # a small dynamic tree: a CPU verifies few positions for free


def eagle_contenders(model, heads: EagleHeads, draft_vocab, temperature: float | None, lookup: dict):
    """An EAGLE head's chain (and with `draft_vocab`), a small dynamic tree, its hybrid with n-gram lookup, and its
    sampling at `temperature` (None: greedy only); chains with adaptive gamma up to the heads' default."""
    suffix = f", vocab {len(draft_vocab)}" if draft_vocab is not None else ""
    field_ = [selfspec_contender(model, "selfspec eagle", False, 1.0, heads=heads)]
    if draft_vocab is not None:
        field_.append(selfspec_contender(model, f"selfspec eagle{suffix}", False, 1.0, heads=heads,
                                         draft_vocab=draft_vocab))  # fmt: skip
    field_.append(selfspec_contender(model, f"selfspec eagle tree{suffix}", False, 1.0, heads=heads,
                                     draft_vocab=draft_vocab, tree=EAGLE_TREE))  # fmt: skip
    field_.append(selfspec_contender(model, f"selfspec hybrid ngram + eagle{suffix}", False, 1.0, drafter="hybrid",
                                     heads=heads, draft_vocab=draft_vocab, **lookup))  # fmt: skip
    if temperature is not None:
        field_.append(selfspec_contender(model, f"selfspec eagle T={temperature}{suffix}", True, temperature,
                                         heads=heads, draft_vocab=draft_vocab))  # fmt: skip
    return field_


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def run_bench(
    contenders: list[Contender],
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    repeats: int = 1,
    seed: int = 0,
    progress: bool = True,
) -> list[dict]:
    """Run every contender on every prompt `repeats` times, interleaved; return one summary per contender."""
    from tqdm.auto import tqdm

    device = prompts[0].device
    by_length = sorted(prompts, key=lambda prompt: prompt.shape[1])
    for contender in contenders:  # warm-up: first-call allocations and lazy initialisation are not timed
        if contender.compiled:  # the longest call first (the largest cache), then another length: every graph
            for prompt in (by_length[-1], by_length[0]):
                contender.run(prompt, max_new_tokens)
        else:
            contender.run(prompts[0], min(8, max_new_tokens))
    bar = tqdm(total=repeats * len(prompts) * len(contenders), desc="bench", disable=not progress, leave=False)
    for repeat in range(repeats):
        for index, prompt in enumerate(prompts):
            reference = None
            order = contenders[repeat % len(contenders) :] + contenders[: repeat % len(contenders)]
            outputs = {}
            for contender in order:
                torch.manual_seed(seed + 1000 * repeat + index)
                _synchronize(device)
                started = time.perf_counter()
                output = contender.run(prompt, max_new_tokens)
                _synchronize(device)
                contender.seconds.append(time.perf_counter() - started)
                contender.tokens.append(output.shape[1] - prompt.shape[1])
                contender.prompt_indices.append(index)
                if contender.spec is not None:
                    contender.stats.append(contender.spec.stats.to_dict())
                outputs[contender.name] = output
                if contender.baseline and not contender.sampling:  # the reference: kept to be shown
                    contender.outputs.append(output)
                bar.update(1)
            reference = next(outputs[c.name] for c in contenders if c.baseline and not c.sampling)
            model = next(c.model for c in contenders if c.baseline and not c.sampling)
            for contender in contenders:
                if contender.sampling:
                    continue
                output = outputs[contender.name]
                verdict = (
                    torch.equal(output, reference)
                    if model is None
                    else compare_greedy(model, prompt, reference, output)
                )
                contender.matched.append(verdict)
    bar.close()
    return summarize(contenders)


def left_pad(prompts: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, n_i] prompts -> left-padded ids [rows, width] and their attention mask."""
    width = max(p.shape[1] for p in prompts)
    ids = prompts[0].new_full((len(prompts), width), pad_id)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.shape[1] :], mask[row, width - prompt.shape[1] :] = prompt[0], 1
    return ids, mask


@torch.no_grad()
def batch_throughput(
    spec: SelfSpeculative, prompts: list[torch.Tensor], sizes: list[int], max_new_tokens: int, repeats: int = 1
) -> list[dict]:
    """Tokens/s of batched `model.generate` and of `spec` at each batch size (rows cycle through the prompts),
    alternating run by run; tokens are generated positions summed over the rows."""
    from tqdm.auto import tqdm

    model, device = spec.model, prompts[0].device
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else 0
    rows = []
    for size in tqdm(sizes, desc="batch sizes", leave=False):
        ids, mask = left_pad([prompts[i % len(prompts)] for i in range(size)], pad)
        runs = {"generate": model.generate, "selfspec": spec.generate}
        settings = {"attention_mask": mask, "max_new_tokens": max_new_tokens, "do_sample": False}
        rates: dict[str, list[float]] = {name: [] for name in runs}
        outputs, proposed, passes = {}, 0, 0
        for repeat in range(repeats + 1):  # the first round warms up and is not counted
            for name in list(runs)[:: 1 if repeat % 2 else -1]:
                _synchronize(device)
                started = time.perf_counter()
                outputs[name] = runs[name](ids, **settings)
                _synchronize(device)
                if repeat:
                    rates[name].append(size * (outputs[name].shape[1] - ids.shape[1]) / (time.perf_counter() - started))
                    if name == "selfspec":
                        proposed, passes = proposed + spec.stats.proposed, passes + spec.stats.row_passes
        plain, fast = statistics.median(rates["generate"]), statistics.median(rates["selfspec"])
        rows.append({
            "batch_size": size,
            "generate_tokens_per_s": plain,
            "selfspec_tokens_per_s": fast,
            "speedup": fast / plain,
            "mean_gamma": proposed / passes if passes else 0.0,
            "matched": torch.equal(outputs["generate"], outputs["selfspec"]),
        })  # fmt: skip
    return rows


def batch_table(rows: list[dict]) -> str:
    lines = [
        "| batch size | generate tokens/s | selfspec tokens/s | speedup | mean gamma per row and pass | greedy match |"
    ]
    lines.append("|---|---|---|---|---|---|")
    for row in rows:
        lines.append(
            f"| {row['batch_size']} | {row['generate_tokens_per_s']:.1f} | {row['selfspec_tokens_per_s']:.1f} | "
            f"{row['speedup']:.2f}x | {row['mean_gamma']:.2f} | {'yes' if row['matched'] else 'NO'} |"
        )
    return "\n".join(lines)


def _rate(contender: Contender) -> float:
    return statistics.median(t / s for t, s in zip(contender.tokens, contender.seconds, strict=True))


def summarize(contenders: list[Contender]) -> list[dict]:
    """Median tokens/s, speedups, acceptance, measured c and v, and the predicted speedup per contender."""
    baselines = {c.sampling: _rate(c) for c in contenders if c.baseline}
    compiled_generate = next((_rate(c) for c in contenders if c.compiled and c.spec is None), None)
    steps = {}  # the plain loop's time per token, eager and compiled
    for plain in (c for c in contenders if c.plain_loop and c.compiled not in steps):
        steps[plain.compiled] = statistics.median(s / t for t, s in zip(plain.tokens, plain.seconds, strict=True))
    rows = []
    for contender in contenders:
        rate, step = _rate(contender), steps.get(contender.compiled)
        row = {
            "contender": contender.name,
            "sampling": contender.sampling,
            "tokens_per_s": rate,
            "speedup": rate / baselines.get(contender.sampling, baselines[False]),
            "vs_compiled_generate": rate / compiled_generate if compiled_generate and not contender.sampling else None,
            "matched": match_summary(contender.matched),
            "ties": sum(verdict == TIE for verdict in contender.matched),
            "runs": len(contender.seconds),
        }
        if contender.spec is not None:
            row.update(added_memory(contender.spec))
        if contender.stats:
            row.update(_acceptance(contender, step))
        rows.append(row)
    return rows


def match_summary(verdicts: list) -> bool | str | None:
    """Over a contender's greedy runs: True if all were identical to model.generate, False if any differed
    other than at a tie, else `TIE` (see `selfspec.ties`); None for sampling contenders."""
    if not verdicts:
        return None
    if any(verdict is False for verdict in verdicts):
        return False
    return True if all(verdict is True for verdict in verdicts) else TIE


def _bytes(tensors) -> int:
    unique = {t.data_ptr(): t for t in tensors}  # tied or shared tensors count once
    return sum(t.numel() * t.element_size() for t in unique.values())


def added_memory(spec: SelfSpeculative) -> dict:
    """What drafting adds to the model's memory: the heads' weights and any draft copy of LM-head rows
    (reduced vocabulary, int8), in MB and as a share of the model's parameter bytes."""
    tensors = [*spec.heads.parameters(), *spec.heads.buffers()] if spec.heads is not None else []
    for drafter in spec.drafters:
        vocab = getattr(drafter, "vocab", None)
        if vocab is not None:
            tensors += [t for t in (vocab.ids, vocab.weight, vocab.bias, vocab.scales) if t is not None]
    added = _bytes(tensors)
    return {"heads_mb": added / 2**20, "heads_share": added / _bytes(spec.model.parameters())}


def _acceptance(contender: Contender, step: float | None) -> dict:
    """Acceptance and costs over all runs of one selfspec contender, and the equation's prediction."""
    total = sum_stats(contender.stats)
    alphas = [s["alpha"] for s in contender.stats if s["alpha"] == s["alpha"]]  # NaN when nothing was drafted
    out = {
        "alpha_hat": total["accepted"] / total["proposed"] if total["proposed"] else None,
        "alpha": statistics.fmean(alphas) if alphas else None,
        "tokens_per_pass": total["new_tokens"] / total["row_passes"],
        "gamma": total["proposed"] / total["iterations"] if total["iterations"] else 0.0,
    }
    if step and total["iterations"]:
        passes = total["iterations"]
        out["c"] = total["draft_seconds"] / total["proposed"] / step if total["proposed"] else None
        out["v"] = total["verify_seconds"] / passes / step
        if out["alpha"] is not None and not contender.tree:
            gamma = max(1, round(out["gamma"]))
            out["predicted_speedup"] = predicted_speedup(out["alpha"], gamma, out["c"], out["v"])
        out["plain_loop_speedup"] = step * total["new_tokens"] / sum(contender.seconds)
    return out


COLUMNS = [
    ("contender", "contender", "{}"),
    ("tokens_per_s", "tokens/s", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("vs_compiled_generate", "vs generate compiled", "{:.2f}x"),
    ("matched", "greedy match", "{}"),
    ("alpha_hat", "alpha_hat", "{:.3f}"),
    ("alpha", "alpha", "{:.3f}"),
    ("tokens_per_pass", "tokens/pass", "{:.2f}"),
    ("gamma", "mean gamma", "{:.2f}"),
    ("c", "c", "{:.3f}"),
    ("v", "v", "{:.2f}"),
    ("predicted_speedup", "predicted", "{:.2f}x"),
    ("plain_loop_speedup", "realised vs plain loop", "{:.2f}x"),
    ("heads_mb", "heads MB", "{:.1f}"),
    ("heads_share", "heads / model", "{:.1%}"),
]


def markdown_table(rows: list[dict], columns=COLUMNS) -> str:
    """The summaries as a Markdown table ('-' where a figure does not apply; no column where none does)."""
    columns = [column for column in columns if column[0] == "contender" or any(row.get(column[0]) is not None
                                                                               for row in rows)]  # fmt: skip

    def cell(row, key, fmt):
        value = row.get(key)
        if value is None:
            return "-"
        if key == "matched":
            return {True: "yes", False: "NO"}.get(value, f"tie ({row['ties']})")
        return fmt.format(value)

    lines = ["| " + " | ".join(title for _, title, _ in columns) + " |"]
    lines.append("|" + "|".join("---" for _ in columns) + "|")
    lines += ["| " + " | ".join(cell(row, key, fmt) for key, _, fmt in columns) + " |" for row in rows]
    return "\n".join(lines)


def plot_speedups(rows: list[dict], path: str | Path, title: str) -> None:
    """PNG: horizontal bars of the realised speedup per contender, the predicted one as a marker."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    names = [row["contender"] for row in rows][::-1]
    figure, axes = plt.subplots(figsize=(7, 0.35 * len(rows) + 1.2))
    axes.barh(names, [row["speedup"] for row in rows][::-1], color="tab:blue", label="realised")
    predicted = [(i, row["predicted_speedup"]) for i, row in enumerate(rows[::-1]) if row.get("predicted_speedup")]
    if predicted:
        axes.plot([p for _, p in predicted], [i for i, _ in predicted], "k|", markersize=14, label="predicted")
    axes.axvline(1.0, color="grey", linewidth=1)
    axes.set_xlabel("speedup over model.generate (same sampling mode)")
    axes.set_title(title)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write_json(rows: list[dict], path: str | Path, meta: dict) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "results": rows}, indent=1) + "\n", encoding="utf-8")


def load_prompts(path: str | Path) -> list[str]:
    """Prompts from a .json list (strings, or objects with a `prompt` or `text` field) or a .jsonl file."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        items = json.loads(text)
    elif path.suffix == ".jsonl":
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        raise ValueError(f"{path}: prompts must be a .json list or a .jsonl file, one prompt per line")
    prompts = []
    for number, item in enumerate(items, 1):
        prompt = item if isinstance(item, str) else (item.get("prompt") or item.get("text"))
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}: item {number} has no prompt (a string, or a `prompt` or `text` field)")
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts
