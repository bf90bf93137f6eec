"""What one `generate` call did: passes, proposals, acceptances and where the time went."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class GenerationStats:
    """Statistics of the last `SelfSpeculative.generate` call (`spec.stats`)."""

    new_tokens: int = 0  # tokens generated (all rows)
    target_passes: int = 0  # full-model passes: the prefill, then one verify (or plain step) per iteration
    iterations: int = 0  # draft-verify iterations after the prefill
    row_passes: int = 0  # passes summed over the rows they served (= target_passes for one prompt)
    proposed: int = 0  # drafted tokens put to the verifier
    accepted: int = 0  # drafted tokens the verifier kept
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts accepted at draft position i+1
    proposed_per_position: list[int] = field(default_factory=list)  # [i]: drafts proposed at draft position i+1
    # analytic acceptance rate: mean over tested positions of sum_x min(p, q) (a tree of deterministic candidates:
    # p's mass on a node's candidates); greedy tallies it on one drafting iteration in `call.GREEDY_ALPHA_EVERY`
    # (its rule needs no softmax), sampling on every one
    alpha: float = float("nan")
    drafted_by: dict[str, dict[str, int]] = field(
        default_factory=dict
    )  # drafter name -> iterations, proposed, accepted
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0  # the verify passes (plain steps too) and the prompt's pass
    prefill_seconds: float = 0.0  # of which the prompt's pass
    total_seconds: float = 0.0
    # v(gamma) by gamma as the adaptive choice used it where it was measured on this machine (`engine.verify_cost`),
    # and the seconds this call spent measuring it (0 after the first call on the same model, dtype and batch size)
    verify_costs: tuple[float, ...] | None = None
    measure_seconds: float = 0.0

    @property
    def alpha_hat(self) -> float:
        """Empirical acceptance rate: accepted / proposed."""
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def tokens_per_pass(self) -> float:
        """Mean tokens a row gains per full-model pass (1.0 for plain decoding)."""
        return self.new_tokens / self.row_passes if self.row_passes else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds else float("nan")

    def __repr__(self) -> str:
        return (
            f"GenerationStats(new_tokens={self.new_tokens}, target_passes={self.target_passes}, "
            f"proposed={self.proposed}, accepted={self.accepted}, alpha_hat={self.alpha_hat:.3f}, "
            f"alpha={self.alpha:.3f}, tokens_per_pass={self.tokens_per_pass:.2f}, "
            f"tokens_per_second={self.tokens_per_second:.1f})"
        )

    def __str__(self) -> str:
        """A few lines with the figures people look at (what `print(spec.stats)` shows)."""
        lines = [
            f"{self.new_tokens} new tokens in {self.total_seconds:.2f} s ({self.tokens_per_second:.1f} tokens/s), "
            f"{self.target_passes} target passes (prefill + {self.iterations} iterations), "
            f"{self.tokens_per_pass:.2f} tokens per pass",
        ]
        if self.proposed:
            by_position = ", ".join(
                f"{accepted}/{proposed}"
                for accepted, proposed in zip(self.accepted_per_position, self.proposed_per_position, strict=True)
            )
            lines.append(
                f"drafts: {self.accepted} of {self.proposed} accepted, alpha_hat {self.alpha_hat:.3f} "
                f"(accepted / proposed), alpha {self.alpha:.3f} (analytic: mean of sum_x min(p, q))"
            )
            lines.append(f"accepted / proposed by draft position 1, 2, ...: {by_position}")
        else:
            lines.append("drafts: none proposed (plain decoding steps only)")
        other = max(0.0, self.total_seconds - self.draft_seconds - self.verify_seconds - self.measure_seconds)
        measuring = f", measuring v {self.measure_seconds:.2f} s" if self.measure_seconds else ""
        verify = f"verify {self.verify_seconds:.2f} s{measuring}"
        lines.append(f"time: draft {self.draft_seconds:.2f} s, {verify}, other {other:.2f} s")
        if self.verify_costs is not None:
            costs = ", ".join(f"{v:.2f}" for v in self.verify_costs[1:])
            lines.append(f"verify cost v(gamma) measured here, gamma = 1, 2, ...: {costs} plain steps")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        out = dict(self.__dict__)
        out.update(
            alpha_hat=self.alpha_hat, tokens_per_pass=self.tokens_per_pass, tokens_per_second=self.tokens_per_second
        )
        return out

    def finish(self, times: dict[str, float], alpha_sum: float, alpha_count: float, started: float):
        """Fill in the time split (sections timed by a `Stopwatch`), the analytic alpha and the total time."""
        self.draft_seconds = times.get("draft", 0.0)
        self.prefill_seconds = times.get("prefill", 0.0)
        self.verify_seconds = times.get("verify", 0.0) + self.prefill_seconds
        self.measure_seconds = times.get("measure", 0.0)
        self.alpha = alpha_sum / alpha_count if alpha_count else float("nan")
        self.total_seconds = time.perf_counter() - started
        return self

    def record_iteration(self, gamma: int, num_accepted: list[int], drafter: str | None = None) -> None:
        """Count one verification of `gamma` drafts per row (drafted by `drafter`), with each row's accepted count."""
        self.iterations += 1
        self.target_passes += 1
        self.row_passes += len(num_accepted)
        if gamma == 0:
            return
        rows, accepted = len(num_accepted), sum(num_accepted)
        tally = self.drafted_by.setdefault(drafter or "draft", {"iterations": 0, "proposed": 0, "accepted": 0})
        tally["iterations"] += 1
        tally["proposed"] += gamma * rows
        tally["accepted"] += accepted
        self.proposed += gamma * rows
        self.accepted += accepted
        grow = gamma - len(self.proposed_per_position)
        if grow > 0:
            self.proposed_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for position in range(gamma):
            self.proposed_per_position[position] += rows
            self.accepted_per_position[position] += sum(count > position for count in num_accepted)


