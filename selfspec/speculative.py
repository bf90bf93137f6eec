"""`SelfSpeculative`: wrap a causal LM, generate exactly what it generates, in fewer full passes.

The wrapper builds what the decoding loop (`selfspec.engine.loop`) runs on from its arguments, and checks them: the
target's adapter, the heads, the drafters (`selfspec.drafters.build`), gamma and the costs of adaptive drafting."""

from __future__ import annotations

import copy
import os

from torch import nn

from .adapter import FINAL, ModelAdapter
from .adapter.static import CompiledAdapter
from .bundle import is_bundle, load_bundle
from .custom_generate import run_custom_generate
from .drafters.build import HEADS, MODEL_FREE, build_drafters
from .engine.adaptive import check_position_cost
from .engine.drafter import Drafter
from .engine.generation import UnsupportedGenerationArgument
from .engine.loop import DecodingLoop
from .heads import DraftHeads, load_heads
from .heads.kinds import check_fingerprint


class SelfSpeculative(DecodingLoop):
    """Self-speculative generation for a Hugging Face causal LM (a `PeftModel` too).

    The model drafts `num_draft_tokens` tokens with its first `exit_layer` layers and an exit head (or
    Medusa heads, n-gram lookup, or a drafter of your own), checks them in one pass of the full model, and
    keeps exactly the tokens the full model would have produced: greedy output is token-identical to
    `model.generate(do_sample=False)`, sampled output is distributed as `model.generate(do_sample=True)`'s.
    One set of weights and one KV cache are used (and, for float32 targets on x86 CPUs with memory to spare, a packed
    copy of the linear weights that makes verify passes cheaper: `packed_weights`).

    Args:
        model: the loaded causal LM (Llama, Qwen2, Mistral, Phi3, Gemma, Gemma2, GPT-2, GPT-NeoX families).
        exit_layer: draft with layers 0..exit_layer-1 (1 <= exit_layer < num_hidden_layers). Default: the
            exit heads' first trained depth; without heads, given, the untrained exit drafts.
        num_draft_tokens: drafts per iteration (gamma); with `adaptive`, the most per iteration. Default:
            the drafter's (the heads' tuned setting, the number of Medusa heads, n-gram's
            `prompt_lookup_num_tokens`, else 4); with several drafters it caps each. With a tree it caps the chains a
            tree drafter falls back to (near a call's end), not the tree, and turns the adaptive choice off as for
            chains. 0 decodes plainly through selfspec's own loop, one full pass per token and no drafts (a
            baseline for benchmarks).
        heads: a target's bundle folder (`selfspec.bundle`: heads, draft vocabulary, memory and the drafting that
            measured best, which the other arguments override), a heads folder or loaded `ExitHeads` / `MedusaHeads` /
            `EagleHeads` trained for this model; None drafts without heads (see `drafter`). Loaded heads on
            another device or in another dtype than the model are copied there (`spec.heads`); yours stay as
            they are, for other wrappers that share them.
        tree: with Medusa heads, a candidate tree as a list of paths of top-k ranks (e.g. [[0], [1], [0, 0]]),
            verified in one pass. Default: the heads' own tree if they carry one, else a chain; [] drafts a
            chain even when the heads carry a tree. With an EAGLE head, a dynamic tree (EAGLE-2) as a dict
            {"nodes": 8, "top_k": 3, "depth": 4}: candidates verified per pass, children per expanded node and
            nodes expanded per depth, depth (`selfspec tune` measures five budgets); {} drafts a chain. Trees
            draft for one prompt at a time. A tree's size is its own: `num_draft_tokens` does not bound it.
        adaptive: choose gamma each iteration from the acceptance seen so far and the speedup equation,
            down to plain decoding when drafting does not pay (see `selfspec.engine.adaptive`); with several drafters,
            also which one drafts; with a tree drafter, whether an iteration verifies a tree or takes a plain step
            (`selfspec.engine.adaptive.TreeController`). Default: on when `num_draft_tokens` is not given. Output
            is exact either way.
        draft_cost: c, the cost of one draft token relative to one plain decoding step, for `adaptive`.
            Default: the drafter's estimate (from the weights each draft token reads). With several drafters
            it applies to the last (the heads in a hybrid); with a tree drafter it is the cost of drafting one
            tree (default: the drafter's `tree_cost()`, one draft token's per level).
        draft_vocab: token ids the drafts may propose (e.g. `frequent_tokens(...)`): each draft token's LM-head
            product reads only their rows (copied once), which lowers c when the vocabulary is a large share
            of the model. Exactness is unchanged: q is zero outside, and verification uses the full vocabulary.
        draft_vocab_context: with `draft_vocab`, each call's own tokens join it for that call (the prompt's at the
            start, the answer's as they come): an answer copies names and rare words from its prompt that no
            vocabulary of frequent tokens holds, for a few dozen extra rows. Default: True; False drafts from
            `draft_vocab` alone, as engines with a fixed draft vocabulary (vLLM's d2t) do.
        draft_quant: "int8" drafts through an int8 copy of the LM head's rows (all, or `draft_vocab`'s),
            quantised per row and multiplied by torch's int8 weight-only kernel: a quarter of float32's bytes
            per draft token, slightly different q, the same exact output. Default: None (the model's dtype).
        draft_confidence: stop drafting a chain early in an iteration once the drafted token's draft
            probability is below this (every row's, in a batch); chains only (refused with a tree). Default: off
            (always draft gamma).
        position_cost: for `adaptive`, r in v(gamma, rows) = (1 + r rows (gamma+1)) / (1 + r rows): what a
            verified position costs on this machine, so that gamma shrinks (to 0) as the batch grows where
            verification is compute-bound; one number, or {batch size: r} measured per batch size (interpolated
            between them). Default: the heads' setting (`selfspec tune` measures it), else v(gamma) measured on this
            machine (`selfspec.engine.verify_cost`): once per model, device, dtype and batch size, on the first call's
            cache, about 20 passes. Sampled output is exactly distributed either way; for a seeded sampling run that
            repeats across processes, give a position cost (the measured figures vary with the machine's load, and
            gamma, so the random stream, follows them).
        drafter: None drafts with the heads; without heads, with suffix drafting and n-gram lookup (the untrained
            exit, the model's own final norm and LM head after `exit_layer` layers where given); "ngram"
            with n-gram prompt lookup alone
            (`selfspec.NGramDrafter`); "suffix" with suffix drafting alone (`selfspec.SuffixDrafter`: the longest
            earlier match in the prompt, the output and earlier calls' answers, which this wrapper's drafter keeps);
            "hybrid" with n-gram lookup where the text has a match and the heads otherwise (adaptive: whichever the
            speedup equation favours from the acceptance each has shown); your own `selfspec.Drafter`; or a list of
            drafters and the names "ngram", "suffix" and "heads" (the heads' drafter), in order of preference, e.g.
            ["suffix", "heads"]. With a tree drafter among them (a `tree` for the heads, or a suffix tree) they do
            not take turns: every one's proposals join one candidate tree, verified in one pass
            (`selfspec.drafters.merged`; one prompt at a time).
        prompt_lookup_num_tokens, max_matching_ngram_size: the n-gram drafter's settings (transformers' names)
            for drafter="ngram" or "hybrid". Defaults: 10 and 2.
        compile: True runs the target's passes compiled (`torch.compile`, inductor) over a pre-allocated static
            cache: one graph for plain steps, one for verify passes of any width (`selfspec.adapter.static`); a
            dict gives `torch.compile` options, e.g. {"mode": "reduce-overhead"} for CUDA graphs. The first calls
            compile (tens of seconds on a CPU). One prompt at a time, chains only, drafters that do not run the
            target's layers themselves (n-gram lookup, Medusa and EAGLE heads, hybrids of them; a drafter of your
            own must not run the target on the cache in `draft`), models without sliding-window layers or dynamic rope
            scaling; calls on one instance must not overlap (one cache). Greedy output stays token-identical to
            `model.generate` in float32 (tested), and in half precision up to ties (see the README). Default: False.
        packed_weights: keep a copy of the target's float32 linear weights in oneDNN's blocked layout and multiply
            passes over several rows (verify passes, trees, the prompt, a batch's steps) with it, where MKL's kernels
            read a row-major weight slowly (`selfspec.adapter.packed`); one-position steps of one prompt keep
            transformers' product. It costs a second copy of those weights. Default (None): on for an eager float32
            target on an x86 CPU whose copy takes at most a tenth of the machine's memory
            (`selfspec.adapter.packed.packed_by_default`), off otherwise; `.packed_weights` says which.

    Attributes:
        drafters: every drafter in use, in order of preference: a tuple whose repr names each one, e.g.
            `Drafters('ngram', 'eagle')` for drafter="hybrid" with EAGLE heads (with a tree: one merged drafter,
            `Drafters('ngram + eagle')`, whose `parts` are the two).
        drafter: the drafter in use where there is one (`spec.drafter.clear_cache()` with drafter="suffix"); with
            several, `drafters` itself, so that it never shows one drafter of a hybrid as if it were the only one.
        stats: what the last `generate` call did (`selfspec.GenerationStats`), None before the first.
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
        draft_vocab_context: bool = True,
        draft_confidence: float | None = None,
        position_cost: float | dict[int, float] | None = None,
        drafter: Drafter | list[Drafter] | str | None = None,
        prompt_lookup_num_tokens: int | None = None,
        max_matching_ngram_size: int | None = None,
        compile: bool | dict = False,
        packed_weights: bool | None = None,
    ):
        self.model = model
        self.bundle = load_bundle(heads) if is_bundle(heads) else None
        suffix_options = {}
        if self.bundle is not None:  # what it records fills the arguments not given
            recorded = self.bundle.drafting_for(next(model.parameters()).dtype) if drafter is None else {}
            drafter = drafter if drafter is not None else recorded.get("drafter")
            tree = tree if tree is not None else recorded.get("tree")
            lookup = recorded.get("prompt_lookup_num_tokens")
            prompt_lookup_num_tokens = prompt_lookup_num_tokens if prompt_lookup_num_tokens is not None else lookup
            names = drafter if isinstance(drafter, list | tuple) else [drafter]
            heads = None  # the bundle's heads and draft vocabulary where the drafting reads them
            if any(name in (None, "hybrid", HEADS) for name in names):
                heads, vocab_file = self.bundle.file(self.bundle.heads), self.bundle.file(self.bundle.draft_vocab)
                draft_vocab = draft_vocab if draft_vocab is not None else vocab_file
            suffix_options = {**self.bundle.suffix, "memory": self.bundle.file(self.bundle.memory)}
        if not isinstance(compile, bool | dict):
            raise TypeError(f"compile={compile!r}: pass True, False or a dict of torch.compile options.")
        self.compiled = compile is not False
        options = compile if isinstance(compile, dict) else None
        # drafters by name that read no weights need only the whole model's forward: any causal LM with a KV cache
        names = drafter if isinstance(drafter, list | tuple) else [drafter]
        by_default = drafter is None and exit_layer is None  # DEFAULT_MODEL_FREE
        model_free = heads is None and (by_default or all(isinstance(n, str) and n in MODEL_FREE for n in names))
        packing = self._packing(packed_weights)
        self.adapter = (
            CompiledAdapter(model, options)
            if self.compiled
            else ModelAdapter(model, whole_model=model_free, packed_weights=packing)
        )
        self.packed_weights = self.adapter.packed is not None
        if self.bundle is not None:
            check_fingerprint(self.bundle.target, self.adapter, self.bundle.path)
        if heads is not None and not isinstance(heads, DraftHeads):
            heads = load_heads(heads, self.adapter)
        elif heads is not None and any(  # heads given as a module: a copy where they must move, not the caller's
            p.device != self.adapter.device or (p.is_floating_point() and p.dtype != self.adapter.dtype)
            for p in heads.parameters()
        ):
            heads = copy.deepcopy(heads)
        self.heads = heads
        if heads is not None:
            heads.to(device=self.adapter.device, dtype=self.adapter.dtype)
        if not isinstance(draft_vocab_context, bool):
            raise TypeError(f"draft_vocab_context={draft_vocab_context!r}: pass True or False.")
        vocab = None
        if draft_vocab is not None or draft_quant is not None:
            vocab = self.adapter.draft_vocabulary(draft_vocab, draft_quant, context=draft_vocab_context)
        ngram = {
            "prompt_lookup_num_tokens": prompt_lookup_num_tokens,
            "max_matching_ngram_size": max_matching_ngram_size,
        }
        ngram = {name: value for name, value in ngram.items() if value is not None}
        self.drafters = build_drafters(
            self.adapter, drafter, heads, exit_layer, tree, vocab, draft_confidence, ngram, suffix_options
        )
        self.hidden_layers = self._collect_hidden_layers()
        self.adaptive = num_draft_tokens is None if adaptive is None else adaptive
        shape = self.drafters[0].tree  # a tree drafter drafts alone
        estimate = self.drafters[0].tree_cost() if shape is not None else self.drafters[-1].estimated_cost()
        self.draft_cost = estimate if draft_cost is None else draft_cost
        if not self.draft_cost >= 0:
            raise ValueError(f"draft_cost={draft_cost!r} must be a non-negative number (draft token / plain step).")
        max_drafts = max(part.max_drafts for part in self.drafters)
        if num_draft_tokens is not None and (
            isinstance(num_draft_tokens, bool)
            or not isinstance(num_draft_tokens, int)
            or not 0 <= num_draft_tokens <= max_drafts
        ):
            what = f"what {self.drafters[0].name} drafts at most" if len(self.drafters) == 1 else "the drafters' limit"
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
        given = position_cost if position_cost is not None else recorded
        self.position_cost = check_position_cost(given) if given is not None else None  # None: measured per call
        self.exit_layer = getattr(self.drafters[-1], "exit_layer", None)  # the heads' drafter is the last
        self.num_draft_tokens = max(self.draft_limits)
        if self.adaptive and shape is not None and not isinstance(getattr(shape, "max_nodes", None), int):
            raise ValueError(
                f"{self.drafters[0].name}'s tree shape declares no max_nodes (the most candidates one of its trees "
                "has), which adaptive trees need to cost a tree's verify pass. Declare it beside max_depth, or pass "
                "adaptive=False to verify a tree every iteration."
            )
        self.stats = None
        if self.compiled:
            self._check_compiled()

    def _packing(self, packed_weights: bool | None) -> bool | None:
        """`packed_weights` checked, for the eager adapter (None: it applies `packed_by_default`)."""
        if packed_weights is None:
            return None
        if not isinstance(packed_weights, bool):
            raise TypeError(f"packed_weights={packed_weights!r}: pass True, False or None (the default's rule).")
        if packed_weights and self.compiled:
            raise ValueError(
                "packed_weights=True packs the weights of eager passes; compile=True compiles the passes (inductor "
                "chooses its own kernels). Pass one of the two."
            )
        return packed_weights

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

    def __call__(
        self, model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
        synced_gpus=False, streamer=None, tokenizer=None, **model_kwargs,
    ):  # fmt: skip
        """`model.generate(**inputs, custom_generate=spec)`: transformers prepares the call, this loop decodes it,
        with the output of `spec.generate` given the same arguments."""
        if synced_gpus:
            raise UnsupportedGenerationArgument("`synced_gpus` is not supported by selfspec.")
        return run_custom_generate(
            self, model, input_ids, logits_processor or [], stopping_criteria or [], generation_config, streamer,
            tokenizer, model_kwargs,
        )  # fmt: skip

    def __getattr__(self, name: str):
        # look-ups the wrapper does not answer pass through to the wrapped model, as peft does
        if name in {"model", "adapter"}:
            raise AttributeError(name)
        return getattr(self.model, name)

    def __repr__(self) -> str:
        return (
            f"SelfSpeculative({type(self.adapter.model).__name__}, drafters={self.drafters!r}, "
            f"exit_layer={self.exit_layer}/{self.adapter.num_layers}, num_draft_tokens={self.num_draft_tokens}, "
            f"heads={'trained' if self.heads is not None else 'none'})"
        )
