"""`SelfSpeculative`: wrap a causal LM, generate exactly what it generates, in fewer full passes."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import torch
from torch import nn

from .adapter import FINAL, ModelAdapter
from .adapter.static import CompiledAdapter
from .drafters import build_drafters
from .engine.adaptive import DraftController, check_position_cost, choose_drafter
from .engine.call import Call
from .engine.drafter import Draft, Drafter, Verified, check_draft, pick, target_pass
from .engine.generation import (
    GenerationSetup,
    UnsupportedGenerationArgument,
    generate_output,
    prepare_generation,
    process_scores,
    process_tree_scores,
)
from .engine.state import DecodeState
from .engine.stats import GenerationStats, Stopwatch
from .engine.verify import Verdict, accept_greedy, accept_sampling, accept_tree
from .heads import DraftHeads, load_heads


class SelfSpeculative:
    """Self-speculative generation for a Hugging Face causal LM (a `PeftModel` too).

    The model drafts `num_draft_tokens` tokens with its first `exit_layer` layers and an exit head (or
    Medusa heads, n-gram lookup, or a drafter of your own), checks them in one pass of the full model, and
    keeps exactly the tokens the full model would have produced: greedy output is token-identical to
    `model.generate(do_sample=False)`, sampled output is distributed as `model.generate(do_sample=True)`'s.
    One set of weights and one KV cache are used.

    Args:
        model: the loaded causal LM (Llama, Qwen2, Mistral, Phi3, Gemma, Gemma2, GPT-2, GPT-NeoX families).
        exit_layer: draft with layers 0..exit_layer-1 (1 <= exit_layer < num_hidden_layers). Default: the
            heads' first trained depth, else a quarter of the depth.
        num_draft_tokens: drafts per iteration (gamma); with `adaptive`, the most per iteration. Default:
            the drafter's (the heads' tuned setting, the number of Medusa heads, n-gram's
            `prompt_lookup_num_tokens`, else 4); with several drafters it caps each. 0 decodes plainly through
            selfspec's own loop, one full pass per token and no drafts (a baseline for benchmarks).
        heads: a heads folder (or loaded `ExitHeads` / `MedusaHeads` / `EagleHeads`) trained for this model; None
            uses the model's own final norm and LM head as the exit head (no training needed).
        tree: with Medusa heads, a candidate tree as a list of paths of top-k ranks (e.g. [[0], [1], [0, 0]]),
            verified in one pass. Default: the heads' own tree if they carry one, else a chain; [] drafts a
            chain even when the heads carry a tree. With an EAGLE head, a dynamic tree (EAGLE-2) as a dict
            {"nodes": 8, "top_k": 3, "depth": 4}: candidates verified per pass, children per expanded node and
            nodes expanded per depth, depth. Trees draft for one prompt at a time.
        adaptive: choose gamma each iteration from the acceptance seen so far and the speedup equation,
            down to plain decoding when drafting does not pay (see `selfspec.adaptive`); with several drafters,
            also which one drafts. Default: on when `num_draft_tokens` is not given. Chains only; output is
            exact either way.
        draft_cost: c, the cost of one draft token relative to one plain decoding step, for `adaptive`.
            Default: the drafter's estimate (from the weights each draft token reads). With several drafters
            it applies to the last (the heads in a hybrid).
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
            verification is compute-bound; one number, or {batch size: r} measured per batch size (interpolated
            between them). Default: the heads' setting (`selfspec tune` measures it), else 0.
        drafter: None drafts with the heads (or the untrained exit); "ngram" with n-gram prompt lookup alone
            (`selfspec.NGramDrafter`); "hybrid" with n-gram lookup where the text has a match and the heads
            otherwise (adaptive: whichever the speedup equation favours from the acceptance each has shown);
            or your own `selfspec.Drafter` (or a list of them, in order of preference).
        prompt_lookup_num_tokens, max_matching_ngram_size: the n-gram drafter's settings (transformers' names)
            for drafter="ngram" or "hybrid". Defaults: 10 and 2.
        compile: True runs the target's passes compiled (`torch.compile`, inductor) over a pre-allocated static
            cache: one graph for plain steps, one for verify passes of any width (`selfspec.adapter.static`); a
            dict gives `torch.compile` options, e.g. {"mode": "reduce-overhead"} for CUDA graphs. The first calls
            compile (tens of seconds on a CPU). One prompt at a time, chains only, drafters that do not run the
            target's layers themselves (n-gram lookup, Medusa and EAGLE heads, hybrids of them; a drafter of your
            own must not run the target on the cache in `draft`), models without sliding-window layers; calls on
            one instance must not overlap (one cache). Greedy output stays token-identical to `model.generate` in
            float32 (tested), and in half precision up to ties (see the README). Default: False.
    """

    def __init__(
        self,
        model: nn.Module,
        exit_layer: int | None = None,
        num_draft_tokens: int | None = None,
        heads: str | os.PathLike | DraftHeads | None = None,
        tree: list[list[int]] | dict | None = None,
        adaptive: bool | None = None,
        draft_cost: float | None = None,
        draft_vocab=None,
        draft_quant: str | None = None,
        draft_confidence: float | None = None,
        position_cost: float | dict[int, float] | None = None,
        drafter: Drafter | list[Drafter] | str | None = None,
        prompt_lookup_num_tokens: int | None = None,
        max_matching_ngram_size: int | None = None,
        compile: bool | dict = False,
    ):
        self.model = model
        if not isinstance(compile, bool | dict):
            raise TypeError(f"compile={compile!r}: pass True, False or a dict of torch.compile options.")
        self.compiled = compile is not False
        options = compile if isinstance(compile, dict) else None
        self.adapter = CompiledAdapter(model, options) if self.compiled else ModelAdapter(model)
        if heads is not None and not isinstance(heads, DraftHeads):
            heads = load_heads(heads, self.adapter)
        self.heads = heads
        if heads is not None:
            heads.to(device=self.adapter.device, dtype=self.adapter.dtype)
        vocab = None
        if draft_vocab is not None or draft_quant is not None:
            vocab = self.adapter.draft_vocabulary(draft_vocab, draft_quant)
        ngram = {
            "prompt_lookup_num_tokens": prompt_lookup_num_tokens,
            "max_matching_ngram_size": max_matching_ngram_size,
        }
        ngram = {name: value for name, value in ngram.items() if value is not None}
        self.drafters = build_drafters(self.adapter, drafter, heads, exit_layer, tree, vocab, draft_confidence, ngram)
        self.hidden_layers = self._collect_hidden_layers()
        self.adaptive = num_draft_tokens is None if adaptive is None else adaptive
        self.draft_cost = self.drafter.estimated_cost() if draft_cost is None else draft_cost
        if not self.draft_cost >= 0:
            raise ValueError(f"draft_cost={draft_cost!r} must be a non-negative number (draft token / plain step).")
        max_drafts = max(part.max_drafts for part in self.drafters)
        if num_draft_tokens is not None and (
            isinstance(num_draft_tokens, bool)
            or not isinstance(num_draft_tokens, int)
            or not 0 <= num_draft_tokens <= max_drafts
        ):
            what = f"what {self.drafter.name} drafts at most" if len(self.drafters) == 1 else "the drafters' limit"
            raise ValueError(
                f"num_draft_tokens={num_draft_tokens!r} must be an integer from 1 to {max_drafts} ({what}), "
                "or 0 for plain decoding."
            )
        # each drafter's gamma: its own default, capped by num_draft_tokens when given
        self.draft_limits = [min(num_draft_tokens or part.default_drafts, part.max_drafts) for part in self.drafters]
        if num_draft_tokens == 0:
            if adaptive:
                raise ValueError("adaptive=True needs num_draft_tokens of at least 1 (0 is plain decoding).")
            if tree:
                raise ValueError("A tree drafts candidates: it cannot be used with num_draft_tokens=0.")
            self.adaptive = False
            self.draft_limits = [0] * len(self.drafters)
        recorded = heads.position_cost if heads is not None else None
        self.position_cost = check_position_cost(position_cost if position_cost is not None else (recorded or 0.0))
        self.exit_layer = getattr(self.drafter, "exit_layer", None)
        self.num_draft_tokens = max(self.draft_limits)
        self.stats: GenerationStats | None = None
        if self.compiled:
            self._check_compiled()

    @property
    def drafter(self) -> Drafter:
        """The drafter (with several, the last: the heads' drafter in a hybrid)."""
        return self.drafters[-1]

    def _collect_hidden_layers(self) -> tuple:
        """The target hidden states any drafter reads, checked against the model."""
        layers = []
        for part in self.drafters:
            for layer in part.hidden_layers:
                if layer != FINAL and not (isinstance(layer, int) and 0 <= layer < self.adapter.num_layers):
                    raise ValueError(
                        f"{part.name} asks for hidden layer {layer!r}; this model has decoder layers "
                        f"0..{self.adapter.num_layers - 1} (or {FINAL!r}, the normed last hidden state)."
                    )
                if layer not in layers:
                    layers.append(layer)
        return tuple(layers)

    def _check_compiled(self) -> None:
        """compile=True: the drafters must verify chains through the target's own full passes (num_draft_tokens=0
        decodes plainly: any drafter is then idle)."""
        self.adapter.check_hidden_layers(self.hidden_layers)
        for part in self.drafters if self.num_draft_tokens else []:
            if part.tree is not None:
                raise ValueError(
                    f"compile=True verifies chains; {part.name} drafts a tree (Medusa heads: tree=[] drafts a chain; "
                    "EAGLE heads: leave tree out)."
                )
            if type(part).verify is not Drafter.verify:
                raise ValueError(
                    f"compile=True runs the target's full passes compiled; {part.name} runs the target's layers its "
                    "own way (the exit-head drafter runs the first layers on the cache). Draft with n-gram lookup "
                    "(drafter='ngram'), Medusa or EAGLE heads, or use compile=False."
                )

    def __getattr__(self, name: str):
        # look-ups the wrapper does not answer pass through to the wrapped model, as peft does
        if name in {"model", "adapter"}:
            raise AttributeError(name)
        return getattr(self.model, name)

    def __repr__(self) -> str:
        return (
            f"SelfSpeculative({type(self.adapter.model).__name__}, drafters={[part.name for part in self.drafters]}, "
            f"exit_layer={self.exit_layer}/{self.adapter.num_layers}, num_draft_tokens={self.num_draft_tokens}, "
            f"heads={'trained' if self.heads is not None else 'none'})"
        )

    # ------------------------------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, **kwargs):
        """Generate as `model.generate` does, with the same arguments and the same return type. A batch
        of prompts is left-padded with an `attention_mask`, as `model.generate` takes it."""
        input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
        if input_ids is None:
            raise ValueError("Pass the prompt token ids as `input_ids` (or the first positional argument).")
        if not isinstance(input_ids, torch.Tensor):  # text, or a list of ids: model.generate takes neither
            raise TypeError(
                f"The prompt must be a tensor of token ids, got {type(input_ids).__name__}: tokenize it first, "
                "e.g. spec.generate(**tokenizer(prompt, return_tensors='pt'), max_new_tokens=64)."
            )
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
        tree = self.drafter.tree if self.num_draft_tokens else None
        if self.adaptive and tree is None:
            costs = [part.estimated_cost() for part in self.drafters[:-1]] + [self.draft_cost]
            call.controllers = [
                DraftController(limit, cost, position_cost=self.position_cost)
                for limit, cost in zip(self.draft_limits, costs, strict=True)
            ]
        while not finished:
            span = min(call.remaining, self._span_before_rope_switch(call))  # positions one verify may cover
            # a tree's deepest node sits `depth` positions after the pending token
            if tree is not None and span >= tree.max_depth + 1:
                finished = self.tree_step(call)
                continue
            index, gamma = self._choose_drafter(call, span - 1)
            finished = self.speculative_step(call, index, gamma)
        if setup.streamer is not None:
            setup.streamer.end()
        self.stats = call.stats.finish(call.watch.totals(), *call.alpha.tolist(), started)
        rows = [call.done[row] for row in range(len(call.done))]  # in the caller's order
        return generate_output(rows, call.state.pad_token_id, call.setup.config, call.scores, call.logits)

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
        drafts = draft.tokens
        gamma = drafts.shape[1]  # fewer when the draft stopped early (draft_confidence)
        with call.watch.section("verify"):
            if gamma == 0:
                logits, hidden = target_pass(self.adapter, state, state.sequences[:, -1:], self.hidden_layers)
            else:
                logits, hidden = drafter.verify(self.adapter, state, draft, self.hidden_layers)
            scores = call.process(drafts, logits)  # [batch, G+1, V]
            if gamma == 0:
                verdict = Verdict(state.sequences.new_zeros(state.batch_size), pick(scores[:, 0], setup.do_sample))
            elif setup.do_sample:
                p, q = scores.softmax(dim=-1), draft.probabilities(vocab_size)
                verdict = accept_sampling(p, q, drafts)
                call.record_alpha(p[:, :gamma], q, verdict.num_accepted)
            else:  # argmaxes only; softmaxes for the alpha tally when it is due
                verdict = accept_greedy(scores, drafts)
                if call.alpha_due():
                    p = scores[:, :gamma].softmax(dim=-1)
                    call.record_alpha(p, draft.probabilities(vocab_size), verdict.num_accepted)
        kept = torch.arange(gamma + 1, device=drafts.device)[None, :].expand(state.batch_size, -1)
        self._hand_over(Verified(verdict.num_accepted, verdict.num_accepted, kept, hidden, False), index)
        call.drafted_by = index if gamma else None
        return self._advance(call, drafts, verdict.num_accepted, scores, logits, kept, verdict.next_token)

    def tree_step(self, call: Call) -> bool:
        """One tree iteration: the drafter's candidate tree (Medusa's fixed shape, or a dynamic one), one verify
        pass with a tree mask, the longest accepted path committed and the cache rearranged to it. Returns True
        when done."""
        state, setup, drafter = call.state, call.setup, self.drafter
        with call.watch.section("draft"):
            tree, node_tokens, node_logits = drafter.draft_tree(state)  # [batch, N], [batch, N+1, V]
        depth = tree.max_depth
        with call.watch.section("verify"):
            logits, hidden = drafter.verify_tree(self.adapter, state, tree, node_tokens, self.hidden_layers)
            scores = process_tree_scores(setup.processors, state.sequences, node_tokens, logits, tree)
            p = scores.softmax(dim=-1) if setup.do_sample else scores  # greedy reads argmaxes, as model.generate does
            verdict = accept_tree(p, node_tokens, tree, setup.do_sample)
            # path: [batch, D+1] the root, then the accepted path's nodes (padded with the root)
            root = verdict.last_node.new_zeros(verdict.last_node.shape[0], 1)
            path = torch.cat([root, tree.ancestors[verdict.last_node]], dim=1)
            path_tokens = torch.cat([node_tokens[:, :1], node_tokens], dim=1).gather(1, path[:, 1:])  # [batch, D]
            along = path[..., None].expand(-1, -1, scores.shape[-1])
            path_scores, path_logits = scores.gather(1, along), logits.gather(1, along)  # [batch, D+1, V]
            if setup.do_sample or call.alpha_due():  # q at each depth: the draft logits at the path's node before it
                drafts = node_logits.gather(1, along[:, :depth])
                q = process_scores(setup.processors, state.sequences, path_tokens, drafts).softmax(dim=-1)
                call.record_alpha(path_scores[:, :depth].softmax(dim=-1), q, verdict.num_accepted)
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
        switch (plain decoding computes the positions before it with the short frequencies)."""
        switch = self.adapter.rope_switch
        if switch is None:
            return call.remaining + 1
        state = call.state
        spans = [
            switch - (state.length - 1 - pad) for pad in state.host_pad_offsets() if state.length - 1 - pad < switch
        ]
        return min(spans, default=call.remaining + 1)

    def _check_batch(self, setup: GenerationSetup) -> None:
        if setup.streamer is not None:
            raise UnsupportedGenerationArgument("`streamer` takes one sequence: stream one prompt at a time.")
        if setup.config.output_scores or setup.config.output_logits:
            raise UnsupportedGenerationArgument(
                "`output_scores` / `output_logits` are supported for one prompt at a time."
            )
        if self.drafter.tree is not None:
            raise UnsupportedGenerationArgument("Tree verification runs one prompt at a time; use a chain for batches.")

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
            if call.controllers and call.drafted_by is not None:
                call.controllers[call.drafted_by].update(drafts.shape[1], accepted)
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
            for part in self.drafters:  # each drafter drops the finished rows' state
                part.select_rows(rows)
            call.rows = [call.rows[b] for b in active]
            call.generated = [call.generated[b] for b in active]
        return False
