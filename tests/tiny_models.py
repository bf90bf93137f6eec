"""Tiny randomly initialised causal LMs of every supported family, built from configs (no downloads).

Random tiny models have nearly flat logits, so an argmax could flip on the 1e-7 differences between a
multi-position verify pass and one-position steps. The LM head is scaled up to spread the logits; the
greedy comparisons themselves stay exact (`torch.equal` on token ids).
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Cohere2Config,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    GPT2Config,
    GPTNeoXConfig,
    GraniteConfig,
    LlamaConfig,
    MinistralConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
    Starcoder2Config,
)

SLIDING_WINDOW = 8  # small, so that generation runs past it

ARCHITECTURES = ["llama", "qwen2", "mistral", "phi3", "gemma", "gemma2", "gpt2", "gpt_neox"]
# families added later, covered together by tests/test_families.py (the modules above keep the first eight)
NEW_ARCHITECTURES = [
    "qwen3",
    "olmo2",
    "starcoder2",
    "mixtral",
    "qwen3_moe",
    "ministral",
    "smollm3",
    "granite",
    "cohere2",
    "gemma3_text",
]


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
    return _new_family_config(arch, llama_like, num_layers)


def _new_family_config(arch: str, llama_like: dict, num_layers: int):
    """Tiny configs of the families in NEW_ARCHITECTURES, each with what sets it apart switched on."""
    alternating = ["sliding_attention", "full_attention"] * (num_layers // 2)
    head_dim = llama_like["hidden_size"] // 4
    if arch == "qwen3":  # q/k norms; lower layers full attention, upper layers sliding
        return Qwen3Config(
            use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=num_layers // 2, **llama_like
        )
    if arch == "olmo2":  # norms after attention and MLP, q/k norms
        return Olmo2Config(**llama_like)
    if arch == "starcoder2":  # LayerNorm with biases, sliding window
        return Starcoder2Config(sliding_window=SLIDING_WINDOW, **llama_like)
    if arch == "mixtral":  # top-2 of 4 experts per position, sliding window
        return MixtralConfig(sliding_window=SLIDING_WINDOW, num_local_experts=4, num_experts_per_tok=2, **llama_like)
    if arch == "qwen3_moe":  # layer 0 dense, the others top-2 of 4 experts
        return Qwen3MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[0], **llama_like
        )
    if arch == "ministral":  # sliding and full layers alternate
        return MinistralConfig(head_dim=head_dim, sliding_window=SLIDING_WINDOW, layer_types=alternating, **llama_like)
    if arch == "smollm3":  # NoPE layers (1, 3) without rotary embeddings, those sliding
        return SmolLM3Config(
            no_rope_layers=[1, 0] * (num_layers // 2),
            use_sliding_window=True,
            sliding_window=SLIDING_WINDOW,
            **llama_like,
        )
    if arch == "granite":  # every multiplier away from 1, logits divided by logits_scaling
        return GraniteConfig(
            embedding_multiplier=4.0,
            residual_multiplier=0.5,
            attention_multiplier=0.3,
            logits_scaling=2.5,
            **llama_like,
        )
    if arch == "cohere2":  # parallel attention/MLP blocks, logits times logit_scale, NoPE full layers
        return Cohere2Config(sliding_window=SLIDING_WINDOW, layer_types=alternating, logit_scale=0.5, **llama_like)
    if arch == "gemma3_text":  # sliding and global layers, a rope base per layer type
        return Gemma3TextConfig(
            head_dim=head_dim,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention"] * (num_layers - 1) + ["full_attention"],
            **llama_like,
        )
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0, logit_scale: float = 8.0, attention: str = "eager", **config_overrides):
    """A tiny model of family `arch` in eval mode, its LM head scaled by `logit_scale`, attending with `attention`
    (transformers' attn_implementation: eager, or sdpa as real models load)."""
    torch.manual_seed(seed)
    config = tiny_config(arch, **config_overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
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


def chat_tokenizer():
    """Word-level tokens w0..w39 and the specials; a chat template whose assistant turns end with </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2, "user": 3, "assistant": 4, ":": 5} | {f"w{i}": 6 + i for i in range(40)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}{% if m['role'] == 'assistant' %} </s>{% endif %}"
        " {% endfor %}{% if add_generation_prompt %}assistant : {% endif %}"
    )
    return tokenizer
