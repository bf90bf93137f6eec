"""Tiny randomly initialised causal LMs of every supported family, built from configs (no downloads).

Random tiny models have nearly flat logits, so an argmax could flip on the 1e-7 differences between a
multi-position verify pass and one-position steps. The LM head is scaled up to spread the logits; the
greedy comparisons themselves stay exact (`torch.equal` on token ids).
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GemmaConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
)

SLIDING_WINDOW = 8  # small, so that generation runs past it

ARCHITECTURES = ["llama", "qwen2", "mistral", "phi3", "gemma", "gemma2", "gpt2", "gpt_neox"]


def tiny_config(arch: str, vocab_size: int = 96, num_layers: int = 4, hidden: int = 32, **extra):
    common = dict(
        vocab_size=vocab_size, bos_token_id=1, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False, **extra
    )
    llama_like = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        **common,
    )
    if arch == "llama":
        return LlamaConfig(**llama_like)
    if arch == "qwen2":  # lower layers full attention, upper layers sliding
        return Qwen2Config(
            use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=num_layers // 2, **llama_like
        )
    if arch == "mistral":
        return MistralConfig(sliding_window=SLIDING_WINDOW, **llama_like)
    if arch == "phi3":
        return Phi3Config(sliding_window=SLIDING_WINDOW, **llama_like)
    if arch == "gemma":
        return GemmaConfig(head_dim=hidden // 4, **llama_like)
    if arch == "gemma2":  # alternating sliding / full layers, soft-capped logits
        return Gemma2Config(head_dim=hidden // 4, sliding_window=SLIDING_WINDOW, **llama_like)
    if arch == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=num_layers, n_head=4, n_positions=512, **common)
    if arch == "gpt_neox":
        return GPTNeoXConfig(
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            max_position_embeddings=512,
            **common,
        )
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0, logit_scale: float = 8.0, **config_overrides):
    """A tiny model of family `arch` in eval mode, its LM head scaled by `logit_scale`."""
    torch.manual_seed(seed)
    config = tiny_config(arch, **config_overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(logit_scale)
    return model.eval()


def random_prompt(length: int, vocab_size: int = 96, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (1, length), generator=generator)


def padded_prompts(lengths: list[int], seed: int = 0, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of these lengths, left-padded to one width with `pad`, and their attention mask."""
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = random_prompt(length, seed=seed + row)[0]
        mask[row, width - length :] = 1
    return ids, mask
