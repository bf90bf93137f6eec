"""Measure draft heads on held-out text: evaluation, the alpha / c / speedup table, its plot and card.

Shared by `training/train_heads.py` (held-out evaluation during training) and `selfspec profile`; the text
itself comes from `selfspec.training.data`.
"""

from __future__ import annotations

import netrc
import os
import socket
from collections.abc import Callable
from urllib.parse import urlparse

import torch
from torch import nn

from ..adapter import DraftVocabulary, ModelAdapter
from ..heads import DraftHeads
from ..heads.base import Costs
from ..training.config import EvalConfig, TrainHeadsConfig
from ..training.distill import score_sums, target_pass
from .bench import markdown_table
from .costs import measure_costs

METRICS = ("kl", "alpha", "top1", "chain")
COLUMNS = {"kl": 0, "alpha": 1, "top1": 2, "chain": 4}  # of `score_sums`; column 3 counts the positions
FIRST = ("first_top1", "first_chain", "first_tokens")  # `with_first_tokens`


# ---------------------------------------------------------------------------------------- evaluate


@torch.no_grad()
def evaluate(
    model: nn.Module,
    adapter: ModelAdapter,
    heads: dict[str, DraftHeads],
    rows: torch.Tensor,
    batch_size: int,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    vocabs: dict[str, DraftVocabulary] | None = None,
    masks: torch.Tensor | dict[str, torch.Tensor | None] | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """Mean KL, alpha, top-1 agreement and chain agreement (`score_sums`) per draft of each heads set,
    {label: {draft: {metric: value}}}, from one target forward per batch of `rows`, over the positions that
    `masks` marks (all without them; a dict gives each label its own); `reduce` sums the totals over
    processes; `vocabs` gives a set's draft LM head (reduced or int8) by label."""
    totals = {label: None for label in heads}
    device = adapter.device
    masks = masks if isinstance(masks, dict) else dict.fromkeys(heads, masks)
    mask_batches = {label: m.split(batch_size) if m is not None else None for label, m in masks.items()}
    for index, batch in enumerate(rows.split(batch_size)):
        hidden_states, logits = target_pass(model, batch.to(device))
        for label, h in heads.items():
            mask = mask_batches[label][index].to(device) if mask_batches[label] is not None else None
            sums = score_sums(h, adapter, hidden_states, logits, (vocabs or {}).get(label), mask)
            totals[label] = sums if totals[label] is None else totals[label] + sums
    result = {}
    for label, h in heads.items():
        sums = totals[label] if totals[label] is not None else torch.zeros(len(h.draft_names()), 5, device=device)
        if reduce is not None:
            sums = reduce(sums)
        result[label] = {
            name: {metric: (row[COLUMNS[metric]] / row[3].clamp(min=1)).item() for metric in METRICS}
            for name, row in zip(h.draft_names(), sums, strict=True)
        }
    return result


def first_of_each_answer(masks: torch.Tensor, count: int) -> torch.Tensor:
    """`masks` (`[rows, seq_len]` bool, `row_tensors`) kept at the first `count` positions of each run of marked
    positions that starts within its row: the first `count` tokens of each answer. A run at a row's start is left
    out (packing cut the answer there: its first tokens are in the row before), so plain text, one run per row,
    keeps nothing."""
    length = masks.shape[-1]
    index = torch.arange(length, device=masks.device).expand_as(masks)
    # the last unmarked position at or before each one; far below 0 before a row's first, so that run is dropped
    last_unmarked = torch.where(masks, -(length + count + 1), index).cummax(dim=-1).values
    return masks & (index - last_unmarked <= count)


def with_first_tokens(scores: dict, first: dict, tokens: int) -> dict:
    """`scores` per draft (`evaluate`'s) with `first`'s top-1 and chain, measured on the first `tokens` of each
    answer alone (`first_of_each_answer`), added as first_top1 and first_chain (and first_tokens: N)."""
    for draft, measured in first.items():
        scores[draft].update(first_top1=measured["top1"], first_chain=measured["chain"], first_tokens=tokens)
    return scores


def untrained_like(heads: DraftHeads) -> DraftHeads:
    """Fresh heads of the same shape (`DraftHeads.untrained_copy`): each draft is the untrained exit (or the
    target's next-token head)."""
    return heads.untrained_copy()


def measure(
    adapter: ModelAdapter,
    heads: DraftHeads,
    rows: torch.Tensor,
    config: EvalConfig,
    vocab: DraftVocabulary | None = None,
) -> Costs:
    """c per draft (and v(gamma) when `config.measure_v`), timed after the first `timing_context` tokens of `rows`."""
    max_gamma = config.max_gamma if config.measure_v else 0
    tokens = rows.flatten()[: config.timing_context + max(max_gamma, 1) + 1][None].to(adapter.device)
    return measure_costs(adapter, heads, tokens, config.timing_repeats, max_gamma, vocab)


def profile_heads(
    model: nn.Module,
    heads: DraftHeads,
    rows: torch.Tensor,
    config: EvalConfig,
    trained: bool = True,
    vocab: DraftVocabulary | None = None,
    masks: torch.Tensor | None = None,
):
    """Report rows (see `report_rows`) for `heads` on held-out `rows` (at the positions `masks` marks: a chat's
    answers), untrained and (if `trained`) these heads, measured c and the predicted speedup; with a draft LM
    head `vocab` (reduced or int8), also alpha, top-1 and c of the heads drafting through it (`draft_alpha`,
    `draft_top1`, `draft_c`): the alpha / c trade-off."""
    adapter = ModelAdapter(model, packed_weights=None)  # SelfSpeculative's default rule
    sets = {"untrained": heads.untrained_copy(), "trained": heads} if trained else {"untrained": heads}
    if vocab is not None:
        sets["draft head"] = heads
    masks = dict.fromkeys(sets, masks[: config.max_rows] if masks is not None else None)
    if trained and masks["trained"] is not None and config.answer_tokens:  # the answers' first tokens alone
        first = first_of_each_answer(masks["trained"], config.answer_tokens)
        if first.any():  # plain text has no answers
            sets["first"], masks["first"] = heads, first
    scores = evaluate(model, adapter, sets, rows[: config.max_rows], config.batch_size, vocabs={"draft head": vocab},
                      masks=masks)  # fmt: skip
    costs = measure(adapter, heads, rows, config)
    if "first" in scores:
        with_first_tokens(scores["trained"], scores["first"], config.answer_tokens)
    result = report_rows(heads, scores["untrained"], scores.get("trained"), costs, config.max_gamma)
    if vocab is not None:
        draft_costs = measure(adapter, heads, rows, config, vocab)
        for row in result:
            scored = scores["draft head"][row["draft"]]
            row.update(draft_alpha=scored["alpha"], draft_top1=scored["top1"], draft_c=draft_costs.c(row["draft"]))
    return result


# ----------------------------------------------------------------------------------------- report


def report_rows(
    heads: DraftHeads,
    untrained: dict[str, dict[str, float]],
    trained: dict[str, dict[str, float]] | None,
    costs: Costs | None,
    max_gamma: int,
    baseline: str = "untrained",
) -> list[dict]:
    """One row per draft: its depth (exit layer or Medusa head), untrained and trained figures, c, gamma, S.
    `baseline` names what the untrained figures are of ("start" for heads that training started from)."""
    best = trained or untrained
    speed = heads.speedups({n: s["alpha"] for n, s in best.items()}, costs, max_gamma) if costs else {}
    rows = []
    for name in heads.draft_names():
        row = {"draft": name, "depth": int(name.rsplit("_", 1)[1]), "baseline": baseline}
        # .get: a checkpoint written before a metric existed holds its baseline without it
        row.update({f"untrained_{metric}": untrained[name].get(metric, float("nan")) for metric in METRICS})
        if trained is not None:
            row.update({metric: trained[name][metric] for metric in METRICS})
            # greedy acceptance of draft j given drafts 1..j-1 were accepted (the chain's agreement ratio)
            before = rows[-1]["chain"] if rows else 1.0
            row["conditional"] = row["chain"] / before if before > 0 else 0.0
            row.update({key: trained[name][key] for key in FIRST if key in trained[name]})
        row.update(speed.get(name, {}))
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows as an aligned console / Markdown table."""
    baseline = rows[0].get("baseline", "untrained") if rows else "untrained"
    columns = [("draft", "draft", "{}"), ("untrained_alpha", f"{baseline} alpha", "{:.3f}")]
    columns += [("untrained_top1", f"{baseline} top-1", "{:.3f}")]
    if rows and "alpha" in rows[0]:
        columns += [("alpha", "trained alpha", "{:.3f}"), ("top1", "trained top-1", "{:.3f}"), ("kl", "KL", "{:.3f}")]
        if not rows[0]["draft"].startswith("exit"):  # drafts that form a chain: its greedy acceptance by depth
            columns += [("chain", "chain top-1", "{:.3f}"), ("conditional", "top-1 given the earlier", "{:.3f}")]
    if rows and "c" in rows[0]:
        columns += [("c", "c", "{:.3f}"), ("gamma", "best gamma", "{}"), ("speedup", "predicted speedup", "{:.2f}x")]
    if rows and "draft_alpha" in rows[0]:
        columns += [("draft_alpha", "alpha, draft head", "{:.3f}"), ("draft_top1", "top-1, draft head", "{:.3f}")]
        columns += [("draft_c", "c, draft head", "{:.3f}")]
    if rows and "copy_top1" in rows[0]:
        columns += [("copy_top1", "top-1 on copy rows", "{:.3f}")]
    if rows and "first_top1" in rows[0]:
        first = f"first {rows[0]['first_tokens']} of each answer"
        columns += [("first_top1", f"top-1, {first}", "{:.3f}")]
        if not rows[0]["draft"].startswith("exit"):
            columns += [("first_chain", f"chain top-1, {first}", "{:.3f}")]
    cells = [[title for _, title, _ in columns]] + [[fmt.format(row[key]) for key, _, fmt in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) + " |" for line in cells]
    lines.insert(1, "|" + "|".join("-" * (width + 2) for width in widths) + "|")
    return "\n".join(lines)


def plot_alpha(rows: list[dict], path: str | os.PathLike, title: str = "") -> None:
    """PNG: alpha against exit depth (or Medusa head), untrained and (if present) trained, and the trained
    drafts' top-1 agreement (the greedy acceptance rate), each line labelled with what it measures."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    from matplotlib import pyplot as plt

    medusa = rows[0]["draft"].startswith("medusa")
    depths = [row["depth"] for row in rows]
    figure, axes = plt.subplots(figsize=(6, 4))
    baseline = rows[0].get("baseline", "untrained")
    axes.plot(depths, [row["untrained_alpha"] for row in rows], "o--", label=f"{baseline}: alpha")
    if "alpha" in rows[0]:
        axes.plot(depths, [row["alpha"] for row in rows], "o-", label="trained: alpha")
        axes.plot(depths, [row["top1"] for row in rows], "x:", label="trained: top-1 agreement (greedy)")
    axes.set_xlabel("Medusa head (predicts token t+2+i)" if medusa else "exit layer")
    # two measures share the axis: alpha = 1 - TV(p, q) (sampling) and top-1 agreement (greedy acceptance)
    axes.set_ylabel("acceptance rate")
    axes.set_ylim(0, 1)
    axes.set_xticks(depths)
    axes.grid(alpha=0.3)
    axes.legend()
    axes.set_title(title or "acceptance rate per draft depth")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def heads_card(
    config: TrainHeadsConfig, heads: DraftHeads, rows: list[dict], facts: dict, lora_table: str | None = None
) -> str:
    """The README.md of a heads folder written by training/train_heads.py: target, data, the commands, steps,
    held-out figures per draft (`report_rows`), what a draft LoRA buys (`lora_comparison_table`);
    `facts` as that script's training_summary.json holds them."""
    fp = heads.fingerprint
    kind = heads.description()
    commands = "\n".join(facts["commands"])
    return f"""# selfspec {heads.kind} heads for `{config.target.name_or_path}`

{kind[0].upper() + kind[1:]} trained by self-distillation on the frozen target: each draft learns KL(p || q) with
p the target's own next-token distribution at temperature 1 (for Medusa head i, the target at position t+1+i;
for EAGLE step i, drafting i+1 tokens after the last true feature, on the head's own fed-back outputs).

- Target: `{fp.name_or_path}` ({fp.model_type}, {fp.num_hidden_layers} layers, hidden {fp.hidden_size}, vocab \
{fp.vocab_size}){f", peft adapter `{config.target.adapter_path}`" if config.target.adapter_path else ""}; \
its weights are unchanged (SHA-256 {facts["target_digest"][:16]}... before and after).
- Data: `{facts["data"]["source"]}`: {facts["data"]["train_rows"]} training rows, {facts["data"]["heldout_rows"]} \
held-out rows of {facts["data"]["seq_len"]} tokens (held out by {facts["data"]["heldout_by"]}).
- Training: {facts["steps"]} steps of {config.train.batch_size * config.train.gradient_accumulation_steps} rows \
({facts["tokens_seen"]:,} tokens), lr {config.train.lr}, {facts["processes"]} process(es), mixed precision \
{facts["mixed_precision"]}, {facts["elapsed_s"]:.0f} s.

```
{commands}
```

## Held-out acceptance

alpha = mean over held-out positions of sum_x min(p(x), q(x)) (analytic acceptance rate at temperature 1);
top-1 = argmax q == argmax p (greedy acceptance). c = time of one draft token over one full decoding step,
measured on {facts["device"]}; predicted speedup S(gamma) = (1 - alpha^(gamma+1)) / ((1 - alpha)(v + gamma c))
at the best gamma (v = 1 unless measured; Medusa: a chain of the first gamma heads). Measure real speedups:
the closed form assumes i.i.d. acceptances.

{format_table(rows)}
{lora_section(config, heads, lora_table)}
## Use

```python
from selfspec import SelfSpeculative
spec = SelfSpeculative(model, heads="{config.heads_dir}")
```
"""


def lora_comparison_table(on: dict, off: dict, baseline: dict | None = None) -> str:
    """Markdown: held-out alpha and top-1 per draft with the draft LoRA, with it switched off (the same heads)
    and of `baseline` heads trained without one. Each argument: {draft: {"alpha": ..., "top1": ...}}."""
    columns = [("draft", "draft", "{}"), ("on", "alpha, adapter on", "{:.3f}")]
    columns += [("off", "alpha, adapter off (same heads)", "{:.3f}")]
    if baseline is not None:
        columns += [
            ("baseline", "alpha, heads trained without adapter", "{:.3f}"),
            ("gain", "gain over them", "{:+.3f}"),
        ]
        columns += [("top1", "top-1 on / without", "{}")]
    rows = []
    for name, scores in on.items():
        row = {"draft": name, "on": scores["alpha"], "off": off[name]["alpha"]}
        if baseline is not None:
            base = baseline[name]
            row.update(baseline=base["alpha"], gain=scores["alpha"] - base["alpha"],
                       top1=f"{scores['top1']:.3f} / {base['top1']:.3f}")  # fmt: skip
        rows.append(row)
    return markdown_table(rows, columns)


def lora_section(config: TrainHeadsConfig, heads: DraftHeads, table: str | None) -> str:
    if heads.draft_lora is None or table is None:
        return ""
    lora = heads.draft_lora
    baseline = config.lora.baseline_heads
    baseline = f", and of the heads at `{baseline}` (the same config, no adapter)" if baseline else ""
    return f"""
## Draft-only LoRA on the LM head

A LoRA adapter (peft; r = {lora.r}, lora_alpha = {lora.lora_alpha:g}, scaling {lora.scaling:g}) on the shared LM head,
trained with the heads. Drafts read W h + scaling B A h; the verify pass runs the unmodified target (the adapter
is never applied there), so outputs stay exact and only alpha moves. Held-out alpha of these heads with the
adapter and with it switched off{baseline}:

{table}
"""


def wandb_objects(rows: list[dict]) -> dict:
    """A W&B table of the rows and a line plot of alpha against depth (untrained, trained), for `run.log`."""
    import wandb

    keys = list(rows[0])
    table = wandb.Table(columns=keys, data=[[row[key] for key in keys] for row in rows])
    series = [key for key in ("untrained_alpha", "alpha") if key in keys]
    medusa = rows[0]["draft"].startswith("medusa")
    plot = wandb.plot.line_series(
        xs=[row["depth"] for row in rows],
        ys=[[row[key] for row in rows] for key in series],
        keys=["untrained" if key.startswith("untrained") else "trained" for key in series],
        title="alpha per draft depth",
        xname="Medusa head" if medusa else "exit layer",
    )
    return {"alpha_by_depth": table, "alpha_by_depth_plot": plot}


def configure_wandb(mode: str) -> str:
    """Set WANDB_MODE (unless the environment already does): `auto` is online only with credentials (an API
    key in the environment or a `wandb login` entry) and a reachable server, else offline."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if mode == "auto":
        host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
        try:
            logged_in = bool(os.environ.get("WANDB_API_KEY")) or netrc.netrc().authenticators(host) is not None
        except (OSError, netrc.NetrcParseError):
            logged_in = False
        reachable = False
        if logged_in:
            try:
                socket.create_connection((host, 443), timeout=3).close()
                reachable = True
            except OSError:
                pass
        mode = "online" if reachable else "offline"
    os.environ["WANDB_MODE"] = mode
    return mode
