"""Measure draft heads on held-out text: data, evaluation, the alpha / c / speedup table and its plot.

Shared by `training/train_heads.py` (held-out evaluation during training) and `selfspec profile`.
Data: local files by glob (text files are one document each, `.jsonl`/`.json` one per row, `.parquet` one
per row, with a text field or chat `messages` rendered by the tokenizer's chat template) or a hub data
set, read with `datasets`, tokenised with the target's tokenizer, joined by EOS and cut into rows of a
fixed length; a held-out split by file or by a seeded fraction of the documents.
"""

from __future__ import annotations

import glob
import json
import netrc
import os
import socket
import sysconfig
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import datasets
import torch
from torch import nn

from .adapter import ModelAdapter
from .config import DataConfig, EvalConfig, TrainHeadsConfig
from .distill import Costs, draft_names, measure_costs, score_sums, speedup_table, target_pass
from .heads import DraftHeads, ExitHeads, MedusaHeads

JSON_SUFFIXES = {".json", ".jsonl"}
PARQUET_SUFFIXES = {".parquet"}
METRICS = ("kl", "alpha", "top1")


# --------------------------------------------------------------------------------------------- data


def expand_globs(patterns: str, exclude: str | None = None, required: bool = True) -> list[str]:
    """Files matching comma-separated globs (a folder means every file under it) and none of the `exclude`
    globs, sorted per pattern, without repeats; a pattern that matches nothing raises if `required`."""
    stdlib = sysconfig.get_paths()["stdlib"]
    excluded = set(expand_globs(exclude, required=False)) if exclude else set()
    found: dict[str, None] = {}
    for pattern in (part.strip() for part in patterns.split(",")):
        if not pattern:
            continue
        pattern = os.path.expanduser(pattern.replace("{stdlib}", stdlib))
        if os.path.isdir(pattern):
            pattern = os.path.join(pattern, "**", "*")
        matches = sorted(path for path in glob.glob(pattern, recursive=True) if os.path.isfile(path))
        if not matches and required:
            raise FileNotFoundError(f"data: no file matches {pattern!r}")
        found.update(dict.fromkeys(path for path in matches if path not in excluded))
    return list(found)


def _render(rows: datasets.Dataset, config: DataConfig, tokenizer, origin: str) -> datasets.Dataset:
    """A dataset with one `text` column: the text field, or chat messages through the chat template."""
    if config.messages_field in rows.column_names:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{origin} has chat `{config.messages_field}` but the tokenizer has no chat template")

        def render(batch):
            return {"text": [tokenizer.apply_chat_template(m, tokenize=False) for m in batch[config.messages_field]]}

    elif config.text_field in rows.column_names:

        def render(batch):
            return {"text": batch[config.text_field]}

    else:
        raise ValueError(
            f"{origin} has neither a `{config.text_field}` field (data.text_field) nor a `{config.messages_field}` "
            f"field (data.messages_field); its fields: {rows.column_names}"
        )
    return rows.map(render, batched=True, remove_columns=rows.column_names)


def load_documents(files: list[str], config: DataConfig, tokenizer) -> datasets.Dataset:
    """One row per document (`text`) from local files, grouped by format."""
    groups: dict[str, list[str]] = {}
    for path in files:
        suffix = Path(path).suffix.lower()
        kind = "json" if suffix in JSON_SUFFIXES else "parquet" if suffix in PARQUET_SUFFIXES else "text"
        groups.setdefault(kind, []).append(path)
    parts = []
    for kind, paths in groups.items():
        if kind == "text":
            options = {"sample_by": "document", "encoding_errors": "replace"}
            rows = datasets.load_dataset(kind, data_files=paths, split="train", **options)
        else:
            rows = datasets.concatenate_datasets([_checked_rows(kind, path, config) for path in paths])
        parts.append(_render(rows, config, tokenizer, f"{kind} files ({paths[0]}, ...)"))
    return datasets.concatenate_datasets(parts)


