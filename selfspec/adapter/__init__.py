"""Every use of transformers' model internals lives in this package.

The rest of selfspec sees a `ModelAdapter` (`core`): it runs the whole model, its first k decoder layers or the
layers above them, the model's own final norm and LM head, and crops or rearranges the cache. `DraftVocabulary`
(`vocab`) is the LM head as drafts read it. `OneLayerModel` (`one_layer`) is one decoder layer of the target's own
class, the body of an EAGLE head; `unrolled` is the block-sparse attention of its unrolled training steps, and
`grouped` the attention of passes over several positions that reads grouped keys without copying them, and `packed`
the copy of the float32 linear weights in oneDNN's layout that those passes multiply with. `probes` reads from a model
what its config does not say (the cache keyword, what generate does at a longrope switch, and whether a model
outside the supported families verifies drafts in one pass as its one-token steps compute them).
`CompiledAdapter` (`static`) runs the full passes compiled over a pre-allocated static cache.
"""

from ..families import SUPPORTED_ARCHITECTURES
from .core import (
    FINAL,
    ModelAdapter,
    ModelFingerprint,
    UnsupportedModelError,
    additive_mask,
    unwrap_model,
)
from .one_layer import LAYOUTS, OneLayerModel
from .probes import cache_keyword
from .vocab import CallVocabulary, DraftVocabulary, draft_head_size, frequent_tokens, read_token_ids

__all__ = [
    "FINAL",
    "LAYOUTS",
    "SUPPORTED_ARCHITECTURES",
    "CallVocabulary",
    "DraftVocabulary",
    "ModelAdapter",
    "ModelFingerprint",
    "OneLayerModel",
    "UnsupportedModelError",
    "additive_mask",
    "cache_keyword",
    "draft_head_size",
    "frequent_tokens",
    "read_token_ids",
    "unwrap_model",
]
