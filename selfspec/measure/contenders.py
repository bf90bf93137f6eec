"""The contenders of a benchmark: plain `model.generate` (greedy and sampling), transformers' own assisted modes (its
early exit, prompt lookup) and selfspec's modes (the plain loop with gamma = 0, early exit with the untrained and the
trained exit, Medusa chain and tree, EAGLE, n-gram lookup and hybrids, compiled or not), each a `Contender` that
`selfspec.measure.bench.run_bench` times."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from ..adapter.static import compiled_generate_options
from ..drafters.suffix import CACHED_REQUESTS, CACHED_TOKENS, SuffixDrafter
from ..engine.drafter import Drafter
from ..heads import EagleHeads, ExitHeads, MedusaHeads
from ..speculative import SelfSpeculative

# A small candidate tree for Medusa heads that carry none: two candidates for the next token, then chains.
DEFAULT_TREE = [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


def cut_tree(tree: list[list[int]], depth: int) -> list[list[int]]:
    """The paths of `tree` no deeper than `depth` (the number of Medusa heads)."""
    return [path for path in tree if len(path) <= depth]


def tree_for(heads: MedusaHeads) -> list[list[int]]:
    """The heads' own tree, else DEFAULT_TREE cut to their depth."""
    return heads.tree or cut_tree(DEFAULT_TREE, heads.num_heads)


@dataclass
class Contender:
    """One way of generating. `run(input_ids, max_new_tokens)` returns the output ids; `spec` is the
    SelfSpeculative behind it (its `stats` describe the last run), None for transformers' own modes."""

    name: str
    sampling: bool
    run: Callable[[torch.Tensor, int], torch.Tensor]
    spec: SelfSpeculative | None = None
    baseline: bool = False  # plain model.generate: what the speedups are relative to
    model: nn.Module | None = None  # a baseline's model: where a greedy divergence is checked for a tie
    plain_loop: bool = False  # selfspec with gamma = 0: the unit of c and v (of the compiled ones, if `compiled`)
    tree: bool = False
    compiled: bool = False  # torch.compile'd passes: compared with the compiled model.generate too
    options: dict = field(default_factory=dict)  # selfspec's: the SelfSpeculative arguments ...
    temperature: float = 1.0  # ... and the sampling temperature it was built with
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    stats: list[dict] = field(default_factory=list)
    matched: list[bool] = field(default_factory=list)
    prompt_indices: list[int] = field(default_factory=list)  # the prompt of each timed run
    outputs: list[torch.Tensor] = field(default_factory=list)  # a greedy baseline's output ids of each timed run

    def runs_on(self, prompts: set[int]) -> Contender:
        """A copy holding only the runs on the prompts with these indices (for per-category summaries)."""
        keep = [i for i, index in enumerate(self.prompt_indices) if index in prompts]

        def pick(values: list) -> list:  # per-run lists; empty where they do not apply (stats, matched, outputs)
            return [values[i] for i in keep] if values else []

        return replace(self, seconds=pick(self.seconds), tokens=pick(self.tokens), stats=pick(self.stats),
                       matched=pick(self.matched), prompt_indices=pick(self.prompt_indices),
                       outputs=pick(self.outputs))  # fmt: skip


def generate_contender(model: nn.Module, name: str, sampling: bool, temperature: float, **options) -> Contender:
    """`model.generate` itself, with transformers' own options (assistant_early_exit, prompt lookup ...)."""
    settings = {"do_sample": True, "temperature": temperature, "top_k": 0} if sampling else {"do_sample": False}

    def run(input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        mask = torch.ones_like(input_ids)
        return model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, **settings, **options)

    return Contender(name, sampling, run, baseline=not options, model=model)


def selfspec_contender(model: nn.Module, name: str, sampling: bool, temperature: float, **options) -> Contender:
    """selfspec with `SelfSpeculative(model, **options)`."""
    spec = SelfSpeculative(model, **options)
    settings = {"do_sample": True, "temperature": temperature, "top_k": 0} if sampling else {"do_sample": False}

    def run(input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        mask = torch.ones_like(input_ids)
        return spec.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, **settings)

    plain = options.get("num_draft_tokens") == 0
    tree = any(part.tree is not None for part in spec.drafters)
    return Contender(name, sampling, run, spec=spec, plain_loop=plain, tree=tree, compiled=spec.compiled,
                     options=options, temperature=temperature)  # fmt: skip


