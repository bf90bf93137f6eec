"""The speedup equation, and choosing gamma at run time from it, so that a bad draft cannot slow generation down.

With acceptance rate alpha, draft cost c (one draft token over one plain decoding step) and verify cost
v (one pass over gamma+1 positions over one plain step), an iteration of gamma drafts gains
E = (1 - alpha^(gamma+1)) / (1 - alpha) tokens for v + gamma c steps' worth of time, so the speedup over
plain decoding is S(gamma) = E / (v + gamma c) (docs/design.md, "The math"), and S(0) = 1. The controller keeps
a running estimate of alpha from the acceptances it sees (recent iterations weigh most), drafts the
gamma with the largest predicted S, falls back to plain steps (gamma = 0) when no gamma beats 1, and
probes with one draft now and then so that it notices when acceptance recovers.

A tree drafter has no gamma to choose: `TreeController` weighs its trees as a whole, the tokens a tree yields
against its verify pass over all its candidates and its drafting, and falls back to plain steps in the same way.

Within a call, decisions depend only on acceptances and on the verify costs v, never on the clock as it runs. v is
timed once per model, device, dtype, weight layout, batch size and widest pass, and kept for later calls
(`selfspec.engine.verify_cost`), so the first call on a model (often a warm-up) fixes the figures the later ones
decide by; a given `position_cost` replaces the timing, and a seeded run is then reproducible. The same
equation, with measured alphas and costs (`expected_tokens`, `best_gamma`), predicts what trained heads will gain
(`selfspec.heads`, `selfspec tune`, `selfspec profile`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


def position_cost_from(verify_cost: float, gamma: int, rows: int = 1) -> float:
    """r from one measured v(gamma) at `rows` rows: solves v = (1 + r rows (gamma+1)) / (1 + r rows)
    (see `DraftController`). v can only approach gamma+1 (every position costing a whole pass); a measured v
    at or above it (a compute-bound batch, or timing noise) is read as that limit, a very large r."""
    if verify_cost <= 1.0:
        return 0.0
    return (verify_cost - 1.0) / max(gamma + 1 - verify_cost, 1e-6) / rows


PositionCost = float | dict[int, float]  # one r for every batch size, or r measured per batch size (rows -> r)


def modeled_verify_cost(position_cost: float, gamma: int, rows: int) -> float:
    """v(gamma) for a batch of `rows` from r: with a pass costing t0 + r t0 N for N positions, a pass over
    rows x (gamma + 1) positions against a plain step over `rows`: (1 + r rows (gamma+1)) / (1 + r rows)."""
    return (1 + position_cost * rows * (gamma + 1)) / (1 + position_cost * rows)


def check_position_cost(value) -> PositionCost:
    """A position cost as `SelfSpeculative(position_cost=)` and heads configs give it (a JSON object's keys are
    strings), checked: a non-negative number, or a non-empty {rows: r} of them. Raises ValueError otherwise."""
    if isinstance(value, dict) and value:
        try:
            costs = {int(rows): float(r) for rows, r in value.items()}
        except (TypeError, ValueError):
            costs = {}
        if costs and all(rows >= 1 and r >= 0 for rows, r in costs.items()):
            return dict(sorted(costs.items()))
    elif isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return float(value)
    raise ValueError(
        f"position_cost={value!r} must be a non-negative number, or a mapping from batch size to one "
        "(as `selfspec tune --batch_sizes` writes it)."
    )


def position_cost_at(cost: PositionCost, rows: int) -> float:
    """r for a batch of `rows`: the number itself, or interpolated linearly between the measured batch sizes
    (the nearest one's outside them)."""
    if not isinstance(cost, dict):
        return cost
    sizes = list(cost)
    if rows <= sizes[0]:
        return cost[sizes[0]]
    for low, high in zip(sizes, sizes[1:], strict=False):
        if rows <= high:
            return cost[low] + (cost[high] - cost[low]) * (rows - low) / (high - low)
    return cost[sizes[-1]]


def predicted_speedup(alpha: float, gamma: int, draft_cost: float, verify_cost: float = 1.0) -> float:
    """S(gamma) = (1 - alpha^(gamma+1)) / ((1 - alpha) (v + gamma c)); S(0) = 1 (a plain step)."""
    if gamma == 0:
        return 1.0
    tokens = gamma + 1 if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens / (verify_cost + gamma * draft_cost)


def expected_tokens(alphas: list[float]) -> float:
    """Tokens committed per iteration when draft i is accepted with probability alphas[i] once drafts
    0..i-1 were: 1 + a_1 + a_1 a_2 + ... (the bonus or corrected token counts as the 1)."""
    total, reach = 1.0, 1.0
    for alpha in alphas:
        reach *= alpha
        total += reach
    return total


def best_gamma(alpha: float, c: float, max_gamma: int, v: Callable[[int], float] = lambda gamma: 1.0):
    """(gamma, S(gamma)) with the largest predicted speedup `predicted_speedup` for gamma = 1..max_gamma (a
    speedup below 1 says that drafting at this depth cannot pay)."""
    return max(((g, predicted_speedup(alpha, g, c, v(g))) for g in range(1, max_gamma + 1)), key=lambda x: x[1])


@dataclass
class Backoff:
    """While drafting does not pay: plain steps, and a probe (one drafting iteration, to see whether acceptance
    has recovered) after `every` of them; a probe that keeps nothing doubles the wait, up to `longest`."""

    every: int = 8
    longest: int = 64
    _plain_steps: int = field(default=0, init=False)
    _interval: int = field(default=0, init=False)
    _probing: bool = field(default=False, init=False)

    def __post_init__(self):
        self._interval = self.every

    def drafting(self) -> None:
        """Drafting pays: a later fallback waits `every` plain steps before its first probe."""
        self._plain_steps, self._interval, self._probing = 0, self.every, False

    def probe_due(self) -> bool:
        """Drafting does not pay: True when this iteration is a probe, False for a plain step."""
        self._plain_steps += 1
        self._probing = self._plain_steps >= self._interval
        if self._probing:
            self._plain_steps = 0
        return self._probing

    def probed(self, kept: bool) -> None:
        """What the iteration just verified kept (anything or nothing); after a probe, it sets the next wait."""
        if self._probing:
            self._interval = self.every if kept else min(2 * self._interval, self.longest)
            self._probing = False


@dataclass
class DraftController:
    """Picks gamma for each iteration; `update` feeds it what the verifier accepted."""

    max_drafts: int
    draft_cost: float  # c
    verify_cost: float = 1.0  # v at one row, for every gamma, when position_cost is 0
    position_cost: PositionCost = 0.0  # r: what one more position adds to a pass, over its fixed cost (see below)
    verify_costs: tuple[float, ...] | None = None  # v by gamma, measured at the call's batch size: overrides both
    decay: float = 0.9  # weight of the past per iteration: about the last ten iterations count
    prior_alpha: float = 0.5  # what alpha is taken to be before any evidence ...
    prior_weight: float = 2.0  # ... worth this many tested positions
    probe_every: int = 8  # plain steps before a single-draft probe while speculation does not pay ...
    max_probe_every: int = 64  # ... doubling after each rejected probe up to this, back to probe_every on success
    _accepted: float = field(default=0.0, init=False)
    _tested: float = field(default=0.0, init=False)
    # per draft position i: decayed counts of drafts accepted there, of drafts tested there (the rule reached it)
    _accepted_at: list[float] = field(default_factory=list, init=False)
    _tested_at: list[float] = field(default_factory=list, init=False)
    _backoff: Backoff = field(init=False)

    def __post_init__(self):
        self._backoff = Backoff(self.probe_every, self.max_probe_every)

    @property
    def alpha(self) -> float:
        return (self._accepted + self.prior_alpha * self.prior_weight) / (self._tested + self.prior_weight)

    def verify_cost_at(self, gamma: int, rows: int) -> float:
        """v(gamma) for a batch of `rows`, from r (`modeled_verify_cost`). r = 0 (memory-bound decoding) gives
        `verify_cost` at every batch size. r may depend on the batch size (measured per size by `selfspec tune`):
        where a device verifies a wide batch's positions almost for free, the r fitted at one row (per-pass
        overhead, mostly) would starve drafting there. Measured `verify_costs` (`selfspec.engine.verify_cost`) win
        over both: taken at the batch size the call started with, they overstate v a little once rows have
        finished, which errs towards drafting less."""
        if self.verify_costs is not None:
            return self.verify_costs[min(gamma, len(self.verify_costs) - 1)]
        r = position_cost_at(self.position_cost, rows)
        if r == 0.0:
            return self.verify_cost
        return modeled_verify_cost(r, gamma, rows)

    def expected_tokens(self, gamma: int) -> float:
        """E(gamma): tokens an iteration of gamma drafts yields, 1 + sum_i prod_{j <= i} a_j, from the rate a_j
        at which draft position j is accepted once the rule reaches it (the pooled alpha as its prior). With
        independent acceptances this is the closed form (1 - alpha^(gamma+1)) / (1 - alpha); where drafts come
        right or wrong in runs (n-gram lookup copies whole spans) it follows the runs instead."""
        pooled, tokens, reach = self.alpha, 1.0, 1.0
        for position in range(gamma):
            accepted = self._accepted_at[position] if position < len(self._accepted_at) else 0.0
            tested = self._tested_at[position] if position < len(self._tested_at) else 0.0
            reach *= (accepted + pooled * self.prior_weight) / (tested + self.prior_weight)
            tokens += reach
        return tokens

    def best(self, limit: int, rows: int = 1) -> tuple[int, float]:
        """The gamma (at most `limit`) with the largest predicted speedup for a batch of `rows`, and that speedup."""

        def speedup(gamma: int) -> float:
            return self.expected_tokens(gamma) / (self.verify_cost_at(gamma, rows) + gamma * self.draft_cost)

        best = max(range(max(0, min(self.max_drafts, limit)) + 1), key=speedup)
        return best, speedup(best)

    def choose(self, limit: int, rows: int = 1) -> int:
        """gamma for the next iteration of a batch of `rows`, at most `limit` (what the token budget allows)."""
        if limit <= 0:
            return 0
        best, _ = self.best(limit, rows)
        if best > 0:
            self._backoff.drafting()
            return best
        return 1 if self._backoff.probe_due() else 0  # a probe keeps alpha up to date

    def update(self, gamma: int, num_accepted: list[int]) -> None:
        """Record an iteration of `gamma` drafts in which row b kept `num_accepted[b]` of them."""
        if gamma == 0:
            return
        self._backoff.probed(any(num_accepted))
        self._accepted = self.decay * self._accepted + sum(num_accepted)
        grow = gamma - len(self._tested_at)
        self._accepted_at += [0.0] * max(grow, 0)
        self._tested_at += [0.0] * max(grow, 0)
        for position in range(len(self._tested_at)):
            self._accepted_at[position] = self.decay * self._accepted_at[position] + sum(
                n > position for n in num_accepted
            )
            self._tested_at[position] = self.decay * self._tested_at[position] + sum(
                n >= position and position < gamma for n in num_accepted
            )
        # the rule tests positions 1..n+1 (all gamma when every draft is accepted)
        self._tested = self.decay * self._tested + sum(min(n + 1, gamma) for n in num_accepted)


@dataclass
class TreeController:
    """A tree drafter's choice for each iteration: its tree, or a plain step. A tree of N candidates costs v(N) + c
    (its verify pass over N + 1 positions and its drafting, both over a plain step) and yields 1 + the depth the
    rule accepted. From decayed sums of both over the trees verified so far, it drafts while the predicted speedup
    (tokens over cost) is above 1, and otherwise takes plain steps with a probing tree now and then (`Backoff`)."""

    verify_costs: tuple[float, ...]  # v(N) for N = 0..the most candidates a tree of this drafter has
    draft_cost: float  # c of drafting one tree
    decay: float = 0.9  # weight of the past per tree: about the last ten trees count
    prior_tokens: float = 2.0  # tokens a tree is taken to yield before any evidence (at the widest tree's cost) ...
    prior_weight: float = 2.0  # ... worth this many trees
    probe_every: int = 8
    max_probe_every: int = 64
    _tokens: float = field(default=0.0, init=False)
    _cost: float = field(default=0.0, init=False)
    _backoff: Backoff = field(init=False)

    def __post_init__(self):
        self._backoff = Backoff(self.probe_every, self.max_probe_every)

    def cost(self, nodes: int) -> float:
        """v(N) + c of a tree of `nodes` candidates."""
        return self.verify_costs[min(nodes, len(self.verify_costs) - 1)] + self.draft_cost

    def speedup(self) -> float:
        """The predicted speedup of drafting trees over plain steps."""
        prior_cost = self.cost(len(self.verify_costs) - 1)
        weight = self.prior_weight
        return (self._tokens + self.prior_tokens * weight) / (self._cost + prior_cost * weight)

    def choose(self) -> bool:
        """True: draft a tree this iteration; False: a plain step."""
        if self.speedup() > 1.0:
            self._backoff.drafting()
            return True
        return self._backoff.probe_due()

    def update(self, nodes: int, num_accepted: int) -> None:
        """Record a tree of `nodes` candidates in which the rule accepted `num_accepted` of them along one path."""
        self._backoff.probed(num_accepted > 0)
        self._tokens = self.decay * self._tokens + num_accepted + 1
        self._cost = self.decay * self._cost + self.cost(nodes)


def choose_drafter(
    controllers: list[DraftController], available: list[bool], limit: int, rows: int = 1
) -> tuple[int | None, int]:
    """Which of several drafters drafts the next iteration, and how many tokens: among those `available`,
    the one whose own acceptance and cost predict the largest speedup decides its gamma (with its own
    probing when none pays). (None, 0) when no drafter is available: a plain step."""
    options = [index for index, ready in enumerate(available) if ready]
    if not options or limit <= 0:
        return None, 0
    index = max(options, key=lambda i: controllers[i].best(limit, rows)[1])  # ties: the first listed
    return index, controllers[index].choose(limit, rows)