def _checked_rows(kind: str, path: str, config: DataConfig) -> datasets.Dataset:
    """The rows of one json / jsonl / parquet file whose text (or chat messages) is usable. A bad row (not
    JSON, not an object, no text) stops with its file and row named, or is skipped with a warning
    (`data.bad_rows`)."""
    if kind == "parquet":
        records = datasets.load_dataset("parquet", data_files=path, split="train").to_list()
        label = "row"
    elif path.lower().endswith(".jsonl"):
        records, label = [], "line"
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    records.append(json.loads(line) if line.strip() else None)
                except json.JSONDecodeError as error:
                    records.append(f"not JSON ({error.msg})")
    else:
        records, label = json.loads(Path(path).read_text(encoding="utf-8")), "item"
        records = records if isinstance(records, list) else [records]
    kept, bad = [], []
    for number, record in enumerate(records, 1):
        if record is None and label == "line":
            continue  # a blank line
        problem = record if isinstance(record, str) and label == "line" else _row_problem(record, config)
        if problem is None:
            kept.append(record)
        else:
            bad.append(f"{label} {number}: {problem}")
    if bad and config.bad_rows == "stop":
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise ValueError(f"{path}, {bad[0]}{more}; set data.bad_rows: skip to leave such rows out")
    if bad:
        warnings.warn(f"{path}: skipped {len(bad)} bad row(s), the first at {bad[0]}", stacklevel=2)
    if not kept:
        raise ValueError(f"{path}: no usable rows")
    return datasets.Dataset.from_list(kept)


def _row_problem(record, config: DataConfig) -> str | None:
    if not isinstance(record, dict):
        return f"not an object ({type(record).__name__})"
    if isinstance(record.get(config.text_field), str):
        return None
    if isinstance(record.get(config.messages_field), list):
        return None
    return f"no text: neither a string `{config.text_field}` nor a list `{config.messages_field}`"


def pack_documents(documents: datasets.Dataset, tokenizer, seq_len: int) -> datasets.Dataset:
    """Token rows of exactly `seq_len` (`input_ids`): documents tokenised, each ended by EOS, concatenated
    and cut (the remainder of each block of 1000 documents is dropped)."""
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token to separate packed documents")

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=True)["input_ids"]
        # a chat template may already start with BOS, which the tokenizer then adds a second time
        ids = [x[1:] if bos is not None and x[:2] == [bos, bos] else x for x in ids]
        return {"ids": [x if x[-1:] == [eos] else x + [eos] for x in ids]}

    def pack(batch):
        stream = [token for ids in batch["ids"] for token in ids]
        count = len(stream) // seq_len
        return {"input_ids": [stream[i * seq_len : (i + 1) * seq_len] for i in range(count)]}

    tokens = documents.map(tokenize, batched=True, remove_columns=documents.column_names)
    return tokens.map(pack, batched=True, batch_size=1000, remove_columns=["ids"])


@dataclass
class TokenRows:
    """Packed training and held-out rows, and what they were made of (for the model card)."""

    train: datasets.Dataset | None
    heldout: datasets.Dataset
    summary: dict


