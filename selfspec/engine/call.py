"""The working state of one `generate` call, and how an iteration's tokens are committed to it: EOS, token
budgets, stopping criteria, streamer and scores, with the iteration's one host synchronisation."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from .adaptive import DraftController, TreeController
from .generation import GenerationSetup, pads_stopped_rows, process_scores, row_wise, stopping_point
from .state import DecodeState
from .stats import GenerationStats, Stopwatch

# greedy decoding adds one drafting iteration in this many to the alpha tally: its rule needs only argmaxes,
# and alpha (a statistic nothing decides on) is what would make it build softmaxes over the vocabulary
GREEDY_ALPHA_EVERY = 4


@dataclass
class Call:
    """The working state of one `generate` call. Rows still generating are `state`'s rows; `rows[b]` is
    the caller's index of active row b."""

    setup: GenerationSetup
    state: DecodeState
    rows: list[int]
    generated: list[int]  # new tokens per active row
    watch: Stopwatch
    alpha: torch.Tensor  # [2] float64 on the device: sum of sum_x min(p, q), tested positions
    stats: GenerationStats = field(default_factory=GenerationStats)
    controllers: list[DraftController] = field(default_factory=list)  # per drafter, when drafting adapts
    tree_controller: TreeController | None = None  # a tree drafter's, when drafting adapts
    drafted_by: int | None = None  # the drafter of the iteration being committed (None: a plain step)
    done: dict[int, torch.Tensor] = field(default_factory=dict)  # caller's row -> its finished sequence
    scores: list[torch.Tensor] = field(default_factory=list)  # processed scores of committed tokens (batch 1)
    logits: list[torch.Tensor] = field(default_factory=list)  # raw logits of committed tokens (batch 1)
    greedy_drafting: int = 0  # greedy iterations that verified drafts, for `alpha_due`
    # without an end-of-sequence token (`pads_stopped_rows`), `generate` keeps a row that a stopping criterion stopped
    # going (unpadded)
    # until every row has stopped: caller's row -> its new tokens when a criterion first fired; then every row
    # has as many new tokens as the last row to stop (`limit`)
    stopped: dict[int, int] = field(default_factory=dict)
    limit: int = -1  # new tokens per row: max_new_tokens (set at the start), fewer once every row has stopped
    lengths: dict[int, int] = field(default_factory=dict)  # caller's row -> its new tokens when it finished

    def __post_init__(self):
        self.limit, self.num_rows = self.setup.max_new_tokens, len(self.rows)

    @cached_property
    def stop_tokens(self) -> torch.Tensor:
        """The end-of-sequence ids [K] on the device (K = 0 where there is none), made once per call."""
        return torch.tensor(sorted(self.setup.eos_token_ids), dtype=torch.long, device=self.state.sequences.device)

    @property
    def remaining(self) -> int:
        """New tokens the row closest to its budget may still take."""
        return self.limit - max(self.generated)

    def process(self, tokens: torch.Tensor, logits: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Processed scores [batch, P, V] of the positions after each row's tokens and tokens[:, :offset+i],
        with the input ids `model.generate` would give the processors (see `process_scores`). Where processors
        read the input ids, a row whose tokens before a position hold an end of sequence keeps the raw logits
        there: `generate` asks nothing after one (a drafter's proposals past it are cut by the commit)."""
        if self._all_at_once():  # the input ids go unread
            return process_scores(self.setup.processors, self.state.sequences, tokens, logits, offset)
        return self._process_rows(tokens, logits, offset)

    def verify_scores(self, drafts: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The verify pass's processed scores [batch, G+1, V] for drafts [batch, G], as far as each row may go.

        Processors that read the input ids process position i + 1 of a row only if plain decoding could have
        made its drafts up to i: each is the argmax of the scores before it (greedy) or a token they allow
        (sampling, a finite score), and none is an end of sequence. So they never meet a prefix `generate` would
        not give them, such as a `prefix_allowed_tokens_fn` asked after a token it forbids. The rule reads no
        position past a row's first rejection; the raw logits stand there."""
        if self._all_at_once():
            return self.process(drafts, logits)
        if self.setup.do_sample:  # a token the processors allow

            def made(rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
                return rows.gather(1, tokens[:, None])[:, 0] > -torch.inf
        else:  # the token greedy decoding takes

            def made(rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
                return rows.argmax(dim=-1) == tokens

        return self._process_rows(drafts, logits, 0, made)

    def _all_at_once(self) -> bool:
        """Whether every position of every row is processed in one call: no processor, or only
        `ROW_WISE_PROCESSORS`, which read neither the input ids nor the batch's rows."""
        return not self.setup.processors or row_wise(self.setup.processors)

    def _process_rows(self, tokens, logits, offset: int, made=None) -> torch.Tensor:
        """Each row on its own, position by position, with its own processors (a batch's rows hold per-row state
        such as their prompt's padding, and rows leave the batch as they finish): position i after the row's
        prefix and tokens[:, :offset + i]. A row stops at an end of sequence among those tokens and, with
        `made(scores [n, V], tokens [n]) -> [n] bool`, at a token plain decoding could not have made; the raw
        logits stand at the positions it does not reach."""
        setup, state = self.setup, self.state
        inputs, batch = state.processor_inputs(), tokens.shape[0]
        prefixes = inputs if isinstance(inputs, list) else [inputs[b : b + 1] for b in range(batch)]
        lists = [setup.row_processors[row] for row in self.rows] if setup.row_processors else [setup.processors]
        scores = logits.float().clone()  # the rows processed are written in place
        going = [b for b in range(batch) if not torch.isin(tokens[b, :offset], self.stop_tokens).any()]
        for i in range(logits.shape[1]):
            for b in going:
                ids = torch.cat([prefixes[b], tokens[b : b + 1, : offset + i]], dim=1)
                scores[b, i] = lists[b](ids, logits[b : b + 1, i].float().clone())[0]  # a copy: processors write
            if offset + i == tokens.shape[1] or not going:
                break
            drafted = tokens[going, offset + i]
            keep = ~torch.isin(drafted, self.stop_tokens)
            if made is not None:
                keep &= made(scores[going, i], drafted)
            going = [b for b, kept in zip(going, keep.tolist(), strict=True) if kept]
        return scores

    def alpha_due(self) -> bool:
        """Whether a greedy drafting iteration adds to the alpha tally: the first, then one in `GREEDY_ALPHA_EVERY`
        (sampling adds every one: its rule builds p and q anyway)."""
        self.greedy_drafting += 1
        return (self.greedy_drafting - 1) % GREEDY_ALPHA_EVERY == 0

    def record_alpha(self, mass: torch.Tensor, num_accepted: torch.Tensor, tested: torch.Tensor | None = None) -> None:
        """Add alpha = sum_x min(p, q) at the draft positions the rule tested to the tally. mass: [batch, G], alpha
        at every draft position (`acceptance_mass`, `Draft.acceptance_mass`, `candidates_mass`); tested: [batch, G]
        bool, the positions among 1..num_accepted+1 that were tested (default: all of them)."""
        reached = torch.arange(mass.shape[1], device=mass.device)[None, :] <= num_accepted[:, None]  # [batch, G]
        tested = reached if tested is None else reached & tested
        mass = torch.where(tested, mass, 0)  # untested positions may hold NaN
        self.alpha += torch.stack([mass.sum(), tested.sum()]).double()

    def commit(self, committed, num_accepted, scores, logits):
        """Append to each row `committed[b, :num_accepted[b] + 1]` ([batch, W]), cut at its first EOS, its
        token budget and its first stopping criterion. Holds the iteration's one host synchronisation: the
        committed tokens come to the host with the counts, and EOS and budgets are found there (a few small
        integers per row), not by a dozen device ops. Returns per row: the accepted drafts, the tokens
        appended, and whether the row is done."""
        setup, state = self.setup, self.state
        rows = torch.cat([num_accepted[:, None], committed], dim=1).tolist()  # [batch, 1 + W] -> lists
        accepted, kept, stops, ends = [], [], [], []
        padded = pads_stopped_rows(setup)
        for row, (num, *tokens) in enumerate(rows):
            count = num + 1
            eos = next((i + 1 for i, token in enumerate(tokens[:count]) if token in setup.eos_token_ids), None)
            keep = min(eos or count, self.limit - self.generated[row])
            stop = None
            if setup.stopping_criteria:
                prefix = state.sequences[row : row + 1, state.added_pad[row] :]
                stop = stopping_point(setup, prefix, committed[row, :keep], scores[row])
            if stop is not None and not padded:  # the row goes on, as in `generate`
                self.stopped.setdefault(self.rows[row], self.generated[row] + stop)
                stop = None
            accepted.append(num)
            kept.append(stop or keep)
            stops.append(stop is not None)
            ends.append(eos is not None and keep == eos)
        if len(self.stopped) == self.num_rows and max(self.stopped.values()) < self.limit:  # the last row stopped
            self.limit = max(self.stopped.values())
            kept = [max(0, min(keep, self.limit - self.generated[row])) for row, keep in enumerate(kept)]
        finished = []
        for row, keep in enumerate(kept):
            self.generated[row] += keep
            finished.append(stops[row] or ends[row] or self.generated[row] >= self.limit)
        state.append(committed, kept)
        if setup.config.output_scores:
            self.scores.extend(scores[:, i].clone() for i in range(kept[0]))
        if setup.config.output_logits:
            self.logits.extend(logits[:, i].float().clone() for i in range(kept[0]))
        if setup.streamer is not None:
            setup.streamer.put(committed[0, : kept[0]].cpu())
        self.stats.new_tokens += sum(kept)
        for row, done in enumerate(finished):
            if done:  # the row as the caller gave it (its own padding) and what it generated
                self.done[self.rows[row]] = state.sequences[row, state.added_pad[row] :]
                self.lengths[self.rows[row]] = self.generated[row]
        return accepted, kept, finished

    def finished_rows(self) -> list[torch.Tensor]:
        """The rows in the caller's order, each the prompt as given and its new tokens; rows that ran on past
        `limit` (stopped rows that went on while another row had not stopped yet) cut to it."""
        rows = [self.done[row] for row in range(len(self.done))]
        over = [max(0, self.lengths[row] - self.limit) for row in range(len(rows))]
        self.stats.new_tokens -= sum(over)
        return [tokens[: tokens.shape[0] - extra] for tokens, extra in zip(rows, over, strict=True)]
