"""The drafters a `SelfSpeculative` asks for: its `drafter`, `heads`, `exit_layer`, `tree` and n-gram arguments, checked
and turned into drafters in order of preference. Trained heads draft with their kind's drafter (`DRAFTERS`), so that
the wrapper never branches on the kind."""

from __future__ import annotations

import warnings

from ..adapter import DraftVocabulary, ModelAdapter
from ..engine.drafter import Drafter, Drafters
from ..heads import DraftHeads, EagleHeads, ExitHeads, MedusaHeads
from .eagle import EagleDrafter
from .early_exit import EarlyExitDrafter
from .medusa import MedusaDrafter
from .merged import MergedTreeDrafter
from .ngram import NGramDrafter
from .suffix import SuffixDrafter

NAMED_DRAFTERS = ("ngram", "suffix", "hybrid")  # SelfSpeculative(drafter=...) by name
MODEL_FREE = {"ngram": NGramDrafter, "suffix": SuffixDrafter}  # drafters by name that read no weights
# what SelfSpeculative(model) drafts with, without heads or an exit layer: drafting that pays without training (an
# untrained exit is rarely accepted), in order of preference; the adaptive choice decodes plainly where neither pays
DEFAULT_MODEL_FREE = ("suffix", "ngram")
HEADS = "heads"  # in a list of drafters: the drafter from the model's own weights (the heads, or the exit)
# the drafter of each kind of heads (`selfspec.heads.KINDS`): its `from_heads` makes it for the heads
DRAFTERS: dict[str, type[Drafter]] = {
    ExitHeads.kind: EarlyExitDrafter,
    MedusaHeads.kind: MedusaDrafter,
    EagleHeads.kind: EagleDrafter,
}


def build_drafters(
    adapter: ModelAdapter,
    drafter,
    heads: DraftHeads | None,
    exit_layer: int | None,
    tree: list | None,
    vocab: DraftVocabulary | None,
    confidence: float | None,
    ngram_options: dict,
    suffix_options: dict | None = None,
) -> Drafters:
    """The drafters of a `SelfSpeculative` (see its `drafter` argument), in order of preference; `suffix_options`
    configure the drafter named "suffix" (a bundle's memory). Raises ValueError for settings that do not apply to
    the chosen drafters."""
    model_options = {"heads": heads, "exit_layer": exit_layer, "tree": tree, "draft_vocab / draft_quant": vocab}
    given = [name for name, value in model_options.items() if value is not None]
    if drafter == "hybrid" and heads is None and exit_layer is None:
        warnings.warn(
            "drafter='hybrid' without heads: drafting with n-gram lookup alone (an untrained exit is rarely accepted "
            "and would slow generation down). Pass heads=... for the hybrid, or exit_layer=... for the untrained exit.",
            stacklevel=3,
        )
        drafter = "ngram"
    untrained_default = drafter is None and heads is None and exit_layer is None
    if untrained_default and (given or confidence is not None):
        options = ", ".join(given) or "draft_confidence"
        raise ValueError(
            f"Without heads or exit_layer, selfspec drafts with suffix drafting and n-gram lookup (no weights read); "
            f"{options} apply only to drafting with the model's own layers: pass heads=... (a tree needs Medusa or "
            "EAGLE heads) or exit_layer=... for the untrained exit."
        )
    if drafter is None or isinstance(drafter, str | Drafter):
        default = list(DEFAULT_MODEL_FREE) if untrained_default else [HEADS]
        names = {None: default, "hybrid": ["ngram", HEADS]}.get(drafter, [drafter])
    else:
        names = list(drafter) if isinstance(drafter, list | tuple) else None
    if not names or any(not isinstance(n, Drafter) and n not in (*MODEL_FREE, HEADS) for n in names):
        wrong = next((n for n in names or [] if not isinstance(n, Drafter | str)), None)
        if wrong is not None:
            raise TypeError(f"drafter must be a selfspec Drafter or a list of them; got {type(wrong).__name__}.")
        raise ValueError(
            f"drafter={drafter!r}: pass a Drafter, {' or '.join(map(repr, NAMED_DRAFTERS))}, or a list of Drafters "
            f"and the names {', '.join(map(repr, (*MODEL_FREE, HEADS)))} in order of preference."
        )
    if ngram_options and "ngram" not in names:
        raise ValueError(
            f"{', '.join(sorted(ngram_options))} configure n-gram drafting: pass drafter='ngram' or 'hybrid'."
        )
    if HEADS not in names and (given or confidence is not None):
        options = ", ".join(given) or "draft_confidence"
        if all(isinstance(n, Drafter) for n in names):
            raise ValueError(f"{options} configure selfspec's own drafter; with drafter=... configure your drafter "
                             "itself.")  # fmt: skip
        raise ValueError(f"drafter={drafter!r} drafts without the model: {options} does not apply "
                         "(drafter='hybrid' combines n-gram lookup with heads).")  # fmt: skip
    drafters = []
    for name in names:
        if isinstance(name, Drafter) and any(name is part for part in drafters):
            raise ValueError(
                f"drafter: the same {name.name} drafter is listed twice; each call would start, end and learn twice "
                "in it (a suffix drafter would remember every answer twice). List it once, or list two drafters."
            )
        if isinstance(name, Drafter):
            drafters.append(name)
        elif name == HEADS:
            drafters.append(model_drafter(adapter, heads, exit_layer, tree, vocab, confidence))
        else:
            options = {"ngram": ngram_options, "suffix": suffix_options or {}}[name]
            drafters.append(MODEL_FREE[name](**options))
    for part in drafters:
        if isinstance(part, SuffixDrafter):  # its cache may hold answers remembered before it met this model
            part.bind_vocabulary(adapter.vocab_size)
    if len(drafters) > 1 and any(part.tree is not None for part in drafters):  # one tree of every part's proposals
        return Drafters([MergedTreeDrafter(drafters)])
    return Drafters(drafters)


def model_drafter(adapter, heads, exit_layer, tree, vocab, confidence) -> Drafter:
    """The drafter from the model's own weights: the heads' kind's (`heads_drafter`), or the untrained exit (the
    model's final norm and LM head after a quarter of its layers by default)."""
    if heads is not None:
        return heads_drafter(heads, adapter, exit_layer, tree, vocab, confidence)
    if tree:
        raise ValueError("A candidate tree needs Medusa or EAGLE heads: early exit drafts a chain.")
    layer = exit_layer if exit_layer is not None else max(1, adapter.num_layers // 4)
    return EarlyExitDrafter(adapter, layer, vocab=vocab, confidence=confidence)


def heads_drafter(heads: DraftHeads, adapter: ModelAdapter, exit_layer, tree, vocab, confidence) -> Drafter:
    """The drafter of `heads`' kind (`DRAFTERS`), with the heads' tuned gamma (`num_draft_tokens`) as its default;
    options that do not apply to the kind raise ValueError."""
    kind = DRAFTERS.get(heads.kind)
    if kind is None:
        raise NotImplementedError(f"heads of kind {heads.kind!r} ({type(heads).__name__}) have no drafter")
    drafter = kind.from_heads(heads, adapter, exit_layer, tree, vocab, confidence)
    if confidence is not None and drafter.tree is not None:
        chain = "tree=[]" if heads.kind == MedusaHeads.kind else "no tree"
        raise ValueError(
            f"draft_confidence stops a chain early; {drafter.name} drafts trees, whose size the tree sets. Leave "
            f"draft_confidence out, or draft chains ({chain})."
        )
    drafter.default_drafts = min(heads.num_draft_tokens or drafter.default_drafts, drafter.max_drafts)
    return drafter