def sum_stats(runs: list[dict]) -> dict:
    """The counters and times of several runs' `GenerationStats.to_dict()` added up (per-position lists
    position by position); alpha and the ratios derived from the counters are left out."""
    derived = {"alpha", "alpha_hat", "tokens_per_pass", "tokens_per_second"}
    total: dict = {}
    for run in runs:
        for key, value in run.items():
            if isinstance(value, list):  # per draft position
                summed = total.setdefault(key, [])
                summed.extend([0] * (len(value) - len(summed)))
                for position, count in enumerate(value):
                    summed[position] += count
            elif isinstance(value, int | float) and key not in derived:
                total[key] = total.get(key, 0) + value
    return total


def decoding_seconds(total: dict) -> float:
    """The seconds of (summed) stats spent decoding: all but the prompt's pass and the measuring of v. (On CUDA those
    two are event times and the total a wall clock, so a launch-bound prompt's pass is partly counted as decoding.)"""
    return total["total_seconds"] - total["prefill_seconds"] - total["measure_seconds"]


def decoding_tokens(total: dict) -> int:
    """The tokens of (summed) stats of one-prompt calls that decoding made: all but the one each call's prompt's pass
    yields (one pass per call that is no iteration)."""
    return total["new_tokens"] - (total["target_passes"] - total["iterations"])


class Stopwatch:
    """Sums the time spent in named sections without synchronising the device inside the loop.

    On CUDA it records events and reads them once at the end; elsewhere kernels run synchronously
    and a wall clock is exact.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds: dict[str, float] = {}
        self._events: list[tuple[str, object, object]] = []

    @contextmanager
    def section(self, name: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((name, start, end))
        else:
            start = time.perf_counter()
            yield
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def totals(self) -> dict[str, float]:
        if self._events:
            torch.cuda.synchronize()
            for name, start, end in self._events:
                self.seconds[name] = self.seconds.get(name, 0.0) + start.elapsed_time(end) / 1000.0
            self._events.clear()
        return self.seconds
