"""Grouped-query attention over several query positions without copying the keys (`grouped_attention`).

In a pass over several positions with a mask (every verify pass and every tree), transformers' SDPA attention
copies each layer's keys and values, cache included, once for every query head that shares them (`repeat_kv`)
before calling torch's SDPA: a copy of the whole cache per layer and pass, which grows with the context. (For one
position it regroups the queries instead, and copies nothing.) torch's SDPA reads grouped keys itself
(`enable_gqa=True`), and on a CPU its result is the same, bit for bit, in float32 and bfloat16 (tests/test_grouped.py):
only the copy goes, and with it 5.5% of a pass over 4 positions of SmolLM2-135M (9 query heads on 3 key heads) after
Spec-Bench prompts, more after longer ones (docs/benchmarks.md, "Verify passes without copying grouped keys").

Only on a CPU: on CUDA, torch's SDPA with both a mask and grouped keys may fall back to its math kernel, so there
transformers' own path is kept. Used inside `grouped_attention(config)`, around the adapter's eager passes.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "selfspec_grouped_sdpa"


def grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers attention function: SDPA with grouped keys read in place for several queries under a mask on a
    CPU; anything else (one query, no mask, as many key heads as query heads, a softcap or position bias, another
    device) goes to transformers' SDPA attention unchanged."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if (
        not grouped
        or query.shape[2] == 1
        or query.device.type != "cpu"
        or not isinstance(attention_mask, torch.Tensor)
        or kwargs.get("softcap") is not None
        or kwargs.get("position_bias") is not None
        or kwargs.get("output_attentions", False)
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    # with a mask, transformers' path is this call on copied keys with is_causal=False
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, grouped_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks SDPA gets


@contextmanager
def attention_as(config, name: str):
    """Within the block, a model built from `config` whose attention is SDPA attends with the registered attention
    function `name`; other attention implementations (eager, or a family's own) are left as they are."""
    before = config._attn_implementation
    if before != "sdpa":
        yield
        return
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def grouped_attention(config):
    """Within the block, a model built from `config` whose attention is SDPA attends with `grouped_sdpa`."""
    return attention_as(config, NAME)
