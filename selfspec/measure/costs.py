"""c and v, timed: one-token steps of the target and of each draft of a heads set after a cached context, and
verify passes over gamma+1 positions, as `Costs` (`selfspec.heads.base`) for the speedup equation."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch

from ..adapter import DraftVocabulary, ModelAdapter
from ..heads.base import Costs, DraftHeads


def _timed(run: Callable[[object], object], state: object, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run(state)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


@torch.no_grad()
def measure_costs(
    adapter: ModelAdapter,
    heads: DraftHeads,
    tokens: torch.Tensor,
    repeats: int = 20,
    max_gamma: int = 0,
    vocab: DraftVocabulary | None = None,
) -> Costs:
    """Time one-token steps after a cached context `tokens[:, :n - max(max_gamma, 1) - 1]` ([1, n] ids).

    Full step: all layers for one token. Drafts: what the heads' `cost_timers` give (exit depth k: layers
    0..k-1 and exit head k for one token; Medusa: all heads on one hidden state, as they run together once per
    iteration). v(gamma), gamma = 1..max_gamma: one full pass over gamma+1 new positions. Drafts read only a
    reduced `vocab`'s LM-head rows when given.
    Every call starts from a copy of the same prefilled cache;
    the calls are interleaved within each repetition, so that load on a shared machine slows all of them
    alike, and the median over `repeats` (after two warm-up rounds) is kept.
    """
    context = tokens.shape[1] - max(max_gamma, 1) - 1
    if context < 1:
        raise ValueError(f"timing needs more than {max(max_gamma, 1) + 1} tokens; got {tokens.shape[1]}")
    device = adapter.device
    cache = adapter.new_cache()
    _, hidden = adapter.forward_with_hidden(tokens[:, :context], torch.arange(context, device=device)[None], cache)

    def after(count: int):  # the next `count` tokens and their positions
        return tokens[:, context : context + count], torch.arange(context, context + count, device=device)[None]

    def full(count: int):
        ids, positions = after(count)
        return lambda fresh_cache: adapter.forward(ids, positions, fresh_cache)

    ids, positions = after(1)
    # timed as generation runs them: in the target's dtype (training keeps float32 heads on a half-precision target)
    # and in eval mode: a draft LoRA's dropout would time another computation and draw from the global RNG, which
    # a resumed training run restored (it measures c at the start of every session)
    heads = copy.deepcopy(heads).to(dtype=adapter.dtype).eval()
    timers = heads.cost_timers(adapter, ids, positions, hidden, vocab)  # {label: (call, drafts charged)}
    calls: dict[object, Callable[[object], object]] = {"step": full(1)}
    calls.update({label: call for label, (call, _) in timers.items()})
    calls.update({gamma: full(gamma + 1) for gamma in range(1, max_gamma + 1)})
    times: dict[object, list[float]] = {key: [] for key in calls}
    for _ in range(repeats + 2):
        for key, call in calls.items():
            times[key].append(_timed(call, copy.deepcopy(cache), device))  # the copy is made before the clock starts
    median = {key: statistics.median(values[2:]) for key, values in times.items()}
    draft_s = {name: median[label] for label, (_, names) in timers.items() for name in names}
    return Costs(median["step"], draft_s, {gamma: median[gamma] for gamma in range(1, max_gamma + 1)})
