"""Attention over several positions that reads grouped keys in place (`selfspec.adapter.grouped`): the same output,
bit for bit, as transformers' SDPA attention, which copies the keys per query head; taken only where it applies,
and the model's attention setting restored after every pass."""

from types import SimpleNamespace

import pytest
import torch
from test_medusa import TREE, medusa_heads
from tiny_models import padded_prompts, random_prompt, tiny_model
from transformers import DynamicCache
from transformers.integrations import sdpa_attention

from selfspec import SelfSpeculative
from selfspec.adapter import ModelAdapter, grouped
from selfspec.adapter.grouped import NAME, grouped_attention, grouped_sdpa


def attention_inputs(dtype, queries: int, keys: int, mask_kind: str, heads: int = 6, key_heads: int = 2):
    generator = torch.Generator().manual_seed(queries * 1000 + keys)
    shape = lambda n, h: (2, n, h, 16)  # noqa: E731  [batch, positions, heads, d], transposed as the layers do
    query, key, value = (torch.randn(shape(n, h), generator=generator, dtype=dtype).transpose(1, 2)
                         for n, h in ((queries, heads), (keys, key_heads), (keys, key_heads)))  # fmt: skip
    visible = torch.rand(2, 1, queries, keys, generator=generator) > 0.3
    visible[..., 0] = True
    if mask_kind == "float":
        return query, key, value, torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)
    return query, key, value, visible


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("queries,keys", [(2, 9), (5, 40), (16, 300)])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_grouped_attention_equals_transformers_sdpa_bit_for_bit(dtype, queries, keys, mask_kind):
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    query, key, value, mask = attention_inputs(dtype, queries, keys, mask_kind)
    ours, _ = grouped_sdpa(module, query, key, value, mask, scaling=0.25)
    theirs, _ = sdpa_attention.sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    assert ours.shape == theirs.shape == (2, queries, 6, 16)
    assert torch.equal(ours, theirs)


def sdpa_calls(monkeypatch) -> list[bool]:
    """Records, per call of torch's SDPA, whether it read grouped keys in place (enable_gqa)."""
    calls, real = [], torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("enable_gqa", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def test_a_verify_pass_reads_grouped_keys_in_place_and_gives_the_same_logits(monkeypatch):
    model = tiny_model("llama", seed=1, attention="sdpa")  # 4 query heads on 2 key heads
    assert model.config._attn_implementation == "sdpa"
    adapter = ModelAdapter(model)
    prompt, drafts = torch.randint(2, 96, (1, 30)), torch.randint(2, 96, (1, 5))
    positions = torch.arange(35)[None]
    mask = torch.ones(1, 35, dtype=torch.long)
    with torch.no_grad():
        cache = adapter.new_cache()
        adapter.forward(prompt, positions[:, :30], cache, mask[:, :30])
        reference_cache = DynamicCache(config=model.config)
        model(input_ids=prompt, position_ids=positions[:, :30], attention_mask=mask[:, :30],
              past_key_values=reference_cache)  # fmt: skip
        calls = sdpa_calls(monkeypatch)
        ours = adapter.forward(drafts, positions[:, 30:], cache, mask)
        in_pass = list(calls)
        theirs = model(input_ids=drafts, position_ids=positions[:, 30:], attention_mask=mask,
                       past_key_values=reference_cache).logits  # fmt: skip
    assert in_pass == [True] * model.config.num_hidden_layers  # every layer of the pass, none copied
    assert calls[len(in_pass) :] == [False] * model.config.num_hidden_layers  # transformers' own path, outside
    assert torch.equal(ours, theirs)
    assert model.config._attn_implementation == "sdpa"  # restored after the pass


def test_one_position_and_eager_attention_keep_transformers_path(monkeypatch):
    model = tiny_model("llama", seed=1, attention="sdpa")
    adapter = ModelAdapter(model)
    delegated, real = [], grouped.sdpa_attention_forward

    def recorded(module, query, *args, **kwargs):
        delegated.append(query.shape)
        return real(module, query, *args, **kwargs)

    monkeypatch.setattr(grouped, "sdpa_attention_forward", recorded)
    with torch.no_grad():
        cache = adapter.new_cache()
        adapter.forward(torch.randint(2, 96, (1, 6)), torch.arange(6)[None], cache)  # no mask: causal, as transformers
        adapter.forward(torch.randint(2, 96, (1, 1)), torch.tensor([[6]]), cache)  # one query
    layers = model.config.num_hidden_layers
    assert [shape[2] for shape in delegated] == [6] * layers + [1] * layers
    model.config._attn_implementation = "eager"
    with grouped_attention(model.config):
        assert model.config._attn_implementation == "eager"  # only SDPA is replaced


def test_the_attention_setting_is_restored_when_a_pass_fails():
    model = tiny_model("llama", seed=1, attention="sdpa")
    adapter = ModelAdapter(model)
    with pytest.raises(IndexError), torch.no_grad():
        adapter.forward(torch.tensor([[500]]), torch.tensor([[0]]), adapter.new_cache())  # token id out of range
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="inside"), grouped_attention(model.config):
        assert model.config._attn_implementation == NAME
        raise RuntimeError("inside")
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma3_text"])
def test_greedy_output_of_sdpa_targets_equals_generate(arch, monkeypatch):
    """Targets that attend with SDPA, as real models load (the other exactness tests use eager attention): chains,
    trees and a left-padded batch, through sliding and mixed masks, token for token with `model.generate`."""
    model = tiny_model(arch, attention="sdpa")
    calls = sdpa_calls(monkeypatch)
    for length in (1, 17, 50):
        prompt = random_prompt(length, seed=length)
        expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
        chain = SelfSpeculative(model, exit_layer=2, num_draft_tokens=4, adaptive=False)
        assert torch.equal(chain.generate(prompt, max_new_tokens=30, do_sample=False), expected), (arch, length)
        tree = SelfSpeculative(model, heads=medusa_heads(model), tree=TREE, adaptive=False)
        assert torch.equal(tree.generate(prompt, max_new_tokens=30, do_sample=False), expected), (arch, length)
    padded, mask = padded_prompts([9, 13, 4], seed=2)
    expected = model.generate(padded, attention_mask=mask, max_new_tokens=20, do_sample=False)
    chain = SelfSpeculative(model, exit_layer=2, num_draft_tokens=3, adaptive=False)
    assert torch.equal(chain.generate(padded, attention_mask=mask, max_new_tokens=20, do_sample=False), expected)
    assert any(calls)  # the grouped path ran in selfspec's passes
