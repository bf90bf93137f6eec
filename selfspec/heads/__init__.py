"""Trained draft heads: what each kind is, how it trains, and its folder (docs/design.md, "Heads folders").

Each kind's module holds its layers and what training, `selfspec profile` and `selfspec tune` need of it (the
methods of `base.DraftHeads`): `early_exit.ExitHeads` (a residual block per exit depth before the target's own
final norm and LM head), `medusa.MedusaHeads` (heads on the last hidden state, head i proposing the token i+1
positions ahead), `eagle.EagleHeads` (one decoder layer drafting on the target's features). `lora.DraftLoRA` is a
draft-only adapter on the shared LM head, saved with the heads. `kinds` registers the kinds and loads a folder.
The drafter of each kind is in `selfspec.drafters`, which imports these modules, never the reverse.
"""

from .base import CARD_NAME, CONFIG_NAME, WEIGHTS_NAME, DraftHeads, DraftSetting, HeadsMismatchError
from .eagle import EagleHeads
from .early_exit import ExitHead, ExitHeads, default_exit_layers
from .kinds import KINDS, check_fingerprint, load_heads
from .medusa import MedusaHeads, ResidualBlock

__all__ = [
    "CARD_NAME", "CONFIG_NAME", "KINDS", "WEIGHTS_NAME", "DraftSetting", "DraftHeads", "EagleHeads", "ExitHead",
    "ExitHeads", "HeadsMismatchError", "MedusaHeads", "ResidualBlock", "check_fingerprint", "default_exit_layers",
    "load_heads",
]  # fmt: skip
