"""The decoding loop of a `generate` call: the prefill, then iterations of choose a drafter, draft, verify, accept
and commit (docs/design.md, "One generate call"). It knows its drafters through the `Drafter` interface only."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from ..adapter import ModelAdapter
from .adaptive import (
    DraftController,
    PositionCost,
    TreeController,
    choose_drafter,
    modeled_verify_cost,
    position_cost_at,
)
from .call import Call
from .checks import check_call, check_prompt
from .drafter import Draft, Drafter, Drafters, Verified, check_draft, pick, target_pass
from .generation import (
    GenerationSetup,
    TreeScores,
    UnsupportedGenerationArgument,
    generate_output,
    prepare_generation,
    process_scores,
)
from .state import DecodeState
from .stats import GenerationStats, Stopwatch
from .verify import Verdict, accept_greedy, accept_sampling, accept_tree, acceptance_mass, candidates_mass
from .verify_cost import measured_verify_costs


class DecodingLoop:
    """`generate` and its iterations, over the settings below, which `selfspec.SelfSpeculative` builds from its
    arguments and checks: the target's adapter, the drafters in order of preference with each one's gamma, the
    hidden states they read, and how gamma is chosen."""

    adapter: ModelAdapter  # the target (a `CompiledAdapter` with compile=True)
    drafters: Drafters  # every drafter in use, in order of preference (a tuple)
    draft_limits: list[int]  # each drafter's gamma (0: plain decoding)
    num_draft_tokens: int  # the largest of them
    hidden_layers: tuple  # the target hidden states any drafter reads
    adaptive: bool  # choose gamma (and the drafter) each iteration from the speedup equation
    draft_cost: float  # c of the last drafter (a tree drafter: of one tree), for adaptive drafting
    position_cost: PositionCost | None  # r, for adaptive drafting; None: v measured on this machine
    compiled: bool  # compile=True: one unpadded prompt at a time
    stats: GenerationStats | None  # what the last call did

    @property
    def drafter(self) -> Drafter | Drafters:
        """The drafter in use; with several (a hybrid), all of them: `drafters`, whose repr names each one."""
        return self.drafters[0] if len(self.drafters) == 1 else self.drafters

    @torch.no_grad()
    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, **kwargs):
        """Generate as `model.generate` does, with the same arguments and the same return type. A batch
        of prompts is left-padded with an `attention_mask`, as `model.generate` takes it."""
        input_ids = check_prompt(inputs if inputs is not None else kwargs.pop("input_ids", None), kwargs)
        input_ids = input_ids.to(self.adapter.device)
        setup = prepare_generation(self.adapter.model, input_ids, generation_config, kwargs)
        check_call(self.adapter, self.drafters[0].tree is not None, setup, input_ids)
        started = time.perf_counter()
        call, first_token, scores, logits = self._prefill(input_ids, setup)
        finished = self._advance(call, first_token, torch.zeros_like(first_token[:, 0]), scores, logits, None)
        tree = self.drafters[0].tree if self.num_draft_tokens else None  # a tree drafter drafts alone
        measured = None
        if self.adaptive and tree is None:
            costs = [part.estimated_cost() for part in self.drafters[:-1]] + [self.draft_cost]
            span = min(call.remaining, self._span_before_rope_switch(call))
            widest = min(max(self.draft_limits), span - 1)  # the most drafts an iteration of this call may verify
            if self.position_cost is None and not finished and widest > 0:
                with call.watch.section("measure"):
                    measured = measured_verify_costs(self.adapter, call.state, widest, self.hidden_layers)
            call.controllers = [
                DraftController(limit, cost, position_cost=self.position_cost or 0.0, verify_costs=measured)
                for limit, cost in zip(self.draft_limits, costs, strict=True)
            ]
        elif self.adaptive and not finished:
            costs = self._tree_verify_costs(call, tree)
            measured = costs if self.position_cost is None else None
            call.tree_controller = TreeController(costs, self.draft_cost)
        while not finished:
            if self._at_rope_recompute(call):
                self._recompute_cache(call)
            span = min(call.remaining, self._span_before_rope_switch(call))  # positions one verify may cover
            # a tree's deepest node sits `depth` positions after the pending token
            if tree is not None and span >= tree.max_depth + 1:
                if call.tree_controller is None or call.tree_controller.choose():
                    finished = self.tree_step(call)
                else:
                    finished = self.speculative_step(call, None, 0)
                continue
            index, gamma = self._choose_drafter(call, span - 1)
            finished = self.speculative_step(call, index, gamma)
        if setup.streamer is not None:
            setup.streamer.end()
        self.stats = call.stats.finish(call.watch.totals(), *call.alpha.tolist(), started)
        self.stats.verify_costs = measured
        rows = call.finished_rows()  # in the caller's order
        for part in self.drafters:
            part.end(rows)
        return generate_output(rows, call.state.pad_token_id, call.setup.config, call.scores, call.logits)

    def _tree_verify_costs(self, call: Call, tree) -> tuple[float, ...]:
        """v(N) for trees of N = 0..tree.max_nodes candidates: from the position cost when given, else measured on
        this machine (chains of N + 1 positions, as wide as the call's positions allow; wider trees read the widest)."""
        if self.position_cost is not None:
            r = position_cost_at(self.position_cost, 1)
            return tuple(modeled_verify_cost(r, nodes, 1) for nodes in range(tree.max_nodes + 1))
        span = min(call.remaining, self._span_before_rope_switch(call))
        widest = max(0, min(tree.max_nodes, span - 1))
        with call.watch.section("measure"):
            return measured_verify_costs(self.adapter, call.state, widest, self.hidden_layers)

    def _choose_drafter(self, call: Call, limit: int) -> tuple[int | None, int]:
        """Which drafter drafts this iteration (None: a plain step) and at most how many tokens: adaptive, by
        the speedup equation among the drafters that have a proposal; fixed, the first that has one."""
        if limit <= 0 or not self.num_draft_tokens:
            return None, 0
        with call.watch.section("draft"):
            available = [part.available(call.state) for part in self.drafters]
        if call.controllers:
            return choose_drafter(call.controllers, available, limit, call.state.batch_size)
        index = next((i for i, ready in enumerate(available) if ready), None)
        return index, (min(self.draft_limits[index], limit) if index is not None else 0)

    def speculative_step(self, call: Call, index: int | None, gamma: int) -> bool:
        """One iteration: drafter `index` drafts gamma tokens, one full pass verifies them, the rule accepts,
        the tokens are committed and the cache entries of what was rejected dropped. gamma = 0 (or index None)
        is a plain decoding step. Returns True when all rows are done."""
        state, setup, vocab_size = call.state, call.setup, self.adapter.vocab_size
        drafter = self.drafters[index] if index is not None and gamma > 0 else None
        if drafter is None:
            draft = Draft.empty(state.batch_size, state.sequences.device)
        else:
            with call.watch.section("draft"):
                draft = drafter.draft(state, gamma, call.process, setup.do_sample)
                check_draft(drafter, draft, state.batch_size, gamma, vocab_size)
                if self.adapter.token_without_position is not None:
                    draft = self._end_at_token_without_position(state, draft)
        drafts = draft.tokens
        gamma = drafts.shape[1]  # fewer when the draft stopped early (draft_confidence)
        with call.watch.section("verify"):
            if gamma == 0:
                logits, hidden = target_pass(self.adapter, state, state.sequences[:, -1:], self.hidden_layers)
            else:
                logits, hidden = drafter.verify(self.adapter, state, draft, self.hidden_layers)
            scores = call.verify_scores(drafts, logits)  # [batch, G+1, V]
            if gamma == 0:
                verdict = Verdict(state.sequences.new_zeros(state.batch_size), pick(scores[:, 0], setup.do_sample))
            elif setup.do_sample:
                p, q = scores.softmax(dim=-1), draft.probabilities(vocab_size)
                verdict = accept_sampling(p, q, drafts)
                call.record_alpha(acceptance_mass(p[:, :gamma], q), verdict.num_accepted)
            else:  # argmaxes only; softmaxes for the alpha tally when it is due
                verdict = accept_greedy(scores, drafts)
                if call.alpha_due():
                    p = scores[:, :gamma].softmax(dim=-1)
                    call.record_alpha(draft.acceptance_mass(p), verdict.num_accepted)
        kept = torch.arange(gamma + 1, device=drafts.device)[None, :].expand(state.batch_size, -1)
        self._hand_over(Verified(verdict.num_accepted, verdict.num_accepted, kept, hidden, False), index)
        call.drafted_by = index if gamma else None
        return self._advance(call, drafts, verdict.num_accepted, scores, logits, kept, verdict.next_token)

    def _end_at_token_without_position(self, state: DecodeState, draft: Draft) -> Draft:
        """The drafts up to the first token the forward gives no position (TrOCR's sinusoidal positions skip the pad
        token): a pass numbers the tokens after it by counting the others, one-token steps by the cache length, which
        counts it, so no token may follow it in a pass. A pending such token leaves none."""
        chunk = torch.cat([state.sequences[:, -1:], draft.tokens], dim=1)  # [batch, G+1]: what the pass would take
        before_others = (chunk[:, :-1] == self.adapter.token_without_position).any(dim=0)  # [G]
        # the first such index, G where there is none
        return draft.first(int(torch.cat([before_others, before_others.new_ones(1)]).int().argmax()))

    def tree_step(self, call: Call) -> bool:
        """One tree iteration: the drafter's candidate tree (Medusa's fixed shape, or a dynamic one), one verify
        pass with a tree mask, the longest accepted path committed and the cache rearranged to it. Returns True
        when done."""
        state, setup, drafter = call.state, call.setup, self.drafters[0]  # a tree drafter drafts alone
        with call.watch.section("draft"):
            if not drafter.available(state):  # nothing to propose (a suffix tree without a match): a plain step
                return self.speculative_step(call, None, 0)
            tree, node_tokens, node_logits = drafter.draft_tree(state)  # [batch, N], [batch, N+1, V] or None
        depth = tree.max_depth
        with call.watch.section("verify"):
            logits, hidden = drafter.verify_tree(self.adapter, state, tree, node_tokens, self.hidden_layers)
            scores = TreeScores(setup.processors, state.sequences, node_tokens, logits, tree)  # processed when asked
            # greedy: argmaxes, as generate; the walk ends where generate would (end of sequence, the budget)
            verdict = accept_tree(scores, node_tokens, tree, setup.do_sample, call.stop_tokens, call.remaining - 1)
            # path: [batch, D+1] the root, then the accepted path's nodes (padded with the root)
            root = verdict.last_node.new_zeros(verdict.last_node.shape[0], 1)
            path = torch.cat([root, tree.ancestors[verdict.last_node]], dim=1)
            path_tokens = torch.cat([node_tokens[:, :1], node_tokens], dim=1).gather(1, path[:, 1:])  # [batch, D]
            # the walk's processed scores: its steps cover every row's root and accepted nodes, all a commit reads
            path_scores = verdict.scores  # [batch, S, V]
            walked = min(path_scores.shape[1], depth)  # the draft positions the rule may have tested
            rows = torch.arange(path.shape[0], device=path.device)[:, None]  # whole rows: faster than a gather on a CPU
            path_logits = logits[rows, path]  # [batch, D+1, V]
            if setup.do_sample or call.alpha_due():  # at each step, the node the walk stood on and its children
                p, stood = path_scores[:, :walked].softmax(dim=-1), path[:, :walked]
                mass, tested = candidates_mass(p, stood, node_tokens, tree)  # deterministic candidates
                if node_logits is not None:  # q: the draft logits at the node, processed after the path's tokens
                    tokens = path_tokens[:, :walked]
                    drafts = process_scores(setup.processors, state.sequences, tokens, node_logits[rows, stood])
                    mass = Draft(tokens, drafts).acceptance_mass(p)
                call.record_alpha(mass, verdict.num_accepted, tested)
        self._hand_over(Verified(verdict.num_accepted, verdict.last_node, path, hidden, False), 0)
        call.drafted_by = 0
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

    def _hand_over(self, verified: Verified, index: int | None) -> None:
        """Every drafter learns the verdict (the one that drafted, with `own` set)."""
        for position, part in enumerate(self.drafters):
            part.accept(replace(verified, own=position == index))

    # -------------------------------------------------------------------------------------- helpers
    def _span_before_rope_switch(self, call: Call) -> int:
        """How many positions from the pending tokens on one pass may cover without crossing a longrope
        switch (plain decoding computes the positions before it with the short frequencies), nor the sequence
        index at which `generate` recomputes the cache (`_recompute_cache`), so that an iteration starts there."""
        switch, recompute = self.adapter.rope_switch, self.adapter.rope_recompute_at
        if switch is None:
            return call.remaining + 1
        state = call.state
        positions = [state.length - 1 - pad for pad in state.host_pad_offsets()]
        spans = [switch - position for position in positions if position < switch]
        if recompute is not None:  # sequence indices as `generate` counts them: without the padding selfspec added
            indices = [state.length - 1 - added for added in state.added_pad]
            spans += [recompute - index for index in indices if index < recompute]
        return min(spans, default=call.remaining + 1)

    def _at_rope_recompute(self, call: Call) -> bool:
        """Whether the pending token sits at the sequence index where `generate` recomputes the cache."""
        at = self.adapter.rope_recompute_at
        return at is not None and call.state.length - 1 - call.state.added_pad[0] == at

    def _recompute_cache(self, call: Call) -> None:
        """What Phi3's and Phi-MoE's `generate` do when the sequence first holds original_max_position_embeddings + 1
        tokens: drop the cache and compute every position again in one pass, pending token included, so that longrope's
        long frequencies (chosen for a whole pass once a position reaches the switch) rotate the past keys too.
        The pending token's entry is then dropped: the iteration's verify pass writes it (one prompt at a time:
        `checks.check_batch`). The pass counts as part of the prefill."""
        state = call.state
        state.cache = self.adapter.new_cache(state.length + call.remaining + self.num_draft_tokens + 1)
        with call.watch.section("prefill"):
            args = (state.sequences, state.position_ids(0, state.length), state.cache)
            self.adapter.forward(*args, state.attention_mask(state.length), logits_to_keep=1)
        self.adapter.crop(state.cache, 1)

    def _prefill(self, input_ids: torch.Tensor, setup: GenerationSetup):
        """One full pass over the prompts. Returns the call state, the first generated token [batch, 1]
        (drawn from that pass, not committed yet), its processed scores and its logits."""
        mask = setup.attention_mask
        padded = mask is not None and bool((mask == 0).any())
        if self.compiled and (input_ids.shape[0] > 1 or padded):
            raise UnsupportedGenerationArgument(
                f"compile=True decodes one unpadded prompt at a time (got {input_ids.shape[0]} row(s)"
                f"{', with padding' if input_ids.shape[0] == 1 else ''}): its static cache and graphs are built for "
                "batch 1. Loop over the prompts without padding, or use compile=False for batches."
            )
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
            self.adapter.new_cache(input_ids.shape[1] + setup.max_new_tokens + self.num_draft_tokens + 1),
            pad_offset,
            mask if padded else None,
            added_pad=[0] * batch,
            prompt_pad=pad_offset.tolist(),
            pad_token_id=setup.pad_token_id or 0,
        )
        call = Call(
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
            args = (
                input_ids,
                state.position_ids(0, input_ids.shape[1]),
                state.cache,
                state.attention_mask(input_ids.shape[1]),
            )
            logits, hidden = self.adapter.forward_capturing(*args, layers=self.hidden_layers, logits_to_keep=1)
            if self.adapter.whole_model_only:  # a family not checked by selfspec's tests: its past must be in the cache
                self.adapter.check_cache_filled(state.cache, input_ids.shape[1])
            scores = process_scores(setup.processors, input_ids, input_ids[:, :0], logits)  # [batch, 1, V]
            token = pick(scores[:, 0], setup.do_sample)[:, None]
        for part in self.drafters:
            part.begin(state, hidden)
        call.stats.target_passes += 1
        call.stats.row_passes += batch
        return call, token, scores, logits

    def _advance(
        self, call: Call, drafts, num_accepted, scores, logits, kept, next_token=None, num_new=None, chain=True
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
        accepted, counts, finished = call.commit(committed, num_accepted, scores, logits)
        if next_token is not None:
            name = self.drafters[call.drafted_by].name if call.drafted_by is not None else None
            call.stats.record_iteration(drafts.shape[1], accepted, name)
            if not chain and call.tree_controller is not None:  # a tree of num_new - 1 candidates, one prompt
                call.tree_controller.update(num_new - 1, accepted[0])
            elif call.controllers and call.drafted_by is not None:
                call.controllers[call.drafted_by].update(drafts.shape[1], accepted)
        if all(finished):
            return True
        state = call.state
        if kept is not None:
            num_new, width = num_new or kept.shape[1], max(counts)
            if chain and all(count == width for count in counts):
                self.adapter.crop(state.cache, num_new - width)  # rows agree and kept a prefix: a view, no copy
            elif all(count == width for count in counts):  # a tree's path: its entries move, nothing else
                self.adapter.keep_new(state.cache, num_new, kept[:, :width])
            else:
                shift = torch.tensor([width - count for count in counts], device=kept.device)
                self.adapter.rearrange(
                    state.cache, num_new, lambda old: DecodeState.shifted_index(old, width, shift, kept)
                )
        if any(finished):
            active = [b for b, done in enumerate(finished) if not done]
            rows = torch.tensor(active, device=state.sequences.device)
            state.select_rows(rows)
            for part in self.drafters:  # each drafter drops the finished rows' state
                part.select_rows(rows)
            call.rows = [call.rows[b] for b in active]
            call.generated = [call.generated[b] for b in active]
        return False
