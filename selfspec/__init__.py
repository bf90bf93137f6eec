"""selfspec: exact self-speculative decoding for Hugging Face causal language models."""

from .adapter import SUPPORTED_ARCHITECTURES, UnsupportedModelError
from .drafters import frequent_tokens
from .generation import UnsupportedGenerationArgument
from .heads import DraftHeads, ExitHead, ExitHeads, HeadsMismatchError, MedusaHeads, load_heads
from .speculative import SelfSpeculative
from .stats import GenerationStats

__version__ = "0.1.0"

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "DraftHeads",
    "ExitHead",
    "ExitHeads",
    "GenerationStats",
    "HeadsMismatchError",
    "MedusaHeads",
    "SelfSpeculative",
    "UnsupportedGenerationArgument",
    "UnsupportedModelError",
    "frequent_tokens",
    "load_heads",
]