def load_rows(config: DataConfig, tokenizer, split: bool = True) -> TokenRows:
    """Training and held-out rows per `config`; with `split=False` every document is held out (profiling)."""
    source = config.source.strip()
    if source.startswith("hub:"):
        if config.heldout_files is not None:
            raise ValueError("data.heldout_files applies to local files; a hub data set is split by heldout_fraction")
        name = source[len("hub:") :]
        raw = datasets.load_dataset(name, config.hub_config, split=config.hub_split)
        documents, heldout_docs = _render(raw, config, tokenizer, f"hub data set {name}"), None
    else:
        files = expand_globs(source, config.exclude)
        heldout_files = expand_globs(config.heldout_files, config.exclude) if config.heldout_files and split else []
        held = set(heldout_files)
        train_files = [path for path in files if path not in held]
        if not train_files:
            raise ValueError(f"data: every file matching {source!r} is held out")
        documents = load_documents(train_files, config, tokenizer)
        heldout_docs = load_documents(heldout_files, config, tokenizer) if heldout_files else None
    if not split:
        train_docs, heldout_docs = None, documents
    elif heldout_docs is None:
        if len(documents) < 2:
            raise ValueError("data: a held-out split by fraction needs at least 2 documents")
        test_size = min(len(documents) - 1, max(1, round(config.heldout_fraction * len(documents))))
        parts = documents.train_test_split(test_size=test_size, seed=config.seed, shuffle=True)
        train_docs, heldout_docs = parts["train"], parts["test"]
    else:
        train_docs = documents
    if train_docs is not None and config.max_documents is not None:
        train_docs = train_docs.select(range(min(config.max_documents, len(train_docs))))
    train = pack_documents(train_docs, tokenizer, config.seq_len) if train_docs is not None else None
    heldout = pack_documents(heldout_docs, tokenizer, config.seq_len)
    if len(heldout) == 0 or (train is not None and len(train) == 0):
        raise ValueError(f"data: too little text for one row of data.seq_len={config.seq_len} tokens in each split")
    summary = {
        "source": source,
        "train_documents": len(train_docs) if train_docs is not None else 0,
        "heldout_documents": len(heldout_docs),
        "train_rows": len(train) if train is not None else 0,
        "heldout_rows": len(heldout),
        "seq_len": config.seq_len,
        "heldout_by": "file" if config.heldout_files else f"fraction {config.heldout_fraction} (seed {config.seed})",
    }
    return TokenRows(train, heldout, summary)


def row_tensor(rows: datasets.Dataset, indices) -> torch.Tensor:
    """`[len(indices), seq_len]` int64 token ids of the given rows."""
    return torch.tensor(rows[list(indices)]["input_ids"], dtype=torch.long)


# ---------------------------------------------------------------------------------------- evaluate


