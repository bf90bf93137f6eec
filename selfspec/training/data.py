"""Training and held-out text for draft heads: local files by glob (text files are one document each,
`.jsonl`/`.json` one per row, also gzip-compressed as `.jsonl.gz`/`.json.gz`, `.parquet` one per row, with a
text field or chat `messages` rendered by the tokenizer's chat template) or a hub data set, read with
`datasets`, tokenised with the target's tokenizer, joined by EOS and cut into rows of a fixed length; a
held-out split by file or by a seeded fraction of the documents. Rows without usable text stop the run naming
file and row, or are skipped (`data.bad_rows`).

Each row carries a `loss_mask` beside its `input_ids`: 1 at the positions whose next token is one to learn.
Plain text teaches every token; chat teaches the assistant turns only (`data.loss_on: answers`, the turn's
text and its end-of-turn tokens), so the heads learn what the model answers, not what users ask.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch

from ..chat import answer_spans, open_text
from .config import DataConfig

JSON_SUFFIXES = {".json", ".jsonl"}
PARQUET_SUFFIXES = {".parquet"}


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


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """`datasets`' progress bars off, then as they were: for files already on disk, its "Downloading data",
    "Generating train split" and per-map bars are noise. `HF_DATASETS_DISABLE_PROGRESS_BARS`, where set, decides."""
    if datasets.config.HF_DATASETS_DISABLE_PROGRESS_BARS is not None or datasets.are_progress_bars_disabled():
        yield
        return
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.enable_progress_bars()


def _render(rows: datasets.Dataset, config: DataConfig, tokenizer, origin: str) -> datasets.Dataset:
    """A dataset of `text` and `spans`, the [start, end) character spans to learn: the text field (all of
    it), or chat messages through the chat template (the assistant turns, or all with `data.loss_on: all`)."""
    if config.messages_field in rows.column_names:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{origin} has chat `{config.messages_field}` but the tokenizer has no chat template")

        def render(batch):
            texts, spans = [], []
            for messages in batch[config.messages_field]:
                text = tokenizer.apply_chat_template(messages, tokenize=False)
                texts.append(text)
                if config.loss_on != "answers":
                    spans.append([[0, len(text)]])
                    continue
                try:
                    spans.append(answer_spans(tokenizer, messages, text))
                except ValueError as error:
                    raise ValueError(f"{error}: set data.loss_on: all to learn every token") from None
            return {"text": texts, "spans": spans}

    elif config.text_field in rows.column_names:

        def render(batch):
            return {"text": batch[config.text_field], "spans": [[[0, len(text)]] for text in batch[config.text_field]]}

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
        suffix = Path(path.lower().removesuffix(".gz")).suffix
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
    elif path.lower().removesuffix(".gz").endswith(".jsonl"):
        records, label = [], "line"
        with open_text(path, errors="replace") as f:
            for line in f:
                try:
                    records.append(json.loads(line) if line.strip() else None)
                except json.JSONDecodeError as error:
                    records.append(f"not JSON ({error.msg})")
    else:
        with open_text(path, errors="replace") as f:
            records, label = json.load(f), "item"
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
    """Token rows of exactly `seq_len` (`input_ids`, `loss_mask`): documents tokenised, each ended by EOS,
    concatenated and cut (the remainder of each block of 1000 documents is dropped). `loss_mask[t]` is 1 where
    token t+1 lies in one of its document's `spans` (the EOS that ends a document counts where its last span
    reaches the document's end)."""
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token to separate packed documents")
    fast = getattr(tokenizer, "is_fast", False)  # offsets place the tokens to learn; else every token is learnt

    def tokenize(batch):
        encoded = tokenizer(batch["text"], add_special_tokens=True, return_offsets_mapping=fast)
        all_ids, all_learn = [], []
        if not fast:
            if any(spans != [[0, len(text)]] for spans, text in zip(batch["spans"], batch["text"], strict=True)):
                raise ValueError("learning the answers only (data.loss_on: answers) needs a fast tokenizer, whose "
                                 "offsets place them; set data.loss_on: all with this one")  # fmt: skip
            encoded["offset_mapping"] = [[(0, 0)] * len(ids) for ids in encoded["input_ids"]]  # all in [0, len)
        for ids, offsets, spans, text in zip(
            encoded["input_ids"], encoded["offset_mapping"], batch["spans"], batch["text"], strict=True
        ):
            # a chat template may already start with BOS, which the tokenizer then adds a second time
            if bos is not None and ids[:2] == [bos, bos]:
                ids, offsets = ids[1:], offsets[1:]
            learn = [any(a <= start < b for a, b in spans) for start, _ in offsets]
            if ids[-1:] != [eos]:
                ids, learn = ids + [eos], learn + [any(b >= len(text) for _, b in spans)]
            all_ids.append(ids)
            all_learn.append(learn)
        return {"ids": all_ids, "learn": all_learn}

    def pack(batch):
        stream = [token for ids in batch["ids"] for token in ids]
        learn = [flag for flags in batch["learn"] for flag in flags]
        mask = [int(flag) for flag in learn[1:]] + [0]  # position t teaches the prediction of token t+1
        count = len(stream) // seq_len
        return {
            "input_ids": [stream[i * seq_len : (i + 1) * seq_len] for i in range(count)],
            "loss_mask": [mask[i * seq_len : (i + 1) * seq_len] for i in range(count)],
        }

    tokens = documents.map(tokenize, batched=True, remove_columns=documents.column_names)
    return tokens.map(pack, batched=True, batch_size=1000, remove_columns=["ids", "learn"])


