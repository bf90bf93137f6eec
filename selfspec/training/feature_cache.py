"""The frozen target's hidden states per training row, kept on disk so that later visits of a row skip the
target's forward (`train.feature_cache`).

On a CPU the target's forward is about half of a training step (SmolLM2-135M on a 2,048-token row), and it
gives the same result at every epoch. The heads read a few entries of its `hidden_states`
(`DraftHeads.hidden_entries`) and the teacher's logits come from the last, normed entry through the LM head,
so those entries, stored once per row, stand in for the forward on every later visit. The first visit stores
them and reads them back like any later one: every visit trains on the same stored values. They are stored in
bfloat16 under bf16 autocast (its linear layers round their inputs to it anyway; norms and residual sums see the
rounded values, so such a run differs slightly from an uncached one), else in the target's own dtype (exactly the
forward's values), and handed back in the target's dtype on the ids' device. A row counts as stored once its
flag is set after its states: a killed run leaves it unstored (a power loss could reach the disk out of order).

On disk: `states.bin` (rows x entries x seq_len x hidden, memory-mapped), `filled.bin` (one byte per row, set
once its states are written) and `meta.json` (what the cache holds: the target's and the rows' digests, the
entries, the shape, the dtype), written last. A cache of another target, other rows, other heads' entries or
another dtype is refused, never rewritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

FORMAT = 1
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def rows_digest(input_ids: np.ndarray) -> str:
    """SHA-256 of the training rows' token ids `[rows, seq_len]` (their order included)."""
    return hashlib.sha256(np.ascontiguousarray(input_ids, dtype=np.int64).tobytes()).hexdigest()