@torch.no_grad()
def evaluate(
    model: nn.Module,
    adapter: ModelAdapter,
    heads: dict[str, DraftHeads],
    rows: torch.Tensor,
    batch_size: int,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """Mean KL, alpha and top-1 agreement per draft of each heads set, {label: {draft: {metric: value}}},
    from one target forward per batch of `rows`; `reduce` sums the totals over processes."""
    totals = {label: None for label in heads}
    device = adapter.device
    for batch in rows.split(batch_size):
        hidden_states, logits = target_pass(model, batch.to(device))
        for label, h in heads.items():
            sums = score_sums(h, adapter, hidden_states, logits)
            totals[label] = sums if totals[label] is None else totals[label] + sums
    result = {}
    for label, h in heads.items():
        sums = totals[label] if totals[label] is not None else torch.zeros(len(draft_names(h)), 4, device=device)
        if reduce is not None:
            sums = reduce(sums)
        result[label] = {
            name: {metric: (row[i] / row[3].clamp(min=1)).item() for i, metric in enumerate(METRICS)}
            for name, row in zip(draft_names(h), sums, strict=True)
        }
    return result


def untrained_like(heads: DraftHeads) -> DraftHeads:
    """Fresh heads of the same shape: zero-initialised, so each is the untrained exit (or next-token head)."""
    if isinstance(heads, ExitHeads):
        fresh = ExitHeads(heads.fingerprint, heads.exit_layers, heads.intermediate_size)
    else:
        fresh = MedusaHeads(heads.fingerprint, heads.num_heads, heads.num_layers)
    weight = next(heads.parameters())
    return fresh.to(device=weight.device, dtype=weight.dtype)


def measure(adapter: ModelAdapter, heads: DraftHeads, rows: torch.Tensor, config: EvalConfig) -> Costs:
    """c per draft (and v(gamma) when `config.measure_v`), timed after the first `timing_context` tokens of `rows`."""
    max_gamma = config.max_gamma if config.measure_v else 0
    tokens = rows.flatten()[: config.timing_context + max(max_gamma, 1) + 1][None].to(adapter.device)
    return measure_costs(adapter, heads, tokens, config.timing_repeats, max_gamma)


def profile_heads(model: nn.Module, heads: DraftHeads, rows: torch.Tensor, config: EvalConfig, trained: bool = True):
    """Report rows (see `report_rows`) for `heads` on held-out `rows`: untrained and (if `trained`) these heads,
    measured c and the predicted speedup."""
    adapter = ModelAdapter(model)
    sets = {"untrained": untrained_like(heads), "trained": heads} if trained else {"untrained": heads}
    scores = evaluate(model, adapter, sets, rows[: config.max_rows], config.batch_size)
    costs = measure(adapter, heads, rows, config)
    return report_rows(heads, scores["untrained"], scores.get("trained"), costs, config.max_gamma)


# ----------------------------------------------------------------------------------------- report


def report_rows(
    heads: DraftHeads,
    untrained: dict[str, dict[str, float]],
    trained: dict[str, dict[str, float]] | None,
    costs: Costs | None,
    max_gamma: int,
) -> list[dict]:
    """One row per draft: its depth (exit layer or Medusa head), untrained and trained figures, c, gamma, S."""
    best = trained or untrained
    speed = speedup_table(heads, {n: s["alpha"] for n, s in best.items()}, costs, max_gamma) if costs else {}
    rows = []
    for name in draft_names(heads):
        row = {"draft": name, "depth": int(name.rsplit("_", 1)[1])}
        row.update({f"untrained_{metric}": untrained[name][metric] for metric in METRICS})
        if trained is not None:
            row.update({metric: trained[name][metric] for metric in METRICS})
        row.update(speed.get(name, {}))
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows as an aligned console / Markdown table."""
    columns = [("draft", "draft", "{}"), ("untrained_alpha", "untrained alpha", "{:.3f}")]
    columns += [("untrained_top1", "untrained top-1", "{:.3f}")]
    if rows and "alpha" in rows[0]:
        columns += [("alpha", "trained alpha", "{:.3f}"), ("top1", "trained top-1", "{:.3f}"), ("kl", "KL", "{:.3f}")]
    if rows and "c" in rows[0]:
        columns += [("c", "c", "{:.3f}"), ("gamma", "best gamma", "{}"), ("speedup", "predicted speedup", "{:.2f}x")]
    cells = [[title for _, title, _ in columns]] + [[fmt.format(row[key]) for key, _, fmt in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) + " |" for line in cells]
    lines.insert(1, "|" + "|".join("-" * (width + 2) for width in widths) + "|")
    return "\n".join(lines)


def plot_alpha(rows: list[dict], path: str | os.PathLike, title: str = "") -> None:
    """PNG: alpha against exit depth (or Medusa head), untrained and (if present) trained."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    from matplotlib import pyplot as plt

    medusa = rows[0]["draft"].startswith("medusa")
    depths = [row["depth"] for row in rows]
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot(depths, [row["untrained_alpha"] for row in rows], "o--", label="untrained")
    if "alpha" in rows[0]:
        axes.plot(depths, [row["alpha"] for row in rows], "o-", label="trained")
        axes.plot(depths, [row["top1"] for row in rows], "x:", label="trained, top-1 agreement")
    axes.set_xlabel("Medusa head (predicts token t+2+i)" if medusa else "exit layer")
    axes.set_ylabel("alpha = 1 - TV(p, q)")
    axes.set_ylim(0, 1)
    axes.set_xticks(depths)
    axes.grid(alpha=0.3)
    axes.legend()
    axes.set_title(title or "acceptance rate per draft depth")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def heads_card(config: TrainHeadsConfig, heads: DraftHeads, rows: list[dict], facts: dict) -> str:
    """The README.md of a heads folder written by training/train_heads.py: target, data, the commands, steps,
    held-out figures per draft (`report_rows`); `facts` as that script's training_summary.json holds them."""
    fp = heads.fingerprint
    kind = "exit heads (one per exit depth)" if isinstance(heads, ExitHeads) else f"{heads.num_heads} Medusa heads"
    commands = "\n".join(facts["commands"])
    return f"""# selfspec {heads.kind} heads for `{config.target.name_or_path}`

{kind.capitalize()} trained by self-distillation on the frozen target: each draft learns KL(p || q) with p
the target's own next-token distribution at temperature 1 (for Medusa head i, the target at position t+1+i).

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

## Use

```python
from selfspec import SelfSpeculative
spec = SelfSpeculative(model, heads="{config.heads_dir}")
```
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