@dataclass
class TokenRows:
    """Packed training and held-out rows, and what they were made of (for the model card)."""

    train: datasets.Dataset | None
    heldout: datasets.Dataset
    summary: dict


def load_rows(config: DataConfig, tokenizer, split: bool = True) -> TokenRows:
    """Training and held-out rows per `config`; with `split=False` every document is held out (profiling). Local
    files load without `datasets`' progress bars; a hub data set keeps them (its download is real work)."""
    with nullcontext() if config.source.strip().startswith("hub:") else _no_progress_bars():
        return _token_rows(config, tokenizer, split)


def _token_rows(config: DataConfig, tokenizer, split: bool) -> TokenRows:
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
    for name, rows in (("training", train), ("held-out", heldout)):
        if rows is not None and not _anything_to_learn(rows):  # a loss of 0 at every step: nothing would be learnt
            raise ValueError(
                f"data: no token of the {name} rows from {source!r} is one to learn: with data.loss_on: answers only "
                "the assistant turns of chat rows are, and none of these rows has one; add the answers, or set "
                "data.loss_on: all to learn every token"
            )
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


def _anything_to_learn(rows: datasets.Dataset) -> bool:
    """Whether any row's `loss_mask` marks a position, read in slices (the column whole is GBs on a large set)."""
    return any(any(map(any, batch["loss_mask"])) for batch in rows.select_columns("loss_mask").iter(batch_size=1000))


def row_tensor(rows: datasets.Dataset, indices) -> torch.Tensor:
    """`[len(indices), seq_len]` int64 token ids of the given rows."""
    return torch.tensor(rows[list(indices)]["input_ids"], dtype=torch.long)


def row_tensors(rows: datasets.Dataset, indices) -> tuple[torch.Tensor, torch.Tensor]:
    """`[len(indices), seq_len]` int64 token ids and bool loss masks (`pack_documents`) of the given rows, read
    from the data set once."""
    picked = rows[list(indices)]
    return torch.tensor(picked["input_ids"], dtype=torch.long), torch.tensor(picked["loss_mask"], dtype=torch.bool)


def copy_pool(vocab_size: int, special_ids, draft_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The tokens copy rows draw from: the draft vocabulary's (the whole vocabulary's without one), special tokens
    left out."""
    ids = torch.arange(vocab_size) if draft_ids is None else draft_ids.cpu()
    pool = ids[~torch.isin(ids, torch.tensor(sorted(special_ids), dtype=ids.dtype))]
    if len(pool) < 2:
        raise ValueError("copy rows need at least 2 non-special tokens to draw from")
    return pool


def copy_rows(
    pool: torch.Tensor, rows: int, segment: int, repeats: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic copy rows of `segment * repeats` tokens: per row, a segment of random tokens from `pool`, its length
    drawn from a quarter of `segment` (at least 2) up to `segment`, repeated to fill the row (the last copy cut short),
    and a loss mask of the positions after the first segment, where only copying predicts the next token (the
    target does: it continues a repeat almost always). They teach a head the induction circuit (find the current
    token's earlier occurrence, read what followed it) that natural text teaches slowly. The lengths vary so that
    no fixed distance back predicts the next token: only matching the token does. Pure function of `seed`."""
    generator = torch.Generator().manual_seed(seed)
    length = segment * repeats
    periods = torch.randint(max(2, segment // 4), segment + 1, (rows, 1), generator=generator)
    picks = torch.randint(len(pool), (rows, segment), generator=generator)
    positions = torch.arange(length)
    ids = pool[picks.gather(1, positions % periods)]
    return ids, positions >= periods
