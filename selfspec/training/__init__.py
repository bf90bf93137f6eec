"""The library side of training draft heads (the scripts are in training/): `config` (the YAML configs), `data` (the
text, tokenised and packed) and `distill` (the distillation losses and the held-out scores)."""
