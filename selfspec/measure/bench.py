"""Side-by-side speed: every contender (`selfspec.measure.contenders`) runs on the same prompts and token budget,
interleaved run by run, and the summaries, overall and by Spec-Bench category.

Runs interleave (prompt by prompt, the contenders' order rotating each repeat), so a machine that slows down or
speeds up mid-way affects every contender alike; each figure is a median over runs, and each ratio compares figures
from the same session: the speedup two medians, the paired speedup each run with the baseline's on the same prompt.
Greedy outputs are checked against `model.generate`'s (`selfspec.measure.ties`).

For each selfspec contender the measured costs are put back into the speedup equation of docs/design.md:
c = draft time per drafted token and v = time per verify pass, both over the selfspec plain loop's time per
full-model pass while decoding (its passes alone, without the loop's own bookkeeping, which the equation leaves out
too), and S = E(alpha, gamma) / (v + gamma c) with the measured analytic alpha and the mean gamma, next to the speedup
realised over the plain loop while decoding (tokens after the first over the time after the prompt's pass, the
bookkeeping included). All three leave the prompt's pass out (it is no decoding step, and a run that decodes in
fewer passes would otherwise carry more of it per pass) and sum the times over the runs before dividing, so the
plain loop reads v = 1 and 1.00x against itself.
"""

from __future__ import annotations

import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from ..drafters.suffix import SuffixDrafter
from ..engine.adaptive import predicted_speedup
from ..engine.stats import decoding_seconds, decoding_tokens, sum_stats
from ..speculative import SelfSpeculative
from .contenders import Contender
from .prompts import OVERALL, ChatPrompt, categories_of
from .ties import TIE, compare_greedy


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class OwnAnswers:
    """Keeps a drafter with a memory across calls (`SuffixDrafter`) from drafting a prompt's answer out of its own
    earlier answers to that very prompt (the warm-up's, an earlier repeat's): before each run on a prompt, the
    answers its earlier runs on it left in the memory are dropped. Answers to the other prompts stay. A memory
    inside a merged tree (`MergedTreeDrafter.parts`) counts too."""

    def __init__(self, contenders: list[Contender]):
        self.memories = {
            id(c): [p.cache for d in c.spec.drafters for p in getattr(d, "parts", (d,)) if isinstance(p, SuffixDrafter)]
            for c in contenders
            if c.spec is not None
        }
        self.left: dict[tuple[int, int], list[tuple]] = {}  # (contender, prompt) -> (memory, answer ids)

    def forget(self, contender: Contender, index: int) -> None:
        for memory, uid in self.left.pop((id(contender), index), []):
            if uid in memory.sequences:
                memory.drop(uid)

    @contextmanager
    def kept(self, contender: Contender, index: int):
        """Note which answers the run inside this block left in each memory."""
        memories = self.memories.get(id(contender), [])
        before = [set(memory.sequences) for memory in memories]
        yield
        for memory, known in zip(memories, before, strict=True):
            self.left.setdefault((id(contender), index), []).extend(
                (memory, uid) for uid in set(memory.sequences) - known
            )


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
    answers = OwnAnswers(contenders)
    for contender in contenders:  # warm-up: first-call allocations and lazy initialisation are not timed
        # compiled: the longest call first (the largest cache), then another length: every graph
        runs = [(by_length[-1], max_new_tokens), (by_length[0], max_new_tokens)] if contender.compiled else [
            (prompts[0], min(8, max_new_tokens))]  # fmt: skip
        for prompt, new_tokens in runs:
            with answers.kept(contender, next(i for i, known in enumerate(prompts) if known is prompt)):
                contender.run(prompt, new_tokens)
    bar = tqdm(total=repeats * len(prompts) * len(contenders), desc="bench", disable=not progress, leave=False)
    for repeat in range(repeats):
        for index, prompt in enumerate(prompts):
            reference = None
            order = contenders[repeat % len(contenders) :] + contenders[: repeat % len(contenders)]
            outputs = {}
            for contender in order:
                torch.manual_seed(seed + 1000 * repeat + index)
                answers.forget(contender, index)
                with answers.kept(contender, index):
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


def paired_speedup(contender: Contender, baseline: Contender) -> float:
    """The median over runs of the contender's tokens/s over the baseline's in the same run (the same prompt and
    repeat). `speedup` divides two medians, each over every prompt, whose middle prompts may differ; pairing each
    run with the baseline's on the same prompt takes the prompts' own spread (lengths, categories) out."""
    if contender.prompt_indices != baseline.prompt_indices:
        raise ValueError(f"{contender.name} and {baseline.name} ran different prompts: their runs do not pair")
    runs = zip(contender.tokens, contender.seconds, baseline.tokens, baseline.seconds, strict=True)
    return statistics.median((t / s) / (bt / bs) for t, s, bt, bs in runs)