def variant_contenders(contenders: list[Contender], label: str, options: dict, where) -> list[Contender]:
    """Each selfspec contender for which `where(contender)` holds, again with `options` on top of its own, named
    "... (label)". Drafter objects among the options are copied: a drafter that remembers earlier answers remembers
    each contender's own."""
    return [
        selfspec_contender(
            c.spec.model,
            f"{c.name} ({label})",
            c.sampling,
            c.temperature,
            **c.options | copied_drafters(c.options) | options,
        )
        for c in contenders
        if c.spec is not None and where(c)
    ]


def fixed_tree_contenders(contenders: list[Contender]) -> list[Contender]:
    """Each adaptive selfspec tree contender again with adaptive=False, named "... (fixed)": a tree verified every
    iteration, against the default that falls back to plain steps where trees do not pay."""
    return variant_contenders(contenders, "fixed", {"adaptive": False}, lambda c: c.tree and c.spec.adaptive)


def unpacked_contenders(contenders: list[Contender]) -> list[Contender]:
    """Each selfspec contender that multiplies with packed weights again without them, named "... (unpacked)"."""
    return variant_contenders(contenders, "unpacked", {"packed_weights": False}, lambda c: c.spec.packed_weights)


def static_vocab_contenders(contenders: list[Contender]) -> list[Contender]:
    """Each selfspec contender that drafts from a draft vocabulary again without the call's own tokens joining it,
    named "... (static vocab)"."""

    def where(c: Contender) -> bool:
        return c.options.get("draft_vocab") is not None and c.options.get("draft_vocab_context", True)

    return variant_contenders(contenders, "static vocab", {"draft_vocab_context": False}, where)


def copied_drafters(options: dict) -> dict:
    """`options`' drafter objects (`drafter=`: one, or in a list) as copies, for a second wrapper."""
    drafter = options.get("drafter")
    if isinstance(drafter, Drafter):
        return {"drafter": copy.deepcopy(drafter)}
    if isinstance(drafter, list | tuple):
        return {"drafter": [copy.deepcopy(d) if isinstance(d, Drafter) else d for d in drafter]}
    return {}


def compiled_contenders(
    model: nn.Module,
    medusa_heads: MedusaHeads | None = None,
    eagle_heads: EagleHeads | None = None,
    draft_vocab: list[int] | None = None,
    prompt_lookup_num_tokens: int = 10,
) -> list[Contender]:
    """Greedy, compiled: `model.generate` with transformers' static cache and torch.compile (the fair baseline for
    a compiled selfspec), then selfspec with compile=True: the plain loop (the unit of c and v of the compiled
    contenders), n-gram lookup, the Medusa chain and the EAGLE chain (with `draft_vocab`), and each one's hybrid with
    n-gram lookup."""
    suffix = vocab_label(draft_vocab)
    field_ = [replace(generate_contender(model, "generate compiled", False, 1.0, **compiled_generate_options()),
                      compiled=True)]  # fmt: skip
    options = [("plain loop", {"num_draft_tokens": 0}),
               ("ngram", {"drafter": "ngram", "prompt_lookup_num_tokens": prompt_lookup_num_tokens})]  # fmt: skip
    hybrid = {"drafter": "hybrid", "prompt_lookup_num_tokens": prompt_lookup_num_tokens}
    for kind, heads, extra in (("medusa chain", medusa_heads, {"tree": []}), ("eagle", eagle_heads, {})):
        if heads is not None:
            settings = {"heads": heads, "draft_vocab": draft_vocab, **extra}
            options += [(f"{kind}{suffix}", settings), (f"hybrid ngram + {kind}{suffix}", {**settings, **hybrid})]
    for name, settings in options:
        field_.append(selfspec_contender(model, f"selfspec {name} compiled", False, 1.0, compile=True, **settings))
    return field_