def rows_digest_of(rows, chunk: int = 4096) -> str:
    """`rows_digest` of a dataset's `input_ids`, read `chunk` rows at a time (the same digest: the same bytes in
    order), so that the whole column is never held in memory at once."""
    digest = hashlib.sha256()
    numpy_rows = rows.with_format("numpy")
    for start in range(0, len(rows), chunk):
        ids = numpy_rows[start : start + chunk]["input_ids"]
        digest.update(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
    return digest.hexdigest()


class CachedStates(Sequence):
    """A forward's `hidden_states` (entries 0..L, the last one normed) of which only some are kept: the kept
    ones by index (negative ones count from the end), a named error for any other."""

    def __init__(self, entries: dict[int, torch.Tensor], length: int):
        self._entries, self._length = entries, length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        if not isinstance(index, int):
            raise TypeError(f"cached hidden states are read one entry at a time, not by {type(index).__name__}")
        entry = index + self._length if index < 0 else index
        if not 0 <= entry < self._length:
            raise IndexError(f"hidden_states[{index}] is out of range: a forward has {self._length} entries")
        if entry not in self._entries:
            raise KeyError(
                f"hidden_states[{index}] is not in the feature cache (it keeps entries {sorted(self._entries)}): "
                "the heads' hidden_entries() must list every entry their distillation_drafts reads"
            )
        return self._entries[entry]


class FeatureCache:
    """The kept hidden-state entries of `num_rows` training rows of `seq_len` tokens, in `directory`.

    `entries` are the heads' `hidden_entries()`; the last entry (the teacher's input) is always added.
    `digests` name what the states are of (`target`: `state_digest` of the model, `rows`: `rows_digest`); an
    existing cache must match them and the shape, or it is refused with the differences named."""

    def __init__(
        self,
        directory: str | Path,
        *,
        num_rows: int,
        seq_len: int,
        hidden_size: int,
        num_layers: int,
        entries: Sequence[int],
        dtype: str,
        out_dtype: torch.dtype,
        digests: dict[str, str],
    ):
        if dtype not in DTYPES:
            raise ValueError(f"feature cache dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        bad = [e for e in entries if not 0 <= e <= num_layers]
        if bad:
            raise ValueError(f"hidden-state entries {bad} are outside 0..{num_layers}")
        self.directory = Path(directory)
        self.entries = sorted(set(entries) | {num_layers})
        self.num_layers, self.dtype, self.out_dtype = num_layers, DTYPES[dtype], out_dtype
        self.shape = (num_rows, len(self.entries), seq_len, hidden_size)
        self.meta = {
            "format": FORMAT, **digests, "num_rows": num_rows, "seq_len": seq_len, "hidden_size": hidden_size,
            "num_layers": num_layers, "entries": self.entries, "dtype": dtype,
        }  # fmt: skip
        meta_path = self.directory / "meta.json"
        if meta_path.exists():
            self._check(json.loads(meta_path.read_text(encoding="utf-8")))
        else:
            self._create(meta_path)
        count = int(np.prod(self.shape))
        self.states = torch.from_file(str(self.directory / "states.bin"), shared=True, size=count, dtype=self.dtype)
        self.states = self.states.view(self.shape)
        self.filled = torch.from_file(str(self.directory / "filled.bin"), shared=True, size=num_rows, dtype=torch.uint8)
        self.hits = self.misses = 0

    @property
    def size_bytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def filled_rows(self) -> int:
        return int(self.filled.sum())

    def _check(self, stored: dict) -> None:
        different = [key for key in self.meta if stored.get(key) != self.meta[key]]
        if different:
            raise ValueError(
                f"train.feature_cache {self.directory} was made with other settings: "
                + ", ".join(f"{key} {stored.get(key)!r} there, {self.meta[key]!r} here" for key in different)
                + ": give another folder, or delete this one to rebuild it"
            )

    def _create(self, meta_path: Path) -> None:
        if self.directory.exists() and any(self.directory.iterdir()):
            raise ValueError(f"train.feature_cache {self.directory} is a folder with files but no meta.json: not a "
                             "feature cache; give an empty or new folder")  # fmt: skip
        self.directory.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.directory).free
        if self.size_bytes > free:
            raise ValueError(
                f"train.feature_cache needs {self.size_bytes / 2**30:.1f} GiB for {self.shape[0]} rows and "
                f"{free / 2**30:.1f} GiB are free at {self.directory}"
            )
        with open(self.directory / "states.bin", "wb") as f:
            f.truncate(self.size_bytes)  # sparse until rows are written
        with open(self.directory / "filled.bin", "wb") as f:
            f.write(bytes(self.shape[0]))
        staging = meta_path.with_suffix(".json.tmp")
        staging.write_text(json.dumps(self.meta, indent=1), encoding="utf-8")
        os.replace(staging, meta_path)

    def hidden_states(
        self, rows: Sequence[int], input_ids: torch.Tensor, forward: Callable[[torch.Tensor], Sequence[torch.Tensor]]
    ) -> CachedStates:
        """The kept entries for training rows `rows` (their token ids `input_ids`, `[len(rows), seq_len]`),
        `[len(rows), seq_len, hidden]` each: the rows not yet stored go through `forward(ids)` (which returns
        a forward's `hidden_states`) and are stored first."""
        if input_ids.shape != (len(rows), self.shape[2]):
            raise ValueError(f"{len(rows)} rows of {self.shape[2]} tokens expected, got ids of shape "
                             f"{tuple(input_ids.shape)}")  # fmt: skip
        missing = [i for i, row in enumerate(rows) if not self.filled[row]]
        if missing:
            computed = forward(input_ids[missing])
            for j, i in enumerate(missing):
                self.states[rows[i]] = torch.stack([computed[e][j] for e in self.entries]).to(self.dtype)
            self.filled[[rows[i] for i in missing]] = 1  # after the states: a killed run leaves a row unfilled
        self.misses += len(missing)
        self.hits += len(rows) - len(missing)
        picked = self.states[list(rows)].to(device=input_ids.device, dtype=self.out_dtype)  # [rows, entries, T, H]
        return CachedStates({e: picked[:, k] for k, e in enumerate(self.entries)}, self.num_layers + 1)
