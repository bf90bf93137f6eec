"""What a verify pass costs on this machine, measured once per model, device, dtype and batch size.

Adaptive drafting needs v(gamma): one pass of the target over gamma + 1 positions, over one plain decoding
step. It is about 1 where decoding is bound by reading the weights (a GPU, a CPU with native bf16 kernels) and far
from it elsewhere: on a CPU without native bf16, a bfloat16 pass over 4 positions can cost 2.4 plain steps. A
default that assumed v = 1 there drafted 10 tokens per pass at an acceptance of 1% and ran at a third of
`model.generate`'s speed. So, when no position cost is given, the wrapper measures v on the call's own cache
right after the prefill, at the widths it may verify, and keeps the figures for later calls on the same model.

The passes run over copies of the pending token at the positions the next iteration will write, and their
cache entries are cropped away at once: the call's output does not depend on them.
"""

from __future__ import annotations

import time
import weakref

import torch

from .drafter import target_pass
from .state import DecodeState

ROUNDS = 2  # timings per width; the fastest counts (a pause of the process only ever adds time)
WIDTHS = (1, 2, 3, 5, 9)  # positions per pass measured, and the widest the call may verify; others are interpolated

# model -> {(device, dtype, packed weights, rows, widest): v by gamma}; weak, so a model's figures go with it
_MEASURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def measured_verify_costs(adapter, state: DecodeState, max_gamma: int, hidden_layers=()) -> tuple[float, ...]:
    """v(gamma) for gamma = 0..max_gamma at the batch size of `state` (v(0) = 1): measured on `state`'s cache the
    first time for this model, device, dtype, weight layout and batch size, from the cache of figures after that."""
    packed = getattr(adapter, "packed", None) is not None  # packed weights make wide passes cheaper
    key = (str(adapter.device), str(adapter.dtype), packed, state.batch_size, max_gamma)
    known = _MEASURED.setdefault(adapter.model, {})
    if key not in known:
        known[key] = _measure(adapter, state, max_gamma, hidden_layers)
    return known[key]


def forget_verify_costs(model) -> None:
    """Drop the figures measured for `model` (after moving it to another device or dtype they are re-keyed anyway;
    this is for a machine whose load changed)."""
    _MEASURED.pop(model, None)


def _measure(adapter, state: DecodeState, max_gamma: int, hidden_layers) -> tuple[float, ...]:
    widths = sorted({w for w in WIDTHS if w <= max_gamma + 1} | {1, max_gamma + 1})
    pending = state.sequences[:, -1:]
    seconds: dict[int, list[float]] = {width: [] for width in widths}
    _timed_pass(adapter, state, pending.expand(-1, widths[-1]), hidden_layers)  # warm-up: the widest pass's buffers
    for _ in range(ROUNDS):
        for width in widths:
            seconds[width].append(_timed_pass(adapter, state, pending.expand(-1, width), hidden_layers))
    step = min(seconds[1])
    # gamma -> v; never below 1: a pass over more positions does more work, and a narrower one timed slower is noise
    at = {width - 1: max(1.0, min(times) / step) for width, times in seconds.items()}
    measured = sorted(at)
    costs = []
    for gamma in range(max_gamma + 1):
        low = max(g for g in measured if g <= gamma)
        high = min(g for g in measured if g >= gamma)
        share = 0.0 if high == low else (gamma - low) / (high - low)
        costs.append(at[low] + share * (at[high] - at[low]))
    costs[0] = 1.0
    return tuple(costs)


def _timed_pass(adapter, state: DecodeState, tokens: torch.Tensor, hidden_layers) -> float:
    """Seconds for one target pass over `tokens` [batch, n] on the call's cache; its entries are cropped after."""
    synchronize = torch.cuda.synchronize if adapter.device.type == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    target_pass(adapter, state, tokens.contiguous(), hidden_layers)
    synchronize()
    elapsed = time.perf_counter() - start
    adapter.crop(state.cache, tokens.shape[1])
    return elapsed