def standard_contenders(
    model: nn.Module,
    exit_heads: ExitHeads | None = None,
    medusa_heads: MedusaHeads | None = None,
    assistant_exit_layers: list[int] | None = None,
    temperature: float = 0.8,
    sampling: bool = True,
    transformers_modes: bool = True,
    draft_vocab: list[int] | None = None,
    untrained_exit_layer: int | None = None,
    prompt_lookup_num_tokens: int = 10,
    eagle_heads: EagleHeads | None = None,
) -> list[Contender]:
    """The full field: plain generate, transformers' assisted modes, and every selfspec mode the heads allow:
    the untrained exit at the heads' first depth, each trained depth, Medusa chain and tree, sampling; with a
    `draft_vocab`, the Medusa modes and the middle trained depth once more with reduced-vocabulary drafts; the
    Medusa chain and the middle trained depth once more with an int8 draft LM head; n-gram lookup alone
    (transformers' prompt lookup settings) and hybrid with each kind of heads; an EAGLE head's chain (with the
    `draft_vocab` too), its hybrid with lookup and its sampling."""
    num_layers = model.config.get_text_config().num_hidden_layers
    exit_layer = exit_heads.exit_layers[0] if exit_heads is not None else max(1, num_layers // 4)
    exit_layer = untrained_exit_layer or exit_layer
    field_ = [generate_contender(model, "generate", False, temperature)]
    if sampling:
        field_.append(generate_contender(model, f"generate T={temperature}", True, temperature))
    if transformers_modes:
        for layer in assistant_exit_layers or sorted({max(1, num_layers // 4), max(1, num_layers // 2)}):
            field_.append(generate_contender(model, f"transformers early exit {layer}", False, temperature,
                                             assistant_early_exit=layer))  # fmt: skip
        field_.append(generate_contender(model, "transformers prompt lookup", False, temperature,
                                         prompt_lookup_num_tokens=10))  # fmt: skip
    field_.append(selfspec_contender(model, "selfspec plain loop", False, temperature, num_draft_tokens=0))
    lookup = {"prompt_lookup_num_tokens": prompt_lookup_num_tokens}  # transformers' prompt lookup settings
    field_.append(selfspec_contender(model, "selfspec ngram", False, temperature, drafter="ngram", **lookup))
    # with its memory of the other prompts' answers (`run_bench` keeps a prompt's own earlier answers out of it)
    field_.append(selfspec_contender(model, "selfspec suffix", False, temperature, drafter="suffix"))
    if exit_heads is not None:
        field_.append(selfspec_contender(model, "selfspec hybrid ngram + exit trained", False, temperature,
                                         drafter="hybrid", heads=exit_heads, **lookup))  # fmt: skip
    if medusa_heads is not None:
        field_.append(selfspec_contender(model, "selfspec hybrid ngram + medusa chain", False, temperature,
                                         drafter="hybrid", heads=medusa_heads, tree=[], **lookup))  # fmt: skip
    field_.append(selfspec_contender(model, f"selfspec exit {exit_layer} untrained", False, temperature,
                                     exit_layer=exit_layer))  # fmt: skip
    if exit_heads is not None:
        for layer in exit_heads.exit_layers:
            field_.append(selfspec_contender(model, f"selfspec exit {layer} trained", False, temperature,
                                             heads=exit_heads, exit_layer=layer))  # fmt: skip
        if draft_vocab is not None:
            layer = exit_heads.exit_layers[len(exit_heads.exit_layers) // 2]
            field_.append(selfspec_contender(model, f"selfspec exit {layer} trained, vocab {len(draft_vocab)}", False,
                                             temperature, heads=exit_heads, exit_layer=layer,
                                             draft_vocab=draft_vocab))  # fmt: skip
        layer = exit_heads.exit_layers[len(exit_heads.exit_layers) // 2]
        field_.append(selfspec_contender(model, f"selfspec exit {layer} trained, int8 head", False, temperature,
                                         heads=exit_heads, exit_layer=layer, draft_quant="int8"))  # fmt: skip
    if medusa_heads is not None:
        tree = tree_for(medusa_heads)
        field_.append(selfspec_contender(model, "selfspec medusa chain", False, temperature,
                                         heads=medusa_heads, tree=[]))  # fmt: skip
        field_.append(selfspec_contender(model, "selfspec medusa tree", False, temperature,
                                         heads=medusa_heads, tree=tree))  # fmt: skip
        if draft_vocab is not None:
            size = len(draft_vocab)
            field_.append(selfspec_contender(model, f"selfspec medusa chain, vocab {size}", False, temperature,
                                             heads=medusa_heads, tree=[], draft_vocab=draft_vocab))  # fmt: skip
            field_.append(selfspec_contender(model, f"selfspec medusa tree, vocab {size}", False, temperature,
                                             heads=medusa_heads, tree=tree, draft_vocab=draft_vocab))  # fmt: skip
        field_.append(selfspec_contender(model, "selfspec medusa chain, int8 head", False, temperature,
                                         heads=medusa_heads, tree=[], draft_quant="int8"))  # fmt: skip
        if draft_vocab is not None:
            field_.append(selfspec_contender(model, f"selfspec medusa chain, vocab {size}, int8 head", False,
                                             temperature, heads=medusa_heads, tree=[], draft_vocab=draft_vocab,
                                             draft_quant="int8"))  # fmt: skip
        if sampling:
            suffix = vocab_label(draft_vocab)
            field_.append(selfspec_contender(model, f"selfspec medusa chain T={temperature}{suffix}", True,
                                             temperature, heads=medusa_heads, tree=[],
                                             draft_vocab=draft_vocab))  # fmt: skip
    elif sampling:
        field_.append(selfspec_contender(model, f"selfspec exit {exit_layer} T={temperature}", True, temperature,
                                         heads=exit_heads, exit_layer=exit_layer))  # fmt: skip
    if eagle_heads is not None:
        field_ += eagle_contenders(model, eagle_heads, draft_vocab, temperature if sampling else None, lookup)
    return field_


EAGLE_TREE = {"nodes": 6, "top_k": 2, "depth": 4}  # a small dynamic tree: a CPU verifies few positions for free
# lookup's chain of 6 and the head's three best first guesses in one tree: the fastest merged shape on SmolLM2's CPU
# runs (docs/benchmarks.md, "Copies of natural text (stage 8)")
MERGED_TREE = ({"nodes": 3, "top_k": 3, "depth": 1}, 6)


def eagle_contenders(model, heads: EagleHeads, draft_vocab, temperature: float | None, lookup: dict):
    """An EAGLE head's chain (and with `draft_vocab`), a small dynamic tree, its hybrids with n-gram lookup (chains
    by turns, and the tree with lookup's chain merged into it), and its sampling at `temperature` (None: greedy
    only); chains with adaptive gamma up to the heads' default."""
    suffix = vocab_label(draft_vocab)
    field_ = [selfspec_contender(model, "selfspec eagle", False, 1.0, heads=heads)]
    if draft_vocab is not None:
        field_.append(selfspec_contender(model, f"selfspec eagle{suffix}", False, 1.0, heads=heads,
                                         draft_vocab=draft_vocab))  # fmt: skip
    field_.append(selfspec_contender(model, f"selfspec eagle tree{suffix}", False, 1.0, heads=heads,
                                     draft_vocab=draft_vocab, tree=EAGLE_TREE))  # fmt: skip
    field_.append(selfspec_contender(model, f"selfspec hybrid ngram + eagle{suffix}", False, 1.0, drafter="hybrid",
                                     heads=heads, draft_vocab=draft_vocab, **lookup))  # fmt: skip
    field_.append(selfspec_contender(model, f"selfspec hybrid ngram + eagle tree{suffix}", False, 1.0,
                                     drafter="hybrid", heads=heads, draft_vocab=draft_vocab, tree=EAGLE_TREE,
                                     **lookup))  # fmt: skip
    if temperature is not None:
        field_.append(selfspec_contender(model, f"selfspec eagle T={temperature}{suffix}", True, temperature,
                                         heads=heads, draft_vocab=draft_vocab))  # fmt: skip
        field_.append(selfspec_contender(model, f"selfspec hybrid ngram + eagle tree T={temperature}{suffix}", True,
                                         temperature, drafter="hybrid", heads=heads, draft_vocab=draft_vocab,
                                         tree=EAGLE_TREE, **lookup))  # fmt: skip
    return field_


def chain_contenders(model, heads: EagleHeads, draft_vocab, lengths: list[int]) -> list[Contender]:
    """An EAGLE head's greedy chains of a fixed length each (the adaptive controller off): their tokens per
    pass and acceptance by position depend on the head and the prompts, not on the machine."""
    if heads is None:
        raise ValueError("--chains needs EAGLE heads (the bundled head, or --heads with an EAGLE head)")
    return [
        selfspec_contender(
            model,
            f"selfspec eagle chain {k} (fixed)",
            False,
            1.0,
            heads=heads,
            draft_vocab=draft_vocab,
            num_draft_tokens=k,
            adaptive=False,
        )  # fmt: skip
        for k in lengths
    ]


def merged_contenders(
    model, heads: EagleHeads, draft_vocab, shapes: list[tuple[dict, int]], temperature: float | None = None
) -> list[Contender]:
    """n-gram lookup merged into an EAGLE head's dynamic trees (`selfspec.drafters.merged`): one contender per
    (tree shape, lookup chain length), greedy, and sampling at `temperature` too (None: greedy only)."""
    field_ = []
    for tree, lookup in shapes:
        name = f"selfspec merged ngram {lookup} + eagle tree {tree_name(tree)}"
        field_ += sampling_modes(model, name, temperature, lambda: "hybrid", heads=heads,
                                 draft_vocab=draft_vocab, tree=tree, prompt_lookup_num_tokens=lookup)  # fmt: skip
    return field_


def tree_name(tree: dict) -> str:
    return f"{tree['nodes']}-{tree['top_k']}-{tree['depth']}"


def sampling_modes(model, name: str, temperature: float | None, drafter, **options) -> list[Contender]:
    """`name` greedy, and at `temperature` too (None: greedy only), each named with its draft vocabulary;
    `drafter()` makes each one's own drafters."""
    modes = [(False, 1.0, "")] + ([(True, temperature, f" T={temperature}")] if temperature is not None else [])
    suffix = vocab_label(options.get("draft_vocab"))
    return [
        selfspec_contender(model, f"{name}{label}{suffix}", sampling, t, drafter=drafter(), **options)
        for sampling, t, label in modes
    ]


def vocab_label(draft_vocab) -> str:
    """How a contender's name tells its draft vocabulary: ", vocab N", or nothing without one."""
    return f", vocab {len(draft_vocab)}" if draft_vocab is not None else ""


def remembering(answers: list[list[int]], **options) -> SuffixDrafter:
    """A `SuffixDrafter(**options)` that remembers `answers` (token ids) before its first call, its cache bounds
    raised by their size."""
    tokens = sum(map(len, answers))
    bounds = {"max_cached_tokens": CACHED_TOKENS + tokens, "max_cached_requests": CACHED_REQUESTS + len(answers)}
    drafter = SuffixDrafter(**bounds, **options)
    drafter.remember(answers)
    return drafter


def memory_label(answers: list[list[int]]) -> str:
    return f"memory {sum(map(len, answers)):,} tokens"


def memory_merged_contenders(
    model, answers, heads: EagleHeads, draft_vocab, shape: tuple[dict, int], lookup: bool, temperature=None
) -> list[Contender]:
    """Suffix drafting that remembers `answers`, its chain of the shape's length merged into the head's tree of the
    shape (beside n-gram lookup's chain of that length where `lookup`), greedy and at `temperature` too (None:
    greedy only)."""
    tree, length = shape
    name = f"suffix {length}, {memory_label(answers)} + eagle tree {tree_name(tree)}"
    name = f"selfspec merged ngram {length} + {name}" if lookup else f"selfspec merged {name}"

    def drafter() -> list:
        return ["ngram"] * lookup + [remembering(answers, num_speculative_tokens=length), "heads"]

    options = {"prompt_lookup_num_tokens": length} if lookup else {}
    return sampling_modes(model, name, temperature, drafter, heads=heads, draft_vocab=draft_vocab, tree=tree,
                          **options)  # fmt: skip


def memory_contenders(
    model,
    answers: list[list[int]],
    eagle_heads: EagleHeads | None,
    draft_vocab,
    shapes: list[tuple[dict, int]] = (),
    temperature: float | None = None,
) -> list[Contender]:
    """Suffix drafting that remembers `answers` (token ids: `selfspec.chat.chat_answers` of a chat data set) before
    the first prompt (`remembering`); with an EAGLE head, that drafter before the head too, by turns and merged
    into the head's tree; and for each merged shape (tree, chain length) of `shapes`, its chain of that length
    merged into the head's tree, alone and beside n-gram lookup's chain of that length, greedy and at
    `temperature` too (None: greedy only)."""
    label = memory_label(answers)
    field_ = [selfspec_contender(model, f"selfspec suffix, {label}", False, 1.0, drafter=remembering(answers))]
    if eagle_heads is None:
        return field_
    vocab = vocab_label(draft_vocab)
    options = {"heads": eagle_heads, "draft_vocab": draft_vocab}
    field_.append(selfspec_contender(model, f"selfspec hybrid suffix, {label} + eagle{vocab}", False, 1.0,
                                     drafter=[remembering(answers), "heads"], **options))  # fmt: skip
    field_.append(selfspec_contender(model, f"selfspec merged suffix, {label} + eagle tree{vocab}", False, 1.0,
                                     drafter=[remembering(answers), "heads"], tree=EAGLE_TREE, **options))  # fmt: skip
    for shape in shapes:
        for lookup in (False, True):
            field_ += memory_merged_contenders(model, answers, eagle_heads, draft_vocab, shape, lookup, temperature)
    return field_
