"""Medusa heads: independent parameters, zero-initialised start, exact chain generation, folder round trip."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHITECTURES, random_prompt, tiny_model

from selfspec import HeadsMismatchError, MedusaHeads, SelfSpeculative
from selfspec.adapter import ModelAdapter


def medusa_heads(model, num_heads=4, num_layers=2, own_lm_head=False, seed=0, scale=0.3) -> MedusaHeads:
    """Heads with non-zero weights, as after training, so the drafts are neither trivial nor the target's."""
    heads = MedusaHeads(ModelAdapter(model).fingerprint(), num_heads, num_layers=num_layers, own_lm_head=own_lm_head)
    heads.init_own_lm_heads(model.get_output_embeddings())
    torch.manual_seed(seed)
    with torch.no_grad():
        for block in heads.blocks:
            for layer in block:
                layer.linear.weight.normal_(0, scale)
    return heads


def test_every_head_and_block_has_its_own_parameters():
    model = tiny_model("llama")
    heads = MedusaHeads(ModelAdapter(model).fingerprint(), num_heads=3, num_layers=2, own_lm_head=True)
    parameters = list(heads.parameters())
    assert len(parameters) == 3 * 2 * 2 + 3  # weight and bias per block, one LM head per head
    assert len({p.data_ptr() for p in parameters}) == len(parameters)  # no storage shared
    with torch.no_grad():
        heads.blocks[0][0].linear.weight.fill_(1.0)
    assert all(not torch.equal(block[0].linear.weight, heads.blocks[0][0].linear.weight) for block in heads.blocks[1:])
    assert not torch.equal(heads.blocks[0][1].linear.weight, heads.blocks[0][0].linear.weight)


@pytest.mark.parametrize("own_lm_head", [False, True])
def test_untrained_heads_start_as_the_next_token_head(own_lm_head):
    model = tiny_model("gemma2")  # soft-capped logits: the heads must apply the same capping
    adapter = ModelAdapter(model)
    heads = MedusaHeads(adapter.fingerprint(), num_heads=3, own_lm_head=own_lm_head)
    heads.init_own_lm_heads(model.get_output_embeddings())
    prompt = random_prompt(6)
    logits, hidden = adapter.forward_with_hidden(prompt, torch.arange(6)[None], adapter.new_cache(), logits_to_keep=1)
    proposals = heads.logits(hidden[:, -1], adapter)  # [1, 3, V]
    for head in range(3):
        torch.testing.assert_close(proposals[:, head], logits[:, -1])


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model(request):
    return tiny_model(request.param)


def test_chain_greedy_matches_generate(model):
    heads = medusa_heads(model, num_heads=5)
    for gamma, prompt_length in [(1, 1), (2, 17), (3, 5), (5, 50), (4, 9)]:
        prompt = random_prompt(prompt_length, seed=gamma)
        expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
        spec = SelfSpeculative(model, heads=heads, num_draft_tokens=gamma)
        actual = spec.generate(prompt, max_new_tokens=40, do_sample=False)
        assert torch.equal(actual, expected), (model.config.model_type, gamma, prompt_length)
        assert spec.stats.new_tokens == spec.stats.accepted + spec.stats.target_passes


def test_round_trip_gives_identical_weights_and_generations(tmp_path):
    model = tiny_model("qwen2")
    heads = medusa_heads(model, num_heads=3, own_lm_head=True, seed=2)
    heads.save_pretrained(tmp_path / "medusa")
    spec = SelfSpeculative(model, heads=tmp_path / "medusa")
    assert isinstance(spec.heads, MedusaHeads) and spec.num_draft_tokens == 3
    for name, tensor in heads.state_dict().items():
        assert torch.equal(spec.heads.state_dict()[name], tensor)
    prompt = random_prompt(7, seed=4)
    outputs = [s.generate(prompt, max_new_tokens=30) for s in (SelfSpeculative(model, heads=heads), spec)]
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], model.generate(prompt, max_new_tokens=30))


def test_medusa_argument_errors(tmp_path):
    model = tiny_model("llama")
    heads = medusa_heads(model, num_heads=3)
    with pytest.raises(ValueError, match="exit_layer does not apply"):
        SelfSpeculative(model, heads=heads, exit_layer=2)
    with pytest.raises(ValueError, match="from 1 to 3"):
        SelfSpeculative(model, heads=heads, num_draft_tokens=4)
    heads.save_pretrained(tmp_path / "medusa")
    with pytest.raises(HeadsMismatchError, match="vocab_size=96.*vocab_size=80"):
        SelfSpeculative(tiny_model("llama", vocab_size=80), heads=tmp_path / "medusa")