def summarize(contenders: list[Contender]) -> list[dict]:
    """Median tokens/s, speedups, acceptance, measured c and v, and the predicted speedup per contender."""
    baseline_of = {c.sampling: c for c in contenders if c.baseline}  # sampling contenders without their own: greedy
    compiled_generate = next((_rate(c) for c in contenders if c.compiled and c.spec is None), None)
    units = {}  # the plain loop's decoding figures, eager and compiled: the unit of c and v, and its pace
    for plain in (c for c in contenders if c.plain_loop and c.stats and c.compiled not in units):
        units[plain.compiled] = decoding_unit(sum_stats(plain.stats))
    rows = []
    for contender in contenders:
        rate, unit = _rate(contender), units.get(contender.compiled)
        baseline = baseline_of.get(contender.sampling, baseline_of[False])
        row = {
            "contender": contender.name,
            "sampling": contender.sampling,
            "tokens_per_s": rate,
            "speedup": rate / _rate(baseline),
            "paired_speedup": paired_speedup(contender, baseline),
            "vs_compiled_generate": rate / compiled_generate if compiled_generate and not contender.sampling else None,
            "matched": match_summary(contender.matched),
            "ties": sum(verdict == TIE for verdict in contender.matched),
            "runs": len(contender.seconds),
            "run_prompts": list(contender.prompt_indices),  # each timed run: its prompt, new tokens and seconds
            "run_tokens": list(contender.tokens),
            "run_seconds": list(contender.seconds),
            # a selfspec contender's `GenerationStats` per run, else empty; null where a figure is NaN (strict JSON)
            "run_stats": [_without_nan(stats) for stats in contender.stats],
        }
        if contender.spec is not None:
            row.update(added_memory(contender.spec))
        if contender.stats:
            row.update(_acceptance(contender, unit))
        rows.append(row)
    return rows


def match_summary(verdicts: list) -> bool | str | None:
    """Over a contender's greedy runs: True if all were identical to model.generate, False if any differed
    other than at a tie, else `TIE` (see `selfspec.measure.ties`); None for sampling contenders."""
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
    for part in (part for drafter in spec.drafters for part in getattr(drafter, "parts", (drafter,))):
        vocab = getattr(part, "vocab", None)  # a merged tree's parts draft with their own vocabularies
        if vocab is not None:
            tensors += [t for t in (vocab.ids, vocab.weight, vocab.bias, vocab.scales) if t is not None]
    added = _bytes(tensors)
    return {"heads_mb": added / 2**20, "heads_share": added / _bytes(spec.model.parameters())}


def _without_nan(stats: dict) -> dict:
    return {key: None if isinstance(value, float) and value != value else value for key, value in stats.items()}


def decoding_unit(total: dict) -> tuple[float, float] | None:
    """From the plain loop's summed stats: (seconds per full-model pass while decoding: its passes after the
    prompt's, the loop's bookkeeping left out; tokens per second while decoding), or None where it decoded nothing."""
    if not total.get("iterations"):
        return None
    return (total["verify_seconds"] - total["prefill_seconds"]) / total["iterations"], _decoding_rate(total)


def _decoding_rate(total: dict) -> float:
    """Tokens per second of summed one-prompt stats while decoding: the tokens after each call's first over the time
    after its prompt's pass (`decoding_tokens`, `decoding_seconds`)."""
    return decoding_tokens(total) / decoding_seconds(total)


def _acceptance(contender: Contender, unit: tuple[float, float] | None) -> dict:
    """Acceptance and costs over all runs of one selfspec contender, and the equation's prediction; `unit`: the
    plain loop's `decoding_unit`."""
    total = sum_stats(contender.stats)
    alphas = [s["alpha"] for s in contender.stats if s["alpha"] == s["alpha"]]  # NaN when nothing was drafted
    out = {
        "alpha_hat": total["accepted"] / total["proposed"] if total["proposed"] else None,
        "alpha": statistics.fmean(alphas) if alphas else None,
        "tokens_per_pass": total["new_tokens"] / total["row_passes"],
        "gamma": total["proposed"] / total["iterations"] if total["iterations"] else 0.0,
        "fixed_gamma": contender.spec is not None and not contender.spec.adaptive,
        "accepted_per_position": total.get("accepted_per_position", []),
        "proposed_per_position": total.get("proposed_per_position", []),
    }
    if unit is not None and total["iterations"]:
        step, plain_rate = unit
        out["c"] = total["draft_seconds"] / total["proposed"] / step if total["proposed"] else None
        out["v"] = (total["verify_seconds"] - total["prefill_seconds"]) / total["iterations"] / step
        if out["alpha"] is not None and not contender.tree:
            gamma = max(1, round(out["gamma"]))
            out["predicted_speedup"] = predicted_speedup(out["alpha"], gamma, out["c"], out["v"])
        out["plain_loop_speedup"] = _decoding_rate(total) / plain_rate
    return out


