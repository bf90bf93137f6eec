"""`SelfSpeculative`: wrap a causal LM, generate exactly what it generates, in fewer full passes."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .adapter import ModelAdapter
from .drafters import DecodeState, EarlyExitDrafter, MedusaDrafter, pick
from .generation import GenerationSetup, prepare_generation, process_scores, process_tree_scores
from .heads import DraftHeads, MedusaHeads, load_heads
from .stats import GenerationStats, Stopwatch
from .tree import CandidateTree
from .verify import Verdict, accept_greedy, accept_sampling, accept_tree, acceptance_mass

MAX_DRAFT_TOKENS = 32  # more drafts per iteration cannot pay: alpha^32 is negligible for any real draft
DEFAULT_DRAFT_TOKENS = 4


@dataclass
class _Call:
    """The working state of one `generate` call."""

    setup: GenerationSetup
    state: DecodeState
    stats: GenerationStats = field(default_factory=GenerationStats)
    watch: Stopwatch | None = None
    alpha: torch.Tensor | None = None  # [2] float64 on the device: sum of sum_x min(p, q), tested positions
    pad_host: int = 0  # left-padding tokens of the prompt (batch 1)
    scores: list[torch.Tensor] = field(default_factory=list)  # processed scores of committed tokens
    logits: list[torch.Tensor] = field(default_factory=list)  # raw logits of committed tokens

    @property
    def remaining(self) -> int:
        return self.setup.max_new_tokens - self.stats.new_tokens


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
        num_draft_tokens: drafts per iteration (gamma). Default: the heads' setting, else 4.
        heads: a heads folder (or loaded `ExitHeads` / `MedusaHeads`) trained for this model; None uses
            the model's own final norm and LM head as the exit head (no training needed).
        tree: with Medusa heads, a candidate tree as a list of paths of top-k ranks (e.g. [[0], [1], [0, 0]]),
            verified in one pass. Default: the heads' own tree if they carry one, else a chain.
    """

    def __init__(
        self,
        model: nn.Module,
        exit_layer: int | None = None,
        num_draft_tokens: int | None = None,
        heads: str | os.PathLike | DraftHeads | None = None,
        tree: list[list[int]] | None = None,
    ):
        self.model = model
        self.adapter = ModelAdapter(model)
        num_layers = self.adapter.num_layers
        if heads is not None and not isinstance(heads, DraftHeads):
            heads = load_heads(heads, self.adapter)
        self.heads = heads
        if heads is not None:
            heads.to(device=self.adapter.device, dtype=self.adapter.dtype)
        if isinstance(heads, MedusaHeads):
            if exit_layer is not None:
                raise ValueError("exit_layer does not apply to Medusa heads: they draft from the last hidden state.")
            max_drafts = heads.num_heads
            tree = tree if tree is not None else heads.tree  # the heads may carry a default tree
            candidates = CandidateTree.from_paths(tree, heads.num_heads) if tree is not None else None
            self.drafter = MedusaDrafter(self.adapter, heads, candidates)
        else:
            if tree is not None:
                raise ValueError("A candidate tree needs Medusa heads: early exit drafts a chain.")
            if num_layers < 2:
                raise ValueError(f"Early exit needs at least 2 decoder layers; this model has {num_layers}.")
            if exit_layer is None:
                exit_layer = heads.default_exit_layer if heads is not None else max(1, num_layers // 4)
            if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or not 1 <= exit_layer < num_layers:
                raise ValueError(
                    f"exit_layer={exit_layer!r} is out of range: this model has {num_layers} decoder layers, so "
                    f"exit_layer must be an integer from 1 to {num_layers - 1}."
                )
            max_drafts = MAX_DRAFT_TOKENS
            self.drafter = EarlyExitDrafter(self.adapter, exit_layer, heads.head_for(exit_layer) if heads else None)
        if num_draft_tokens is None:
            default = heads.num_heads if isinstance(heads, MedusaHeads) else DEFAULT_DRAFT_TOKENS
            num_draft_tokens = min((heads.num_draft_tokens if heads is not None else None) or default, max_drafts)
        if (
            isinstance(num_draft_tokens, bool)
            or not isinstance(num_draft_tokens, int)
            or not 1 <= num_draft_tokens <= max_drafts
        ):
            what = f"the {max_drafts} Medusa heads" if isinstance(heads, MedusaHeads) else "the limit"
            raise ValueError(
                f"num_draft_tokens={num_draft_tokens!r} must be an integer from 1 to {max_drafts} ({what})."
            )
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
        """Generate as `model.generate` does, with the same arguments and the same return type."""
        input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
        if input_ids is None:
            raise ValueError("Pass the prompt token ids as `input_ids` (or the first positional argument).")
        if input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ValueError(
                "The prompt must be a non-empty [batch, length] tensor of token ids; "
                f"got shape {tuple(input_ids.shape)}."
            )
        if input_ids.shape[0] != 1:
            raise ValueError(f"selfspec generates one sequence at a time for now; got a batch of {input_ids.shape[0]}.")
        input_ids = input_ids.to(self.adapter.device)
        setup = prepare_generation(self.adapter.model, input_ids, generation_config, kwargs)
        max_positions = self.adapter.max_positions
        if max_positions is not None and input_ids.shape[1] + setup.max_new_tokens > max_positions:
            raise ValueError(
                f"The prompt ({input_ids.shape[1]} tokens) plus max_new_tokens ({setup.max_new_tokens}) exceeds the "
                f"model's maximum of {max_positions} positions."
            )
        started = time.perf_counter()
        call, first_token, scores, logits = self._prefill(input_ids, setup)
        finished = self._commit(call, first_token, torch.zeros_like(first_token[:, 0]), scores, logits)[1]
        tree = getattr(self.drafter, "tree", None)
        while not finished:
            span = min(call.remaining, self._span_before_rope_switch(call))  # positions one verify may cover
            # a tree's deepest node sits `depth` positions after the pending token
            if tree is not None and span >= tree.max_depth + 1:
                finished = self.tree_step(call)
            else:  # no tree, or no room for it: a chain of at most span - 1 drafts
                finished = self.speculative_step(call, min(self.num_draft_tokens, span - 1))
        if setup.streamer is not None:
            setup.streamer.end()
        self.stats = self._finish_stats(call, started)
        return self._output(call)

    def speculative_step(self, call: _Call, gamma: int) -> bool:
        """One iteration: draft gamma tokens, verify them in one full pass, accept, commit, crop the cache
        of what was rejected. gamma = 0 is a plain decoding step. Returns True when generation is done."""
        state, setup = call.state, call.setup
        start = state.length - 1  # sequence index of the pending token
        if gamma == 0:
            with call.watch.section("verify"):
                logits = self._plain_pass(state, state.sequences[:, -1:], start)
                scores = process_scores(setup.processors, state.sequences, state.sequences[:, :0], logits)
                verdict = Verdict(
                    state.sequences.new_zeros(state.sequences.shape[0]), pick(scores[:, 0], setup.do_sample)
                )
                drafts = state.sequences[:, :0]
        else:
            with call.watch.section("draft"):
                draft = self.drafter.draft(state, gamma, setup.processors, setup.do_sample)
                drafts = draft.tokens
            with call.watch.section("verify"):
                logits = self.drafter.verify(state, draft)
                scores = process_scores(setup.processors, state.sequences, drafts, logits)  # [batch, G+1, V]
                p, q = scores.softmax(dim=-1), draft.scores.softmax(dim=-1)
                verdict = accept_sampling(p, q, drafts) if setup.do_sample else accept_greedy(scores, drafts)
                self._record_alpha(call, p[:, :gamma], q, verdict.num_accepted)
            self.drafter.accept(verdict.num_accepted)
        num_accepted, finished = self._commit_verdict(call, drafts, verdict, scores, logits)
        if not finished:
            # keep the pending token and the accepted drafts; drop the rejected drafts' positions
            self.adapter.crop(state.cache, gamma - num_accepted)
        return finished

    def tree_step(self, call: _Call) -> bool:
        """One Medusa tree iteration: candidates from the heads' top-k, one verify pass with a tree mask,
        the longest accepted path committed and the cache compacted to it. Returns True when done."""
        state, setup, tree = call.state, call.setup, self.drafter.tree
        depth = tree.max_depth
        with call.watch.section("draft"):
            node_tokens, proposals = self.drafter.draft_tree()  # [batch, N], [batch, num_heads, V]
        with call.watch.section("verify"):
            logits = self.drafter.verify_tree(state, node_tokens)  # [batch, N+1, V]
            scores = process_tree_scores(setup.processors, state.sequences, node_tokens, logits, tree)
            p = scores.softmax(dim=-1)
            verdict = accept_tree(p, node_tokens, tree, setup.do_sample)
            path = torch.cat(
                [verdict.last_node.new_zeros(verdict.last_node.shape[0], 1), tree.ancestors[verdict.last_node]], dim=1
            )
            # path: [batch, D+1] the root, then the accepted path's nodes (padded with the root)
            path_tokens = torch.cat([node_tokens[:, :1], node_tokens], dim=1).gather(1, path[:, 1:])  # [batch, D]
            along = path[..., None].expand(-1, -1, scores.shape[-1])
            path_scores, path_logits = scores.gather(1, along), logits.gather(1, along)  # [batch, D+1, V]
            q = process_scores(setup.processors, state.sequences, path_tokens, proposals[:, :depth]).softmax(dim=-1)
            self._record_alpha(call, path_scores[:, :depth].softmax(dim=-1), q, verdict.num_accepted)
        self.drafter.accept(verdict.last_node)
        num_accepted, finished = self._commit_verdict(call, path_tokens, verdict, path_scores, path_logits)
        if not finished:
            self.adapter.compact(state.cache, tree.num_nodes + 1, path[0, : num_accepted + 1])
        return finished

    def _commit_verdict(self, call: _Call, drafts, verdict: Verdict, scores, logits) -> tuple[int, bool]:
        """Commit the accepted drafts [batch, G] and the verdict's next token; count the iteration.
        scores, logits: [batch, G+1, V] at the positions those tokens were drawn from."""
        committed = torch.cat([drafts, verdict.next_token[:, None]], dim=1)
        committed.scatter_(1, verdict.num_accepted[:, None], verdict.next_token[:, None])  # [batch, G+1]
        num_accepted, finished = self._commit(call, committed, verdict.num_accepted, scores, logits)
        call.stats.record_iteration(drafts.shape[1], [num_accepted])
        return num_accepted, finished

    def _span_before_rope_switch(self, call: _Call) -> int:
        """How many positions from the pending token on one pass may cover without crossing a longrope
        switch (plain decoding computes the positions before it with the short frequencies)."""
        switch = self.adapter.rope_switch
        position = call.state.length - 1 - call.pad_host
        if switch is None or position >= switch:
            return call.remaining + 1
        return switch - position

    @staticmethod
    def _record_alpha(call: _Call, p: torch.Tensor, q: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Add sum_x min(p, q) over the draft positions the rule tested (1..num_accepted+1) to the tally.
        p, q: [batch, G, V]."""
        tested = torch.arange(q.shape[1], device=q.device)[None, :] <= num_accepted[:, None]  # [batch, G]
        mass = acceptance_mass(p, q)
        call.alpha += torch.stack([(mass * tested).sum(), tested.sum()]).double()

    # -------------------------------------------------------------------------------------- helpers
    def _prefill(self, input_ids: torch.Tensor, setup: GenerationSetup):
        """One full pass over the prompt. Returns the call state, the first generated token [batch, 1]
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
        state = DecodeState(input_ids, self.adapter.new_cache(), pad_offset, mask if padded else None)
        call = _Call(setup, state, watch=Stopwatch(self.adapter.device), pad_host=int(pad_offset[0]))
        call.alpha = torch.zeros(2, device=input_ids.device, dtype=torch.float64)
        if setup.streamer is not None:
            setup.streamer.put(input_ids.cpu())
        with call.watch.section("prefill"):
            logits = self._plain_pass(state, input_ids, 0)
            scores = process_scores(setup.processors, input_ids, input_ids[:, :0], logits)  # [batch, 1, V]
            token = pick(scores[:, 0], setup.do_sample)[:, None]
        call.stats.target_passes += 1
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

    def _commit(self, call: _Call, committed, num_accepted, scores, logits) -> tuple[int, bool]:
        """Append `committed[:, :num_accepted+1]` [batch, G+1] up to the first EOS, the token budget and the
        first stopping criterion. Holds the iteration's one host synchronisation. Returns the accepted
        count and whether generation is done."""
        setup, state, stats = call.setup, call.state, call.stats
        width = committed.shape[1]
        count = num_accepted + 1
        eos_hit = torch.zeros_like(count)
        if setup.eos_token_ids is not None:
            in_reach = torch.arange(width, device=committed.device)[None, :] < count[:, None]
            is_eos = torch.isin(committed, setup.eos_token_ids) & in_reach
            eos_hit = is_eos.any(dim=1).long()
            count = torch.where(eos_hit.bool(), is_eos.long().argmax(dim=1) + 1, count)
        accepted_host, count_host, eos_host = torch.stack([num_accepted, count, eos_hit]).squeeze(1).tolist()
        kept = min(count_host, call.remaining)
        state.sequences = torch.cat([state.sequences, committed[:, :kept]], dim=1)
        stop_at = self._stopping_point(state, setup, kept, scores)
        if stop_at is not None:
            state.sequences = state.sequences[:, : state.length - (kept - stop_at)]
            kept = stop_at
        if setup.config.output_scores:
            call.scores.extend(scores[:, i].clone() for i in range(kept))
        if setup.config.output_logits:
            call.logits.extend(logits[:, i].float().clone() for i in range(kept))
        stats.new_tokens += kept
        if setup.streamer is not None:
            setup.streamer.put(state.sequences[0, -kept:].cpu())
        eos_committed = bool(eos_host) and kept == count_host
        finished = stop_at is not None or eos_committed or call.remaining == 0
        return accepted_host, finished

    @staticmethod
    def _stopping_point(state: DecodeState, setup: GenerationSetup, count: int, scores) -> int | None:
        """How many of the last `count` tokens to keep when a stopping criterion fires among them, else None.
        scores: [batch, >= count, V] the processed scores each of those tokens was drawn from."""
        if len(setup.stopping_criteria) == 0:
            return None
        length = state.length
        flags = [
            setup.stopping_criteria(state.sequences[:, : length - count + j + 1], scores[:, j]).reshape(-1).any()
            for j in range(count)
        ]
        hits = torch.stack(flags).tolist()
        return hits.index(True) + 1 if True in hits else None

    @staticmethod
    def _finish_stats(call: _Call, started: float) -> GenerationStats:
        stats = call.stats
        times = call.watch.totals()
        stats.draft_seconds = times.get("draft", 0.0)
        stats.verify_seconds = times.get("verify", 0.0) + times.get("prefill", 0.0)
        alpha_sum, alpha_count = call.alpha.tolist()
        stats.alpha = alpha_sum / alpha_count if alpha_count else float("nan")
        stats.total_seconds = time.perf_counter() - started
        return stats

    @staticmethod
    def _output(call: _Call):
        config = call.setup.config
        if not config.return_dict_in_generate:
            return call.state.sequences
        return GenerateDecoderOnlyOutput(
            sequences=call.state.sequences,
            scores=tuple(call.scores) if config.output_scores else None,
            logits=tuple(call.logits) if config.output_logits else None,
        )
