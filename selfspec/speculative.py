"""`SelfSpeculative`: wrap a causal LM, generate exactly what it generates, in fewer full passes."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from .adapter import ModelAdapter
from .adaptive import DraftController
from .drafters import build_drafter, pick
from .generation import (
    GenerationSetup,
    UnsupportedGenerationArgument,
    generate_output,
    prepare_generation,
    process_scores,
    process_tree_scores,
    stopping_point,
)
from .heads import DraftHeads, MedusaHeads, load_heads
from .state import DecodeState
from .stats import GenerationStats, Stopwatch
from .verify import Verdict, accept_greedy, accept_sampling, accept_tree, acceptance_mass

DEFAULT_DRAFT_TOKENS = 4


@dataclass
class _Call:
    """The working state of one `generate` call. Rows still generating are `state`'s rows; `rows[b]` is
    the caller's index of active row b."""

    setup: GenerationSetup
    state: DecodeState
    rows: list[int]
    generated: list[int]  # new tokens per active row
    watch: Stopwatch
    alpha: torch.Tensor  # [2] float64 on the device: sum of sum_x min(p, q), tested positions
    stats: GenerationStats = field(default_factory=GenerationStats)
    controller: DraftController | None = None  # chooses gamma when drafting adapts
    done: dict[int, torch.Tensor] = field(default_factory=dict)  # caller's row -> its finished sequence
    scores: list[torch.Tensor] = field(default_factory=list)  # processed scores of committed tokens (batch 1)
    logits: list[torch.Tensor] = field(default_factory=list)  # raw logits of committed tokens (batch 1)

    @property
    def remaining(self) -> int:
        """New tokens the row closest to its budget may still take."""
        return self.setup.max_new_tokens - max(self.generated)


