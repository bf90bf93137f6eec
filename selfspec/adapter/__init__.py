"""Every use of transformers' model internals lives in this package.

The rest of selfspec sees a `ModelAdapter` (`core`): it runs the whole model, its first k decoder layers or the
layers above them, the model's own final norm and LM head, and crops or rearranges the cache. `OneLayerModel`
(`one_layer`) is one decoder layer of the target's own class, the body of an EAGLE head. `CompiledAdapter`
(`static`) runs the full passes compiled over a pre-allocated static cache.
"""

from ..families import SUPPORTED_ARCHITECTURES
from .core import (
    DraftVocabulary,
    ModelAdapter,
    ModelFingerprint,
    UnsupportedModelError,
    additive_mask,
    read_token_ids,
    unwrap_model,
)
from .one_layer import LAYOUTS, OneLayerModel

__all__ = [
    "LAYOUTS",
    "SUPPORTED_ARCHITECTURES",
    "DraftVocabulary",
    "ModelAdapter",
    "ModelFingerprint",
    "OneLayerModel",
    "UnsupportedModelError",
    "additive_mask",
    "read_token_ids",
    "unwrap_model",
]
