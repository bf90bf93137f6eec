"""selfspec: exact self-speculative decoding for Hugging Face causal language models."""

from .adapter import FINAL, SUPPORTED_ARCHITECTURES, UnsupportedModelError, frequent_tokens
from .drafters.eagle import EagleDrafter
from .drafters.early_exit import EarlyExitDrafter
from .drafters.medusa import MedusaDrafter
from .drafters.ngram import NGramDrafter
from .drafters.suffix import SuffixDrafter
from .engine.drafter import Draft, Drafter, DrafterContractError, Verified
from .engine.generation import UnsupportedGenerationArgument
from .engine.stats import GenerationStats
from .heads import DraftHeads, EagleHeads, ExitHead, ExitHeads, HeadsMismatchError, MedusaHeads, load_heads
from .speculative import SelfSpeculative
from .targets import KNOWN_TARGETS, load_known_target, load_model

__version__ = "0.1.0"

__all__ = [
    "FINAL",
    "SUPPORTED_ARCHITECTURES",
    "Draft",
    "DraftHeads",
    "Drafter",
    "DrafterContractError",
    "EagleDrafter",
    "EagleHeads",
    "EarlyExitDrafter",
    "ExitHead",
    "ExitHeads",
    "GenerationStats",
    "HeadsMismatchError",
    "KNOWN_TARGETS",
    "MedusaDrafter",
    "MedusaHeads",
    "NGramDrafter",
    "SelfSpeculative",
    "SuffixDrafter",
    "UnsupportedGenerationArgument",
    "UnsupportedModelError",
    "Verified",
    "frequent_tokens",
    "load_heads",
    "load_known_target",
    "load_model",
]
