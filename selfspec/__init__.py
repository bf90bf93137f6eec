"""selfspec: exact self-speculative decoding for Hugging Face causal language models."""

import importlib

__version__ = "0.1.0"

_EXPORTS = {  # name -> the module that defines it, imported on first use (`selfspec --help` needs no torch)
    "FINAL": ".adapter",
    "SUPPORTED_ARCHITECTURES": ".adapter",
    "UnsupportedModelError": ".adapter",
    "chat_answers": ".chat",
    "frequent_tokens": ".adapter",
    "EagleDrafter": ".drafters.eagle",
    "EarlyExitDrafter": ".drafters.early_exit",
    "MedusaDrafter": ".drafters.medusa",
    "NGramDrafter": ".drafters.ngram",
    "SuffixDrafter": ".drafters.suffix",
    "Draft": ".engine.drafter",
    "Drafter": ".engine.drafter",
    "DrafterContractError": ".engine.drafter",
    "Verified": ".engine.drafter",
    "UnsupportedGenerationArgument": ".engine.generation",
    "GenerationStats": ".engine.stats",
    "DraftHeads": ".heads",
    "EagleHeads": ".heads",
    "ExitHead": ".heads",
    "ExitHeads": ".heads",
    "HeadsMismatchError": ".heads",
    "MedusaHeads": ".heads",
    "load_heads": ".heads",
    "SelfSpeculative": ".speculative",
    "KNOWN_TARGETS": ".targets",
    "load_known_target": ".targets",
    "load_model": ".targets",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'selfspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


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
    "chat_answers",
    "frequent_tokens",
    "load_heads",
    "load_known_target",
    "load_model",
]
