"""The drafters a `SelfSpeculative` asks for: its `drafter`, `heads`, `exit_layer`, `tree` and n-gram arguments, checked
and turned into drafters in order of preference. Trained heads draft with their kind's drafter (`DRAFTERS`), so that
the wrapper never branches on the kind."""

from __future__ import annotations

from ..adapter import DraftVocabulary, ModelAdapter
from ..engine.drafter import Drafter
from ..heads import DraftHeads, EagleHeads, ExitHeads, MedusaHeads
from .eagle import EagleDrafter
from .early_exit import EarlyExitDrafter
from .medusa import MedusaDrafter
from .ngram import NGramDrafter

NAMED_DRAFTERS = ("ngram", "hybrid")  # SelfSpeculative(drafter=...) by name
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
) -> list[Drafter]:
    """The drafters of a `SelfSpeculative` (see its `drafter` argument), in order of preference. Raises
    ValueError for settings that do not apply to the chosen drafters."""
    model_options = {"heads": heads, "exit_layer": exit_layer, "tree": tree, "draft_vocab / draft_quant": vocab}
    given = [name for name, value in model_options.items() if value is not None]
    if ngram_options and drafter not in NAMED_DRAFTERS:
        raise ValueError(
            f"{', '.join(sorted(ngram_options))} configure n-gram drafting: pass drafter='ngram' or 'hybrid'."
        )
    if isinstance(drafter, Drafter) or (isinstance(drafter, list | tuple) and drafter):
        drafters = [drafter] if isinstance(drafter, Drafter) else list(drafter)
        wrong = [part for part in drafters if not isinstance(part, Drafter)]
        if wrong:
            raise TypeError(f"drafter must be a selfspec Drafter or a list of them; got {type(wrong[0]).__name__}.")
        if given or confidence is not None:
            raise ValueError(
                f"{', '.join(given) or 'draft_confidence'} configure selfspec's own drafter; with drafter=... "
                "configure your drafter itself."
            )
    elif drafter == "ngram":
        if given or confidence is not None:
            raise ValueError(f"drafter='ngram' drafts without the model: {', '.join(given) or 'draft_confidence'} "
                             "does not apply (drafter='hybrid' combines it with heads).")  # fmt: skip
        drafters = [NGramDrafter(**ngram_options)]
    elif drafter in (None, "hybrid"):
        own = model_drafter(adapter, heads, exit_layer, tree, vocab, confidence)
        drafters = [NGramDrafter(**ngram_options), own] if drafter == "hybrid" else [own]
    else:
        raise ValueError(f"drafter={drafter!r}: pass a Drafter, a list of them, {' or '.join(NAMED_DRAFTERS)}.")
    if len(drafters) > 1 and any(part.tree is not None for part in drafters):
        raise ValueError("A tree drafter drafts alone: combine chains only (tree=[] drafts a Medusa chain).")
    return drafters


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
    drafter.default_drafts = min(heads.num_draft_tokens or drafter.default_drafts, drafter.max_drafts)
    return drafter
