"""Draft-only LoRA on the shared LM head: built by peft, read by drafts only, never by the verify pass."""

from __future__ import annotations

import pytest
import torch
from test_medusa import medusa_heads
from test_sampling_exactness import ROWS, chi_square_pvalue, exact_law, sampled_counts
from tiny_models import random_prompt, tiny_model

from selfspec import ExitHeads, SelfSpeculative, load_heads
from selfspec.adapter import ModelAdapter
from selfspec.heads.lora import DraftLoRA, peft_lora_config
from selfspec.training.distill import state_digest


def with_lora(heads, model, r=4, seed=0, scale=0.5):
    """A peft-built adapter on `model`'s LM head with non-zero factors, as after training."""
    heads.draft_lora = DraftLoRA.from_peft(model.get_output_embeddings(), peft_lora_config(r, 2 * r))
    torch.manual_seed(seed)
    with torch.no_grad():
        heads.draft_lora.lora_B.weight.normal_(0, scale)
    return heads


def exit_heads(model, layers=(1, 2)):
    return ExitHeads(ModelAdapter(model).fingerprint(), list(layers))


def test_peft_builds_the_factors_and_leaves_the_target_alone():
    from peft import get_peft_model

    model = tiny_model("llama")
    before = state_digest(model)
    lm_head = model.get_output_embeddings()
    flags = [p.requires_grad for p in model.parameters()]
    lora = with_lora(exit_heads(model), model).draft_lora
    assert type(model.get_output_embeddings()) is torch.nn.Linear  # no adapter layer in the model's own tree
    assert state_digest(model) == before and [p.requires_grad for p in model.parameters()] == flags
    assert lora.lora_A.weight.abs().sum() > 0  # peft's Kaiming init of A
    # the same factors inside peft's own LoRA layer give what the drafts compute
    from selfspec.heads.lora import _LMHeadHolder

    peft_layer = get_peft_model(_LMHeadHolder(lm_head), peft_lora_config(4, 8)).base_model.model.lm_head
    name = next(iter(peft_layer.lora_A))
    peft_layer.lora_A[name].weight.data.copy_(lora.lora_A.weight)
    peft_layer.lora_B[name].weight.data.copy_(lora.lora_B.weight)
    hidden = torch.randn(3, model.config.hidden_size)
    adapter = ModelAdapter(model)
    torch.testing.assert_close(adapter.lm_logits(hidden, lora=lora), peft_layer(hidden))
    assert not torch.allclose(adapter.lm_logits(hidden, lora=lora), adapter.lm_logits(hidden))  # it moves q
    ids = torch.tensor([1, 5, 9])
    torch.testing.assert_close(lora.delta(hidden, ids), lora.delta(hidden)[:, ids])  # rows of B for a vocabulary


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2", "qwen2"])
def test_greedy_with_a_draft_lora_matches_generate(arch):
    model = tiny_model(arch)
    prompt = random_prompt(6, seed=2)
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
    exit_lora = with_lora(exit_heads(model), model)
    medusa_lora = with_lora(medusa_heads(model), model, seed=1)
    subset = torch.arange(0, model.config.vocab_size, 2)
    for options in (
        {"heads": exit_lora, "exit_layer": 2, "num_draft_tokens": 3},
        {"heads": exit_lora, "exit_layer": 1, "num_draft_tokens": 2, "draft_vocab": subset},
        {"heads": medusa_lora, "tree": []},
        {"heads": medusa_lora, "tree": [[0], [1], [0, 0], [0, 0, 0]], "draft_vocab": subset},
    ):
        spec = SelfSpeculative(model, **options)
        assert torch.equal(spec.generate(prompt, max_new_tokens=30, do_sample=False), expected), options
        assert spec.stats.proposed > 0


def test_draft_lora_changes_the_drafts_not_the_verified_model():
    model = tiny_model("llama")
    heads = with_lora(exit_heads(model), model, scale=2.0)
    spec = SelfSpeculative(model, heads=heads, exit_layer=2)
    hidden = torch.randn(2, model.config.hidden_size)
    plain = SelfSpeculative(model, heads=exit_heads(model), exit_layer=2)
    assert not torch.allclose(spec.drafter.exit_logits(hidden), plain.drafter.exit_logits(hidden))
    prompt = random_prompt(5, seed=3)
    before = model(prompt).logits
    spec.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(model(prompt).logits, before)  # the model itself never carries the adapter
    assert spec.draft_cost > plain.draft_cost  # the factors are counted in the draft's cost


def test_sampling_with_a_draft_lora_is_distributed_as_the_target():
    model = tiny_model("llama", seed=3, vocab_size=4, num_layers=3, hidden=16, logit_scale=20.0)
    heads = with_lora(exit_heads(model, [1]), model, r=2, scale=1.0)
    spec = SelfSpeculative(model, heads=heads, exit_layer=1, num_draft_tokens=2)
    pvalue = chi_square_pvalue(sampled_counts(spec, rows=ROWS, temperature=0.9), exact_law(model, temperature=0.9))
    assert pvalue > 1e-3, f"sampled law differs from the target's (chi-square p = {pvalue:.2e})"


def test_heads_with_a_draft_lora_save_and_load(tmp_path):
    model = tiny_model("llama")
    heads = with_lora(exit_heads(model), model)
    heads.save_pretrained(tmp_path / "heads")
    loaded = load_heads(tmp_path / "heads", ModelAdapter(model))
    assert loaded.draft_lora.settings() == heads.draft_lora.settings()
    assert loaded.config_dict()["draft_lora"]["target"] == "lm_head"
    for name, tensor in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_draft_lora_errors():
    model = tiny_model("llama")
    lm_head = model.get_output_embeddings()
    with pytest.raises(ValueError, match="LM head.*only, not 'q_proj'"):
        DraftLoRA.from_peft(lm_head, peft_lora_config(4, 8).__class__(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="use_dora"):
        config = peft_lora_config(4, 8)
        config.use_dora = True
        DraftLoRA.from_peft(lm_head, config)
    with pytest.raises(ValueError, match="leaves the LM head as it is"):
        config = peft_lora_config(4, 8)
        config.init_lora_weights = "pissa"
        DraftLoRA.from_peft(lm_head, config)
    with pytest.raises(ValueError, match="own LM heads have none"):
        medusa = medusa_heads(model, own_lm_head=True)
        type(medusa)(medusa.fingerprint, 2, own_lm_head=True, draft_lora={"r": 2, "lora_alpha": 4})
    with pytest.raises(ValueError, match="rank r must be at least 1"):
        ExitHeads(ModelAdapter(model).fingerprint(), [1], draft_lora={"r": 0, "lora_alpha": 4})
    from selfspec.training.config import DraftLoraConfig

    with pytest.raises(ValueError, match="only, not 'model.layers.1.mlp'"):
        DraftLoraConfig(r=4, target="model.layers.1.mlp")
