"""A read-only memory of earlier answers for suffix drafting: token ids in one flat array, indexed by sorting.

`SuffixMemory` answers the same look-up as `SuffixIndex.candidates` (the longest earlier match of the text's end and
its most recent occurrences), for millions of tokens loaded in well under a second: the index is two sorted int64
arrays (token pairs and single tokens, each entry a position) built with one stable argsort, not a dictionary filled
token by token. It is saved as safetensors: the tokens (uint16 where the vocabulary fits, else int32) and where each
answer starts.
"""

from __future__ import annotations

import os
from array import array
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

CHUNK = 256  # occurrences read from the index at a time, most recent first


class SuffixMemory:
    """Answers (token id sequences) kept read-only for `SuffixDrafter(memory=...)`."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray):
        if tokens.ndim != 1 or starts.ndim != 1 or len(starts) < 1 or starts[0] != 0 or starts[-1] != len(tokens):
            raise ValueError("a suffix memory needs flat tokens and answer starts from 0 to the number of tokens")
        if np.any(np.diff(starts) < 0):
            raise ValueError("a suffix memory's answer starts must not decrease")
        self.starts = starts.astype(np.int64)
        flat = tokens.astype(np.int64)
        self._flat = array("i", tokens.astype(np.int32).tobytes())  # Python ints on indexing: the drafter's loops
        self._view = memoryview(self._flat)
        first = np.zeros(len(flat), dtype=bool)
        first[self.starts[:-1][np.diff(self.starts) > 0]] = True  # an answer's first token has no pair before it
        where = np.arange(len(flat), dtype=np.int64)
        pair_at = where[~first]  # the second token of each pair within an answer
        self._pairs = _sorted_index(flat[pair_at - 1] << 32 | flat[pair_at], pair_at)
        self._singles = _sorted_index(flat, where)
        self.tokens = len(flat)

    def __len__(self) -> int:
        return len(self.starts) - 1

    @classmethod
    def from_answers(cls, answers) -> SuffixMemory:
        lengths = np.array([len(answer) for answer in answers], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        tokens = np.fromiter((t for answer in answers for t in answer), dtype=np.int64, count=int(starts[-1]))
        if len(tokens) and tokens.min() < 0:
            raise ValueError("a suffix memory holds token ids, which are non-negative")
        return cls(tokens, starts)

    @classmethod
    def load(cls, path: str | os.PathLike) -> SuffixMemory:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"No suffix memory at {path} (looked in {path.resolve()}).")
        try:
            tensors = load_file(str(path))
        except Exception as error:
            raise ValueError(f"{path} is not a safetensors suffix memory: {error}") from error
        missing = {"tokens", "starts"} - set(tensors)
        if missing:
            raise ValueError(f"{path} is not a suffix memory: it has no {', '.join(sorted(missing))}")
        return cls(tensors["tokens"], tensors["starts"])

    def save(self, path: str | os.PathLike) -> None:
        tokens = np.frombuffer(self._flat, dtype=np.int32)
        small = self.tokens == 0 or int(tokens.max()) < 2**16
        save_file({"tokens": tokens.astype(np.uint16 if small else np.int32), "starts": self.starts}, str(path))

    def largest_token(self) -> int:
        return int(np.frombuffer(self._flat, dtype=np.int32).max()) if self.tokens else -1

    def candidates(self, context: list[int], max_match: int, max_candidates: int) -> tuple[int, list[tuple]]:
        """As `SuffixIndex.candidates`: (length of the longest match, its most recent occurrences as (answer, where
        the token after the match is in it, answer number)); (0, []) without one."""
        if not context:
            return 0, []
        lookups = []
        if len(context) >= 2 and max_match >= 2:
            lookups.append((self._pairs, context[-2] << 32 | context[-1], 2))
        lookups.append((self._singles, context[-1], 1))
        for (keys, positions), key, known in lookups:
            low, high = np.searchsorted(keys, key, "left"), np.searchsorted(keys, key, "right")
            if low < high:
                best, found = self._longest(positions, int(low), int(high), known, context, max_match, max_candidates)
                if found:
                    return best, found
        return 0, []

    def _longest(self, positions, low, high, known, context, max_match, max_candidates):
        best, found, flat, starts = 0, [], self._flat, self.starts
        for chunk_end in range(high, low, -CHUNK):  # the most recent occurrences first
            chunk = positions[max(low, chunk_end - CHUNK) : chunk_end][::-1].tolist()
            answers = (np.searchsorted(starts, chunk, "right") - 1).tolist()
            for where, answer in zip(chunk, answers, strict=True):
                start, end = int(starts[answer]), int(starts[answer + 1])
                if where + 1 >= end:  # the match ends its answer: nothing follows it
                    continue
                length = known
                while length < max_match and length < len(context) and where - length >= start:
                    if flat[where - length] != context[-length - 1]:
                        break
                    length += 1
                if length > best:
                    best, found = length, []
                if length == best:
                    found.append((self._view[start:end], where + 1 - start, -1 - answer))
                if len(found) >= max_candidates:
                    return best, found
        return best, found


def _sorted_index(keys: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(keys sorted, the positions in the same order): a stable sort keeps each key's positions ascending."""
    order = np.argsort(keys, kind="stable")
    return keys[order], positions[order]