class SelfSpeculative:
    """Self-speculative generation for a Hugging Face causal LM (a `PeftModel` too).

    The model drafts `num_draft_tokens` tokens with its first `exit_layer` layers and an exit head, checks
    them in one pass of the full model, and keeps exactly the tokens the full model would have produced:
    greedy output is token-identical to `model.generate(do_sample=False)`, sampled output is distributed
    as `model.generate(do_sample=True)`'s. One set of weights and one KV cache are used.

    Args:
        model: the loaded causal LM (Llama, Qwen2, Mistral, Phi3, Gemma, Gemma2, GPT-2, GPT-NeoX families).
        exit_layer: draft with layers 0..exit_layer-1 (1 <= exit_layer < num_hidden_layers). Default: the
            heads' first trained depth, else a quarter of the depth.
        num_draft_tokens: drafts per iteration (gamma); with `adaptive`, the most per iteration. Default:
            the heads' setting, else 4. 0 decodes plainly through selfspec's own loop, one full pass per
            token and no drafts (a baseline for benchmarks).
        heads: a heads folder (or loaded `ExitHeads` / `MedusaHeads`) trained for this model; None uses
            the model's own final norm and LM head as the exit head (no training needed).
        tree: with Medusa heads, a candidate tree as a list of paths of top-k ranks (e.g. [[0], [1], [0, 0]]),
            verified in one pass. Default: the heads' own tree if they carry one, else a chain; [] drafts a
            chain even when the heads carry a tree.
        adaptive: choose gamma each iteration from the acceptance seen so far and the speedup equation,
            down to plain decoding when drafting does not pay (see `selfspec.adaptive`). Default: on when
            `num_draft_tokens` is not given. Chains only; output is exact either way.
        draft_cost: c, the cost of one draft token relative to one plain decoding step, for `adaptive`.
            Default: estimated from the weights each draft token reads.
        draft_vocab: token ids the drafts may propose (e.g. `frequent_tokens(...)`): each draft token's LM-head
            product reads only their rows (copied once), which lowers c when the vocabulary is a large share
            of the model. Exactness is unchanged: q is zero outside, and verification uses the full vocabulary.
        draft_quant: "int8" drafts through an int8 copy of the LM head's rows (all, or `draft_vocab`'s),
            quantised per row and multiplied by torch's int8 weight-only kernel: a quarter of float32's bytes
            per draft token, slightly different q, the same exact output. Default: None (the model's dtype).
        draft_confidence: stop drafting a chain early in an iteration once the drafted token's draft
            probability is below this (every row's, in a batch). Default: off (always draft gamma).
        position_cost: for `adaptive`, r in v(gamma, rows) = (1 + r rows (gamma+1)) / (1 + r rows): what a
            verified position costs on this machine, so that gamma shrinks (to 0) as the batch grows where
            verification is compute-bound. Default: the heads' setting (`selfspec tune` measures it), else 0.
    """

    def __init__(
        self,
        model: nn.Module,
        exit_layer: int | None = None,
        num_draft_tokens: int | None = None,
        heads: str | os.PathLike | DraftHeads | None = None,
        tree: list[list[int]] | None = None,
        adaptive: bool | None = None,
        draft_cost: float | None = None,
        draft_vocab=None,
        draft_quant: str | None = None,
        draft_confidence: float | None = None,
        position_cost: float | None = None,
    ):
        self.model = model
        self.adapter = ModelAdapter(model)
        if heads is not None and not isinstance(heads, DraftHeads):
            heads = load_heads(heads, self.adapter)
        self.heads = heads
        if heads is not None:
            heads.to(device=self.adapter.device, dtype=self.adapter.dtype)
        vocab = None
        if draft_vocab is not None or draft_quant is not None:
            vocab = self.adapter.draft_vocabulary(draft_vocab, draft_quant)
        self.drafter, exit_layer, max_drafts = build_drafter(self.adapter, heads, exit_layer, tree, vocab)
        self.adaptive = num_draft_tokens is None if adaptive is None else adaptive
        self.draft_cost = self.drafter.estimated_cost() if draft_cost is None else draft_cost
        if not self.draft_cost >= 0:
            raise ValueError(f"draft_cost={draft_cost!r} must be a non-negative number (draft token / plain step).")
        if num_draft_tokens is None:
            default = heads.num_heads if isinstance(heads, MedusaHeads) else DEFAULT_DRAFT_TOKENS
            num_draft_tokens = min((heads.num_draft_tokens if heads is not None else None) or default, max_drafts)
        if (
            isinstance(num_draft_tokens, bool)
            or not isinstance(num_draft_tokens, int)
            or not 0 <= num_draft_tokens <= max_drafts
        ):
            what = f"the {max_drafts} Medusa heads" if isinstance(heads, MedusaHeads) else "the limit"
            raise ValueError(
                f"num_draft_tokens={num_draft_tokens!r} must be an integer from 1 to {max_drafts} ({what}), "
                "or 0 for plain decoding."
            )
        if num_draft_tokens == 0:
            if adaptive:
                raise ValueError("adaptive=True needs num_draft_tokens of at least 1 (0 is plain decoding).")
            if tree:
                raise ValueError("A tree drafts candidates: it cannot be used with num_draft_tokens=0.")
            self.adaptive = False
        if draft_confidence is not None and not 0.0 < draft_confidence < 1.0:
            raise ValueError(f"draft_confidence={draft_confidence!r} must be a probability between 0 and 1.")
        self.drafter.stop_below = draft_confidence
        recorded = heads.position_cost if heads is not None else None
        self.position_cost = position_cost if position_cost is not None else (recorded or 0.0)
        if not self.position_cost >= 0:
            raise ValueError(f"position_cost={position_cost!r} must be a non-negative number.")
        self.exit_layer = exit_layer
        self.num_draft_tokens = num_draft_tokens
        self.stats: GenerationStats | None = None

    def __getattr__(self, name: str):
        # look-ups the wrapper does not answer pass through to the wrapped model, as peft does
        if name in {"model", "adapter"}:
            raise AttributeError(name)
        return getattr(self.model, name)

    def __repr__(self) -> str:
        return (
            f"SelfSpeculative({type(self.adapter.model).__name__}, exit_layer={self.exit_layer}/"
            f"{self.adapter.num_layers}, num_draft_tokens={self.num_draft_tokens}, "
            f"heads={'trained' if self.heads is not None else 'none (untrained exit)'})"
        )

    # ------------------------------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, **kwargs):
        """Generate as `model.generate` does, with the same arguments and the same return type. A batch
        of prompts is left-padded with an `attention_mask`, as `model.generate` takes it."""
        input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
        if input_ids is None:
            raise ValueError("Pass the prompt token ids as `input_ids` (or the first positional argument).")
        if input_ids.ndim != 2 or input_ids.shape[1] == 0 or input_ids.shape[0] == 0:
            raise ValueError(
                "The prompt must be a non-empty [batch, length] tensor of token ids; "
                f"got shape {tuple(input_ids.shape)}."
            )
        input_ids = input_ids.to(self.adapter.device)
        setup = prepare_generation(self.adapter.model, input_ids, generation_config, kwargs)
        if input_ids.shape[0] > 1:
            self._check_batch(setup)
        max_positions = self.adapter.max_positions
        if max_positions is not None and input_ids.shape[1] + setup.max_new_tokens > max_positions:
            raise ValueError(
                f"The prompt ({input_ids.shape[1]} tokens) plus max_new_tokens ({setup.max_new_tokens}) exceeds the "
                f"model's maximum of {max_positions} positions."
            )
        started = time.perf_counter()
        call, first_token, scores, logits = self._prefill(input_ids, setup)
        finished = self._advance(call, first_token, torch.zeros_like(first_token[:, 0]), scores, logits, None)
        tree = getattr(self.drafter, "tree", None) if self.num_draft_tokens else None
        if self.adaptive and tree is None:
            call.controller = DraftController(self.num_draft_tokens, self.draft_cost, position_cost=self.position_cost)
        while not finished:
            span = min(call.remaining, self._span_before_rope_switch(call))  # positions one verify may cover
            # a tree's deepest node sits `depth` positions after the pending token
            if tree is not None and span >= tree.max_depth + 1:
                finished = self.tree_step(call)
            elif call.controller is not None:
                finished = self.speculative_step(call, call.controller.choose(span - 1, call.state.batch_size))
            else:  # no tree, or no room for it: a chain of at most span - 1 drafts
                finished = self.speculative_step(call, min(self.num_draft_tokens, span - 1))
        if setup.streamer is not None:
            setup.streamer.end()
        self.stats = call.stats.finish(call.watch.totals(), *call.alpha.tolist(), started)
        rows = [call.done[row] for row in range(len(call.done))]  # in the caller's order
        return generate_output(rows, call.state.pad_token_id, call.setup.config, call.scores, call.logits)

    def speculative_step(self, call: _Call, gamma: int) -> bool:
        """One iteration: draft gamma tokens, verify them in one full pass, accept, commit, drop the cache
        entries of what was rejected. gamma = 0 is a plain decoding step. Returns True when all rows are done."""
        state, setup = call.state, call.setup
        start = state.length - 1  # sequence index of the pending tokens
        if gamma == 0:
            with call.watch.section("verify"):
                logits = self._plain_pass(state, state.sequences[:, -1:], start)
                drafts = state.sequences[:, :0]
                scores = self._process(call, drafts, logits)
                verdict = Verdict(state.sequences.new_zeros(state.batch_size), pick(scores[:, 0], setup.do_sample))
        else:
            with call.watch.section("draft"):
                draft = self.drafter.draft(state, gamma, partial(self._process, call), setup.do_sample)
                drafts = draft.tokens
                gamma = drafts.shape[1]  # fewer when the draft stopped early (draft_confidence)
            with call.watch.section("verify"):
                logits = self.drafter.verify(state, draft)
                scores = self._process(call, drafts, logits)  # [batch, G+1, V]
                p, q = scores.softmax(dim=-1), draft.scores.softmax(dim=-1)
                verdict = accept_sampling(p, q, drafts) if setup.do_sample else accept_greedy(scores, drafts)
                self._record_alpha(call, p[:, :gamma], q, verdict.num_accepted)
            self.drafter.accept(verdict.num_accepted)
        kept = torch.arange(gamma + 1, device=drafts.device)[None, :].expand(state.batch_size, -1)
        return self._advance(call, drafts, verdict.num_accepted, scores, logits, kept, verdict.next_token)

    def tree_step(self, call: _Call) -> bool:
        """One Medusa tree iteration: candidates from the heads' top-k, one verify pass with a tree mask,
        the longest accepted path committed and the cache rearranged to it. Returns True when done."""
        state, setup, tree = call.state, call.setup, self.drafter.tree
        depth = tree.max_depth
        with call.watch.section("draft"):
            node_tokens, proposals = self.drafter.draft_tree()  # [batch, N], [batch, num_heads, V]
        with call.watch.section("verify"):
            logits = self.drafter.verify_tree(state, node_tokens)  # [batch, N+1, V]
            scores = process_tree_scores(setup.processors, state.sequences, node_tokens, logits, tree)
            p = scores.softmax(dim=-1)
            verdict = accept_tree(p, node_tokens, tree, setup.do_sample)
            # path: [batch, D+1] the root, then the accepted path's nodes (padded with the root)
            root = verdict.last_node.new_zeros(verdict.last_node.shape[0], 1)
            path = torch.cat([root, tree.ancestors[verdict.last_node]], dim=1)
            path_tokens = torch.cat([node_tokens[:, :1], node_tokens], dim=1).gather(1, path[:, 1:])  # [batch, D]
            along = path[..., None].expand(-1, -1, scores.shape[-1])
            path_scores, path_logits = scores.gather(1, along), logits.gather(1, along)  # [batch, D+1, V]
            q = process_scores(setup.processors, state.sequences, path_tokens, proposals[:, :depth]).softmax(dim=-1)
            self._record_alpha(call, path_scores[:, :depth].softmax(dim=-1), q, verdict.num_accepted)
        self.drafter.accept(verdict.last_node)
        return self._advance(
            call,
            path_tokens,
            verdict.num_accepted,
            path_scores,
            path_logits,
            path,
            verdict.next_token,
            num_new=tree.num_nodes + 1,
            chain=False,
        )

    # -------------------------------------------------------------------------------------- helpers
    @staticmethod
    def _process(call: _Call, tokens: torch.Tensor, logits: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Processed scores [batch, P, V] of the positions after each row's tokens and tokens[:, :offset+i],
        with the input ids `model.generate` would give the processors (see `process_scores`)."""
        inputs = call.state.processor_inputs()
        if isinstance(inputs, torch.Tensor) or not call.setup.row_processors:
            return process_scores(call.setup.processors, inputs, tokens, logits, offset)
        row_processors = [call.setup.row_processors[row] for row in call.rows]
        return process_scores(row_processors, inputs, tokens, logits, offset)

    def _span_before_rope_switch(self, call: _Call) -> int:
        """How many positions from the pending tokens on one pass may cover without crossing a longrope
        switch (plain decoding computes the positions before it with the short frequencies)."""
        switch = self.adapter.rope_switch
        if switch is None:
            return call.remaining + 1
        state = call.state
        spans = [
            switch - (state.length - 1 - pad) for pad in state.host_pad_offsets() if state.length - 1 - pad < switch
        ]
        return min(spans, default=call.remaining + 1)

    @staticmethod
    def _record_alpha(call: _Call, p: torch.Tensor, q: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Add sum_x min(p, q) over the draft positions the rule tested (1..num_accepted+1) to the tally.
        p, q: [batch, G, V]."""
        tested = torch.arange(q.shape[1], device=q.device)[None, :] <= num_accepted[:, None]  # [batch, G]
        mass = torch.where(tested, acceptance_mass(p, q), 0)  # untested positions may hold NaN
        call.alpha += torch.stack([mass.sum(), tested.sum()]).double()

    def _check_batch(self, setup: GenerationSetup) -> None:
        if setup.streamer is not None:
            raise UnsupportedGenerationArgument("`streamer` takes one sequence: stream one prompt at a time.")
        if setup.config.output_scores or setup.config.output_logits:
            raise UnsupportedGenerationArgument(
                "`output_scores` / `output_logits` are supported for one prompt at a time."
            )
        if getattr(self.drafter, "tree", None) is not None:
            raise UnsupportedGenerationArgument("Tree verification runs one prompt at a time; use a chain for batches.")

    def _prefill(self, input_ids: torch.Tensor, setup: GenerationSetup):
        """One full pass over the prompts. Returns the call state, the first generated token [batch, 1]
        (drawn from that pass, not committed yet), its processed scores and its logits."""
        mask = setup.attention_mask
        padded = mask is not None and bool((mask == 0).any())
        if padded:
            mask = mask.to(input_ids.device)
            if bool((mask[:, :-1] > mask[:, 1:]).any()):
                raise ValueError("Only left padding is supported: the attention mask has a 0 after a 1.")
            pad_offset = (mask == 0).long().sum(dim=1)
        else:
            pad_offset = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        batch = input_ids.shape[0]
        state = DecodeState(
            input_ids,
            self.adapter.new_cache(),
            pad_offset,
            mask if padded else None,
            added_pad=[0] * batch,
            prompt_pad=pad_offset.tolist(),
            pad_token_id=setup.pad_token_id or 0,
        )
        call = _Call(
            setup,
            state,
            rows=list(range(batch)),
            generated=[0] * batch,
            watch=Stopwatch(self.adapter.device),
            alpha=torch.zeros(2, device=input_ids.device, dtype=torch.float64),
        )
        if setup.streamer is not None:
            setup.streamer.put(input_ids.cpu())
        with call.watch.section("prefill"):
            logits = self._plain_pass(state, input_ids, 0)
            scores = process_scores(setup.processors, input_ids, input_ids[:, :0], logits)  # [batch, 1, V]
            token = pick(scores[:, 0], setup.do_sample)[:, None]
        call.stats.target_passes += 1
        call.stats.row_passes += batch
        return call, token, scores, logits

    def _plain_pass(self, state: DecodeState, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """All layers over `tokens` [batch, n] at sequence indices start..: logits of the last position
        [batch, 1, V]. A drafter that reads the target's hidden state gets the last one."""
        count = tokens.shape[1]
        args = (tokens, state.position_ids(start, count), state.cache, state.attention_mask(start + count))
        if not self.drafter.needs_hidden:
            return self.adapter.forward(*args, logits_to_keep=1)
        logits, hidden = self.adapter.forward_with_hidden(*args, logits_to_keep=1)
        self.drafter.observe(hidden[:, -1])
        return logits

    def _advance(
        self, call: _Call, drafts, num_accepted, scores, logits, kept, next_token=None, num_new=None, chain=True
    ) -> bool:
        """Commit each row's accepted drafts (drafts [batch, G]; num_accepted [batch]) and the token after
        them, then bring the cache along: of the positions the pass wrote, `kept[b]` [batch, G+1] lists row
        b's pending token and accepted drafts in order, among the `num_new` positions the pass wrote
        (default G+1; None after the prefill, which wrote the prompt only; `chain`: they are the first
        ones). Rows that finished leave the batch. Returns True when no row is left."""
        if next_token is None:  # the prefill: the first token is all there is
            committed = drafts
        else:
            committed = torch.cat([drafts, next_token[:, None]], dim=1)
            committed.scatter_(1, num_accepted[:, None], next_token[:, None])  # [batch, G+1]
        accepted, counts, finished = self._commit(call, committed, num_accepted, scores, logits)
        if next_token is not None:
            call.stats.record_iteration(drafts.shape[1], accepted)
            if call.controller is not None:
                call.controller.update(drafts.shape[1], accepted)
        if all(finished):
            return True
        state = call.state
        if kept is not None:
            num_new, width = num_new or kept.shape[1], max(counts)
            if chain and all(count == width for count in counts):
                self.adapter.crop(state.cache, num_new - width)  # rows agree and kept a prefix: a view, no copy
            else:
                shift = torch.tensor([width - count for count in counts], device=kept.device)
                self.adapter.rearrange(
                    state.cache, num_new, lambda old: DecodeState.shifted_index(old, width, shift, kept)
                )
        if any(finished):
            active = [b for b, done in enumerate(finished) if not done]
            rows = torch.tensor(active, device=state.sequences.device)
            state.select_rows(rows)
            self.drafter.select_rows(rows)
            call.rows = [call.rows[b] for b in active]
            call.generated = [call.generated[b] for b in active]
        return False

    def _commit(self, call: _Call, committed, num_accepted, scores, logits):
        """Append to each row `committed[b, :num_accepted[b] + 1]` ([batch, W]), cut at its first EOS, its
        token budget and its first stopping criterion. Holds the iteration's one host synchronisation.
        Returns per row: the accepted drafts, the tokens appended, and whether the row is done."""
        setup, state = call.setup, call.state
        count = num_accepted + 1
        eos_hit = torch.zeros_like(count)
        if setup.eos_token_ids is not None:
            in_reach = torch.arange(committed.shape[1], device=committed.device)[None, :] < count[:, None]
            is_eos = torch.isin(committed, setup.eos_token_ids) & in_reach
            eos_hit = is_eos.any(dim=1).long()
            count = torch.where(eos_hit.bool(), is_eos.long().argmax(dim=1) + 1, count)
        accepted, counts, eos_hits = torch.stack([num_accepted, count, eos_hit]).tolist()  # [3, batch] -> lists
        kept, finished = [], []
        for row, (count_b, eos_b) in enumerate(zip(counts, eos_hits, strict=True)):
            budget = setup.max_new_tokens - call.generated[row]
            keep = min(count_b, budget)
            prefix = state.sequences[row : row + 1, state.added_pad[row] :]
            stop = stopping_point(setup, prefix, committed[row, :keep], scores[row])
            keep = stop or keep
            kept.append(keep)
            finished.append(stop is not None or (bool(eos_b) and keep == count_b) or keep == budget)
            call.generated[row] += keep
        state.append(committed, kept)
        if setup.config.output_scores:
            call.scores.extend(scores[:, i].clone() for i in range(kept[0]))
        if setup.config.output_logits:
            call.logits.extend(logits[:, i].float().clone() for i in range(kept[0]))
        if setup.streamer is not None:
            setup.streamer.put(committed[0, : kept[0]].cpu())
        call.stats.new_tokens += sum(kept)
        for row, done in enumerate(finished):
            if done:  # the row as the caller gave it (its own padding) and what it generated
                call.done[call.rows[row]] = state.sequences[row, state.added_pad[row] :]
        return accepted, kept, finished