COLUMNS = [
    ("contender", "contender", "{}"),
    ("tokens_per_s", "tokens/s", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("paired_speedup", "paired speedup", "{:.2f}x"),
    ("vs_compiled_generate", "vs generate compiled", "{:.2f}x"),
    ("matched", "greedy match", "{}"),
    ("alpha_hat", "alpha_hat", "{:.3f}"),
    ("alpha", "alpha", "{:.3f}"),
    ("tokens_per_pass", "tokens/pass", "{:.2f}"),
    ("gamma", "mean gamma", "{:.2f}"),
    ("c", "c", "{:.3f}"),
    ("v", "v", "{:.2f}"),
    ("predicted_speedup", "predicted", "{:.2f}x"),
    ("plain_loop_speedup", "decoding vs plain loop", "{:.2f}x"),
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


def position_table(rows: list[dict], max_positions: int = 8) -> str:
    """Markdown: per selfspec contender, tokens per pass and its acceptance at draft positions 1, 2, ...:
    unconditional (accepted / proposed there: every earlier draft was accepted too) and, in brackets for
    fixed gamma, conditional (given the draft before it was accepted; with adaptive gamma an iteration may
    stop before a position, so the ratio would not be that probability)."""
    rows = [row for row in rows if row.get("proposed_per_position")]
    width = min(max_positions, max(len(row["proposed_per_position"]) for row in rows)) if rows else 0
    lines = [
        "| contender | tokens/pass | " + " | ".join(f"position {k + 1}" for k in range(width)) + " |",
        "|---|---:|" + "---:|" * width,
    ]
    for row in rows:
        accepted, proposed = row["accepted_per_position"], row["proposed_per_position"]
        cells = []
        for k in range(width):
            if k >= len(proposed) or not proposed[k]:
                cells.append("-")
                continue
            given = accepted[k - 1] if k else proposed[k]
            conditional = f" ({accepted[k] / given:.2f})" if k and given and row.get("fixed_gamma") else ""
            cells.append(f"{accepted[k] / proposed[k]:.3f}{conditional}")
        lines.append(f"| {row['contender']} | {row['tokens_per_pass']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summarize_by_category(contenders: list[Contender], prompts: list[ChatPrompt]) -> dict[str, list[dict]]:
    """`summarize` over each category's prompts alone, then over all of them (`overall`)."""
    by_category = {}
    for category in categories_of(prompts):
        indices = {i for i, prompt in enumerate(prompts) if prompt.category == category}
        by_category[category] = summarize([contender.runs_on(indices) for contender in contenders])
    by_category[OVERALL] = summarize(contenders)
    return by_category


def category_report(by_category: dict[str, list[dict]], prompts: list[ChatPrompt]) -> str:
    """Markdown: one table per category and overall, then the speedups side by side."""
    counts = {c: sum(p.category == c for p in prompts) for c in by_category if c != OVERALL}
    counts[OVERALL] = len(prompts)
    parts = [f"### {category} ({counts[category]} prompts)\n\n{markdown_table(rows)}" for category, rows in
             by_category.items()]  # fmt: skip
    parts.append("### speedup by category\n\n" + speedup_table(by_category))
    if any(row.get("proposed_per_position") for row in by_category[OVERALL]):
        parts.append(
            "### acceptance by draft position, overall: accepted / proposed (given the earlier position)\n\n"
            + position_table(by_category[OVERALL])
        )
    return "\n\n".join(parts)


def speedup_table(by_category: dict[str, list[dict]]) -> str:
    """Markdown: a row per contender, its speedup in each category and overall."""
    names = [row["contender"] for row in by_category[OVERALL]]
    merged = [{"contender": name} for name in names]
    for category, rows in by_category.items():
        for row, summary in zip(merged, rows, strict=True):
            row[category] = summary["speedup"]
    columns = [("contender", "contender", "{}")] + [(category, category, "{:.2f}x") for category in by_category]
    return markdown_table(merged, columns)
