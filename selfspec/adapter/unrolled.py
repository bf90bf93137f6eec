"""Block-sparse attention for an EAGLE head's unrolled training steps (`selfspec.heads.eagle.unrolled_mask`).

Unrolled step j of a row of length L attends to (j + 1) L keys: step 0's entries up to the anchor (a causal
prefix) and, of each later step k, the one entry on its own chain. A dense mask makes SDPA score every query
against all of them, (1 + 2 + ... + unroll) L^2 products over a run, though each query's keys other than the
prefix are only j. Here the queries go in chunks of `CHUNK`: each chunk attends to the prefix its last query
needs and to the chunk-wide window of each later step that holds its chain entries, with the caller's mask
sliced to those keys. Every key the mask allows is in the slice, so the result is the dense one; the work falls
to about a quarter at L = 2048 (step 0 needs the causal half, each later window is CHUNK wide).

Within `only_queries(needed)` the queries left out (those whose outputs nothing reads: training marks the
positions its loss uses, `EagleHeads.distillation_drafts`) are not scored at all; their rows of the output are
zeros, so the layer's outputs there are finite and wrong, and every output that is read is unchanged.

The function wraps transformers' own SDPA attention (grouped keys, scaling and refusals as there), and is used
only inside `unrolled_attention`, where the mask has that pattern.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .grouped import attention_as

NAME = "selfspec_unrolled_sdpa"
CHUNK = 256  # queries per chunk: 128-512 time within 20% of each other at L = 2048 (bf16, one thread)
_NEEDED: ContextVar[torch.Tensor | None] = ContextVar("selfspec_unrolled_queries", default=None)


@contextmanager
def only_queries(needed: torch.Tensor | None):
    """Within the block, unrolled attention scores only the queries that `needed` ([batch, L] bool; None: all)
    marks in some row of the batch (at least one: the last, where none is marked); the others' outputs are zeros."""
    token = _NEEDED.set(needed)
    try:
        yield
    finally:
        _NEEDED.reset(token)


def _key_ranges(start: int, end: int, step: int, length: int) -> list[tuple[int, int]]:
    """Key columns that queries start..end-1 of unrolled step `step` may attend to: step 0's entries up to the last
    query's anchor, then of each step k = 1..step the entries on these queries' chains (index i - step + k)."""
    ranges = [(0, max(end - step, 0))]
    for k in range(1, step + 1):
        ranges.append((k * length + max(start - step + k, 0), k * length + max(end - step + k, 0)))
    return [(lo, hi) for lo, hi in ranges if hi > lo]


def unrolled_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: `query` [batch, heads, L, d] of unrolled step j, `key`/`value` with the
    (j + 1) L entries of steps 0..j, `attention_mask` [batch, 1, L, (j + 1) L] of the unrolled pattern."""
    length, keys = query.shape[2], key.shape[2]
    if attention_mask is None or keys % length or attention_mask.shape[-1] != keys:
        raise ValueError(
            f"unrolled attention needs the unrolled steps' mask and (step + 1) x {length} keys, got {keys} keys and "
            f"mask {None if attention_mask is None else tuple(attention_mask.shape)}"
        )
    needed = _NEEDED.get()
    if needed is not None and needed.shape[-1] != length:
        raise ValueError(f"only_queries marks {needed.shape[-1]} queries, the unrolled step has {length}")
    if needed is not None:
        needed = needed.any(0)  # a query row is scored for the whole batch
        if not needed.any():  # score one, so that every weight stays in the graph (DDP expects them all)
            needed = needed.clone()
            needed[-1] = True
    step, outputs = keys // length - 1, []
    for start in range(0, length, CHUNK):
        end = min(start + CHUNK, length)
        rows = None if needed is None else needed[start:end].nonzero().flatten() + start
        if rows is not None and len(rows) == end - start:
            rows = None  # every query of the chunk
        shape = (query.shape[0], end - start, query.shape[1], value.shape[-1])
        if rows is not None and len(rows) == 0:
            outputs.append(shape)  # zeros, once a scored chunk gives the dtype (autocast may change it)
            continue
        ranges = _key_ranges(start, end, step, length)
        columns = torch.cat([torch.arange(lo, hi, device=key.device) for lo, hi in ranges])
        chunk_mask = attention_mask[:, :, start:end] if rows is None else attention_mask.index_select(2, rows)
        out, _ = sdpa_attention_forward(
            module,
            query[:, :, start:end] if rows is None else query.index_select(2, rows),
            key.index_select(2, columns),
            value.index_select(2, columns),
            chunk_mask.index_select(-1, columns),
            dropout=dropout,
            scaling=scaling,
            **kwargs,
        )  # [batch, queries, heads, d]
        if rows is not None:
            out = out.new_zeros(shape).index_copy(1, rows - start, out)
        outputs.append(out)
    scored = next(out for out in outputs if isinstance(out, torch.Tensor))
    return torch.cat([out if isinstance(out, torch.Tensor) else scored.new_zeros(out) for out in outputs], dim=1), None


AttentionInterface.register(NAME, unrolled_sdpa)


def unrolled_attention(config):
    """Within the block, a model built from `config` whose attention is SDPA attends with `unrolled_sdpa`; other
    attention implementations (eager, or a family's own) keep the dense mask."""
    return attention_as(config, NAME)
