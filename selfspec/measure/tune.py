"""`selfspec tune`: choose the exit layer, gamma and tree from the speedup equation, on your data and machine.

For each draft (an exit depth, or the Medusa heads) it measures
- the acceptance by draft position: drafting `max_gamma` tokens per iteration on the prompts, the share of
  iterations in which the first i drafts were all accepted, P_i (greedy, or sampled with `do_sample`), so
  that E(gamma) = 1 + P_1 + ... + P_gamma tokens per pass without assuming i.i.d. acceptances;
- c, the time of one draft token over one plain decoding step, and v(gamma), one full pass over gamma+1
  positions over one plain step (`selfspec.measure.costs`). An early-exit verify runs its lower k
  layers for one position only (their KV entries come from the draft), so its v is taken as
  1 + (L - k) / L (v(gamma) - 1): the extra positions cost in the upper layers alone;
- r, the position cost of the batch-aware controller (`selfspec.engine.adaptive.DraftController`), per batch size in
  use: one full pass over rows x (gamma+1) positions against one over rows x 1, for gamma = 1..max_gamma, at
  each of `batch_sizes` (a batch-1 fit measures mostly per-pass overhead, and would keep gamma near 0 at batch
  sizes where a device verifies more positions almost for free);
- for Medusa trees, the tokens per pass of each candidate tree and the time per pass, both measured in the
  decoding loop (a tree pass also builds its mask and compacts the cache), over the time per pass of the
  plain loop (gamma = 0) on the same prompts.

The choice maximises S = E / (v + gamma c) (docs/design.md, "The math"). `--measure_grid` then times every
candidate side by side with `model.generate` and reports the tuned point against the best measured one.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from torch import nn

from ..adapter import ModelAdapter
from ..engine.adaptive import PositionCost, position_cost_from
from ..engine.stats import decoding_seconds, decoding_tokens, sum_stats
from ..heads import DraftHeads
from ..speculative import SelfSpeculative
from .contenders import DEFAULT_TREE, cut_tree
from .costs import _timed, measure_costs

CANDIDATE_TREES = [  # besides the chain: two and three candidates for the next token, then chains
    [[0], [1], [0, 0], [1, 0], [0, 0, 0]],
    DEFAULT_TREE,
    [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]],
]


@dataclass
class Choice:
    """One candidate configuration and its predicted speedup."""

    draft: str  # how it drafts (the heads' `DraftSetting.name`): exit_<k> or medusa
    chain: str  # what tables call its chains: exit <k> | medusa chain
    selects: dict  # the SelfSpeculative arguments that select these chains
    gamma: int  # drafts per iteration (a tree's node count)
    tree: list[list[int]] | dict | None  # Medusa: paths of ranks; EAGLE: a dynamic tree's shape
    tokens_per_pass: float  # E
    cost: float  # v + gamma c (a tree: v(nodes) + depth c)
    c: float
    v: float

    @property
    def predicted(self) -> float:
        return self.tokens_per_pass / self.cost

    @property
    def exit_layer(self) -> int | None:
        """The exit depth of an early-exit choice (None for other heads)."""
        return self.selects.get("exit_layer")

    @property
    def label(self) -> str:
        if isinstance(self.tree, dict):
            shape = self.tree
            return f"{self.draft} tree of {shape['nodes']} nodes (top-{shape['top_k']}, depth {shape['depth']})"
        if self.tree is not None:
            return f"{self.draft} tree of {len(self.tree)} nodes"
        return f"{self.chain}, gamma {self.gamma}"

    def options(self) -> dict:
        """SelfSpeculative arguments for this configuration (fixed gamma, no adaptation)."""
        if self.tree is not None:
            return {"tree": self.tree}
        return {**self.selects, "num_draft_tokens": self.gamma, "adaptive": False}


def candidate_trees(depth: int) -> list[list[list[int]]]:
    """`CANDIDATE_TREES` cut to `depth` levels; none where the heads draft chains only (depth 0)."""
    return [cut_tree(tree, depth) for tree in CANDIDATE_TREES] if depth else []


def run_prompts(spec: SelfSpeculative, prompts: list[torch.Tensor], max_new_tokens: int, do_sample: bool):
    """Generate for every prompt; return the summed statistics as a dict (`sum_stats`)."""
    runs = []
    for prompt in prompts:
        spec.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                      do_sample=do_sample)  # fmt: skip
        runs.append(spec.stats.to_dict())
    return sum_stats(runs)


def decoding_pass_seconds(stats: dict) -> float:
    """Seconds per iteration of summed stats while decoding (`decoding_seconds`: the prompt's pass left out)."""
    if not stats["iterations"]:
        raise ValueError("every prompt ended at its first token: no decoding step to time (raise max_new_tokens).")
    return decoding_seconds(stats) / stats["iterations"]


def prefix_acceptance(stats: dict, gamma: int) -> list[float]:
    """P_i: the share of iterations whose first i drafts were all accepted, i = 1..gamma."""
    proposed = stats.get("proposed_per_position", [])
    accepted = stats.get("accepted_per_position", [])
    return [accepted[i] / proposed[i] if i < len(proposed) and proposed[i] else 0.0 for i in range(gamma)]


@torch.no_grad()
def tune(
    model: nn.Module,
    heads: DraftHeads,
    prompts: list[torch.Tensor],
    max_new_tokens: int = 64,
    max_gamma: int = 8,
    do_sample: bool = False,
    timing_repeats: int = 20,
    draft_vocab=None,
    batch_sizes: tuple[int, ...] = (1,),
) -> tuple[list[Choice], PositionCost]:
    """Every candidate configuration with its predicted speedup, best first, and the position cost r: fitted
    per batch size in `batch_sizes` ({rows: r}, see `fit_position_costs`), or one number when that is (1,) (the
    adaptive controller uses it to shrink gamma as the batch grows)."""
    adapter = ModelAdapter(model, packed_weights=None)  # SelfSpeculative's default rule
    settings = heads.draft_settings(adapter.num_layers, max_gamma)
    sizes = [s.max_gamma for s in settings] + [len(tree) for s in settings for tree in candidate_trees(s.tree_depth)]
    sizes += [shape["nodes"] for s in settings for shape in s.dynamic_trees]
    longest = max(sizes)  # the most drafts one verify pass covers
    reference = model.generate(prompts[0], attention_mask=torch.ones_like(prompts[0]), do_sample=False,
                               max_new_tokens=max(longest + 2, 16))  # fmt: skip
    vocab = adapter.draft_vocabulary(draft_vocab) if draft_vocab is not None else None
    costs = measure_costs(adapter, heads, reference, timing_repeats, max_gamma=longest, vocab=vocab)
    choices = []
    for setting in settings:
        c = costs.c(setting.timed) / setting.per_call
        spec = SelfSpeculative(model, heads=heads, num_draft_tokens=setting.max_gamma, adaptive=False,
                               draft_vocab=draft_vocab, **setting.options)  # fmt: skip
        accepted = prefix_acceptance(run_prompts(spec, prompts, max_new_tokens, do_sample), setting.max_gamma)
        for gamma in range(1, setting.max_gamma + 1):
            tokens, v = 1 + sum(accepted[:gamma]), 1 + setting.upper * (costs.v(gamma) - 1)
            choices.append(Choice(setting.name, setting.label, setting.options, gamma, None, tokens, v + gamma * c,
                                  c, v))  # fmt: skip
        trees = candidate_trees(setting.tree_depth) + list(setting.dynamic_trees)
        if trees:
            plain = run_prompts(SelfSpeculative(model, num_draft_tokens=0), prompts, max_new_tokens, do_sample)
            plain_pass = decoding_pass_seconds(plain)
        for tree in trees:  # tokens per pass and the time per pass, measured in the loop with v as it is here
            # adaptive=False: every iteration verifies a tree, never a plain step instead
            spec = SelfSpeculative(model, heads=heads, tree=tree, draft_vocab=draft_vocab, adaptive=False)
            stats = run_prompts(spec, prompts, max_new_tokens, do_sample)
            depth = tree["depth"] if isinstance(tree, dict) else max(len(path) for path in tree)
            cost = decoding_pass_seconds(stats) / plain_pass  # (raises where nothing was decoded)
            tokens = decoding_tokens(stats) / stats["iterations"]  # as a chain's 1 + sum P_i: per decoding pass
            nodes = tree["nodes"] if isinstance(tree, dict) else len(tree)
            choices.append(Choice(setting.name, setting.label, {}, nodes, tree, tokens, cost, c, cost - depth * c))
    if tuple(batch_sizes) == (1,):
        position_cost = statistics.median(position_cost_from(costs.v(g), g) for g in range(1, longest + 1))
    else:
        times = time_batched_passes(adapter, reference, batch_sizes, longest, timing_repeats)
        position_cost = fit_position_costs(times)
    return sorted(choices, key=lambda choice: -choice.predicted), position_cost


def fit_position_costs(times: dict[tuple[int, int], float]) -> dict[int, float]:
    """r per batch size from pass times {(rows, positions per row): seconds} that hold positions 1 and more
    for each batch size: at `rows`, the median over gamma of the r that solves
    v = t(rows, gamma+1) / t(rows, 1) = (1 + r rows (gamma+1)) / (1 + r rows)."""
    fitted = {}
    for rows in sorted({rows for rows, _ in times}):
        step = times[rows, 1]
        gammas = [positions - 1 for size, positions in times if size == rows and positions > 1]
        fitted[rows] = statistics.median(position_cost_from(times[rows, g + 1] / step, g, rows) for g in gammas)
    return fitted


@torch.no_grad()
def time_batched_passes(
    adapter: ModelAdapter, tokens: torch.Tensor, batch_sizes, max_gamma: int, repeats: int
) -> dict[tuple[int, int], float]:
    """Median seconds of one full pass over rows x positions new tokens, positions = 1..max_gamma+1, after a
    cached context of `tokens` [1, n] repeated over the rows; the passes are interleaved within each repetition
    (after two warm-up rounds), and each is cropped off the cache again, so every pass sees the same context."""
    context = tokens.shape[1] - max_gamma - 1
    device = adapter.device
    times: dict[tuple[int, int], list[float]] = {}
    for rows in batch_sizes:
        cache = adapter.new_cache()
        ids = tokens.expand(rows, -1)
        adapter.forward(ids[:, :context], torch.arange(context, device=device)[None].expand(rows, -1), cache,
                        logits_to_keep=1)  # fmt: skip
        for repeat in range(repeats + 2):
            for positions in range(1, max_gamma + 2):
                new = ids[:, context : context + positions]
                where = torch.arange(context, context + positions, device=device)[None].expand(rows, -1)
                seconds = _timed(lambda fresh, new=new, where=where: adapter.forward(new, where, fresh), cache, device)
                if repeat >= 2:
                    times.setdefault((rows, positions), []).append(seconds)
                adapter.crop(cache, positions)
    return {key: statistics.median(values) for key, values in times.items()}


def apply_choice(heads: DraftHeads, choice: Choice, position_cost: PositionCost | None = None) -> None:
    """Make `choice` the heads' defaults (gamma, and the exit layer or the tree), with the position cost."""
    heads.num_draft_tokens = choice.gamma if choice.tree is None else None
    heads.position_cost = position_cost
    heads.set_defaults(choice.options())


TUNED_SECTION = "## Tuned defaults"


def tuned_card(card: str, table: str, choice: Choice, command: str) -> str:
    """The heads' card with its tuned-defaults section replaced by this one."""
    kept = card.split(TUNED_SECTION)[0].rstrip() + "\n\n"
    return kept + (
        f"{TUNED_SECTION}\n\nWritten by `{command}`: {choice.label}, predicted speedup {choice.predicted:.2f}x "
        "(S = E / cost with E the measured tokens per pass, cost = v + gamma c in plain decoding steps).\n\n"
        + table
        + "\n"
    )


def format_choices(choices: list[Choice], measured: dict[str, float] | None = None, top: int = 12) -> str:
    """The best `top` candidates as a Markdown table (with the measured speedups when given)."""
    head = "| configuration | E (tokens/pass) | c | v | cost | predicted |"
    rule = "|---|---|---|---|---|---|"
    if measured:
        head, rule = head + " measured |", rule + "---|"
    lines = [head, rule]
    for choice in choices[:top]:
        line = (
            f"| {choice.label} | {choice.tokens_per_pass:.2f} | {choice.c:.3f} | {choice.v:.2f} | "
            f"{choice.cost:.2f} | {choice.predicted:.2f}x |"
        )
        if measured:
            value = measured.get(choice.label)
            line += f" {value:.2f}x |" if value is not None else " - |"
        lines.append(line)
    return "\n".join(lines)
