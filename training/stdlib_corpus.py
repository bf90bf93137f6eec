"""The demo target's training text: the Python standard library of the running interpreter.

Every `*.py` file under `sysconfig.get_paths()["stdlib"]` (tests included, `site-packages`
excluded) is read as UTF-8 with replacement characters. Files are split into training and
held-out sets by a hash of their path relative to the standard library root, so the split does not
depend on the machine or the order of directory listings. A byte-level BPE tokenizer is trained on
the training files only; both sets are then tokenized into one packed stream each, every file
preceded by `<|endoftext|>`. Everything is cached in one directory written atomically.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"


@dataclass
class DataConfig:
    heldout_fraction: float = 0.02  # share of files held out, chosen by a hash of their relative path
    vocab_size: int = 8192  # byte-level BPE vocabulary, <|endoftext|> included
    min_frequency: int = 2  # BPE merges need a pair seen at least this often

    def __post_init__(self):
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"data.heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        if not 257 <= self.vocab_size <= 2**16:  # 256 bytes + <|endoftext|>; streams are uint16
            raise ValueError(f"data.vocab_size must be in [257, 65536], got {self.vocab_size}")


@dataclass
class Corpus:
    """Cached tokenizer and packed token streams (uint16, memory-mapped)."""

    tokenizer: PreTrainedTokenizerFast
    train: np.ndarray
    heldout: np.ndarray
    manifest: dict


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root: Path) -> list[Path]:
    """Relative paths of all `*.py` files under `root` outside `site-packages`, sorted."""
    files = [path.relative_to(root) for path in root.rglob("*.py")]
    return sorted(path for path in files if "site-packages" not in path.parts)


def is_heldout(relative_path: Path, heldout_fraction: float) -> bool:
    """Deterministic by-file split: the first 8 bytes of a BLAKE2b hash of the POSIX path."""
    digest = hashlib.blake2b(relative_path.as_posix().encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < heldout_fraction


def split_files(root: Path, heldout_fraction: float) -> tuple[list[Path], list[Path]]:
    files = list_source_files(root)
    heldout = [path for path in files if is_heldout(path, heldout_fraction)]
    train = [path for path in files if not is_heldout(path, heldout_fraction)]
    return train, heldout


def read_sources(root: Path, files: list[Path]) -> tuple[dict[Path, str], list[str]]:
    """Text of each readable file, and `"path: error"` for each one that is not (never silently dropped)."""
    texts, skipped = {}, []
    for path in files:
        try:
            texts[path] = (root / path).read_text(encoding="utf-8", errors="replace")
        except OSError as error:
            skipped.append(f"{path.as_posix()}: {error}")
    return texts, skipped


def train_tokenizer(texts: list[str], config: DataConfig) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 pre-tokenization) with `<|endoftext|>` as bos, eos and pad."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        unk_token=None,
        model_max_length=1_000_000,  # the model's own limit is in its config
        clean_up_tokenization_spaces=False,
    )


def pack(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> np.ndarray:
    """One uint16 stream: `<|endoftext|>` then the tokens of each file, in order."""
    eot = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    pieces = [np.array([eot] + encoding.ids, dtype=np.uint16) for encoding in encodings]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)


def prepare_corpus(config: DataConfig, cache_dir: str | Path, log=print) -> Corpus:
    """Load the cached corpus from `cache_dir`, building it first if it does not exist."""
    cache_dir = Path(cache_dir)
    if not cache_dir.exists():
        _build_cache(config, cache_dir, log)
    manifest = json.loads((cache_dir / "manifest.json").read_text(encoding="utf-8"))
    cached = DataConfig(**manifest["data"])
    if cached != config:
        changed = [f.name for f in dataclasses.fields(config) if getattr(cached, f.name) != getattr(config, f.name)]
        raise ValueError(
            f"{cache_dir} was built with other data settings ({', '.join('data.' + k for k in changed)}); "
            "use another output_dir or delete the cache to rebuild it"
        )
    return Corpus(
        tokenizer=AutoTokenizer.from_pretrained(cache_dir / "tokenizer"),
        train=np.load(cache_dir / "train.npy", mmap_mode="r"),
        heldout=np.load(cache_dir / "heldout.npy", mmap_mode="r"),
        manifest=manifest,
    )


def _build_cache(config: DataConfig, cache_dir: Path, log) -> None:
    root = stdlib_root()
    train_files, heldout_files = split_files(root, config.heldout_fraction)
    train_sources, train_skipped = read_sources(root, train_files)
    heldout_sources, heldout_skipped = read_sources(root, heldout_files)
    train_texts, heldout_texts = list(train_sources.values()), list(heldout_sources.values())
    skipped = train_skipped + heldout_skipped
    log(
        f"corpus: {root}: {len(train_texts)} training files ({sum(map(len, train_texts)) / 1e6:.1f}M chars), "
        f"{len(heldout_texts)} held-out files, {len(skipped)} unreadable files skipped"
    )
    for line in skipped:
        log(f"  skipped {line}")
    tokenizer = train_tokenizer(train_texts, config)
    train, heldout = pack(tokenizer, train_texts), pack(tokenizer, heldout_texts)
    log(f"corpus: {len(train):,} training tokens, {len(heldout):,} held-out tokens")

    # Build in a temporary directory and rename it: a killed run never leaves a half-written cache.
    partial = cache_dir.with_name(cache_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tokenizer.save_pretrained(partial / "tokenizer")
    np.save(partial / "train.npy", train)
    np.save(partial / "heldout.npy", heldout)
    manifest = {
        "data": dataclasses.asdict(config),
        "python": sys.version,
        "stdlib_root": str(root),
        "train_files": len(train_texts),
        "heldout_files": len(heldout_texts),
        "train_chars": sum(map(len, train_texts)),
        "train_tokens": int(len(train)),
        "heldout_tokens": int(len(heldout)),
        "skipped": skipped,
        "heldout_file_list": [path.as_posix() for path in heldout_sources],
    }
    (partial / "manifest.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    os.replace(partial, cache_dir)
