"""Wrapping: defaults, errors, one set of weights, trained exit heads, peft targets, the statistics."""

from __future__ import annotations

import os
import re

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny_models import random_prompt, tiny_model
from transformers import AutoModelForMaskedLM, BertConfig, T5Config, T5ForConditionalGeneration

from selfspec import ExitHeads, GenerationStats, HeadsMismatchError, SelfSpeculative, UnsupportedModelError
from selfspec.adapter import ModelAdapter


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=4, num_layers=8)


def test_defaults_need_no_training(model):
    """Without heads: suffix drafting and n-gram lookup, which read no weights, adaptive; the exit by argument."""
    spec = SelfSpeculative(model)
    assert repr(spec.drafters) == "Drafters('suffix', 'ngram')" and spec.adaptive and spec.heads is None
    assert spec.exit_layer is None
    prompt = torch.cat([random_prompt(5)] * 3, dim=1)  # a repeated prompt: lookup has something to propose
    assert torch.equal(spec.generate(prompt, max_new_tokens=20), model.generate(prompt, max_new_tokens=20))
    assert spec.stats.proposed > 0
    exit_spec = SelfSpeculative(model, exit_layer=2)
    assert exit_spec.exit_layer == 2 and exit_spec.num_draft_tokens == 4
    assert torch.equal(exit_spec.generate(prompt, max_new_tokens=20), model.generate(prompt, max_new_tokens=20))


def test_wrapper_shares_the_model_weights(model):
    """No deep copy: every tensor the wrapper computes with is a parameter of the model itself."""
    storage = {p.data_ptr() for p in model.parameters()}
    spec = SelfSpeculative(model, exit_layer=3)
    adapter = spec.adapter
    assert adapter.model is model
    used = [*adapter.layers.parameters(), *adapter.final_norm.parameters(), *adapter.lm_head.parameters()]
    assert used and all(p.data_ptr() in storage for p in used)
    assert spec.drafter.head is None
    # attribute look-ups pass through to the model, as with peft
    assert spec.config is model.config


@pytest.mark.parametrize("exit_layer", [0, 8, -1, 2.5, True])
def test_exit_layer_out_of_range(model, exit_layer):
    with pytest.raises(ValueError, match="exit_layer.*1 to 7"):
        SelfSpeculative(model, exit_layer=exit_layer)


@pytest.mark.parametrize("gamma", [-1, -2, 33, 1000, 2.0])
def test_num_draft_tokens_out_of_range(model, gamma):
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SelfSpeculative(model, num_draft_tokens=gamma)


def test_unsupported_architectures_are_named():
    bert = AutoModelForMaskedLM.from_config(
        BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    )
    with pytest.raises(UnsupportedModelError, match="'bert'"):
        SelfSpeculative(bert, exit_layer=1)
    t5 = T5ForConditionalGeneration(
        T5Config(vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2)
    )
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        SelfSpeculative(t5, exit_layer=1)


def trained_looking_heads(model, exit_layers=(2, 4), seed=0) -> ExitHeads:
    """Exit heads with non-zero weights (as after training), so the draft differs from the untrained exit."""
    from selfspec.adapter import ModelAdapter

    heads = ExitHeads(ModelAdapter(model).fingerprint(), list(exit_layers), num_draft_tokens=3)
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.normal_(0, 0.3)
    return heads


def test_exit_heads_round_trip_and_stay_exact(model, tmp_path):
    heads = trained_looking_heads(model)
    heads.save_pretrained(tmp_path / "heads")
    assert sorted(p.name for p in (tmp_path / "heads").iterdir()) == ["README.md", "config.json", "model.safetensors"]
    umask = os.umask(0o022)
    os.umask(umask)
    assert (tmp_path / "heads").stat().st_mode & 0o777 == 0o777 & ~umask  # like any folder (0755), not private
    for written in (tmp_path / "heads").iterdir():  # and its files like any file (0644)
        assert written.stat().st_mode & 0o777 == 0o666 & ~umask, written.name
    loaded = SelfSpeculative(model, heads=tmp_path / "heads")
    assert loaded.exit_layer == 2 and loaded.num_draft_tokens == 3
    for name, tensor in heads.state_dict().items():
        assert torch.equal(loaded.heads.state_dict()[name], tensor)
    prompt = random_prompt(9, seed=5)
    in_memory = SelfSpeculative(model, heads=heads, exit_layer=4)
    from_disk = SelfSpeculative(model, heads=tmp_path / "heads", exit_layer=4)
    outputs = [spec.generate(prompt, max_new_tokens=30) for spec in (in_memory, from_disk)]
    assert torch.equal(outputs[0], outputs[1])
    assert torch.equal(outputs[0], model.generate(prompt, max_new_tokens=30))  # any head: still exact
    untrained = SelfSpeculative(model, exit_layer=4)
    untrained.generate(prompt, max_new_tokens=30)
    assert in_memory.stats.alpha != untrained.stats.alpha  # the head really changed the draft
    # saving again over the folder replaces it atomically
    trained_looking_heads(model, seed=1).save_pretrained(tmp_path / "heads")
    assert not torch.equal(
        SelfSpeculative(model, heads=tmp_path / "heads").heads.heads["2"].up.weight, heads.heads["2"].up.weight
    )


def test_heads_that_must_move_are_copied_not_moved_under_another_wrapper(model):
    """Heads given as a module serve the model's dtype: a bfloat16 copy of the model gets its own copy of them,
    and the float32 wrapper that shares the caller's heads goes on as before."""
    import copy

    heads = ExitHeads(ModelAdapter(model).fingerprint(), [1, 2])
    prompt = random_prompt(8, seed=3)
    spec = SelfSpeculative(model, heads=heads, exit_layer=2, num_draft_tokens=3)
    low = SelfSpeculative(copy.deepcopy(model).to(torch.bfloat16), heads=heads, exit_layer=2, num_draft_tokens=3)
    assert spec.heads is heads and low.heads is not heads
    assert {p.dtype for p in heads.parameters()} == {torch.float32}
    assert {p.dtype for p in low.heads.parameters()} == {torch.bfloat16}
    expected = model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(spec.generate(prompt, max_new_tokens=12, do_sample=False), expected)


def test_heads_for_another_target_are_refused(model, tmp_path):
    trained_looking_heads(model).save_pretrained(tmp_path / "heads")
    other = tiny_model("llama", seed=4, num_layers=8, hidden=48)
    with pytest.raises(HeadsMismatchError, match="hidden_size=32.*hidden_size=48"):
        SelfSpeculative(other, heads=tmp_path / "heads")
    with pytest.raises(ValueError, match="trained for exit layers \\[2, 4\\]"):
        SelfSpeculative(model, heads=tmp_path / "heads", exit_layer=3)


def test_broken_heads_folders_are_refused(model, tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(f"No heads folder at {tmp_path / 'typo'}")):
        SelfSpeculative(model, heads=tmp_path / "typo")
    folder = tmp_path / "heads"
    trained_looking_heads(model).save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(HeadsMismatchError, match="cannot be read"):
        SelfSpeculative(model, heads=folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(HeadsMismatchError, match="no model.safetensors"):
        SelfSpeculative(model, heads=folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(HeadsMismatchError, match="no model.safetensors|not valid JSON"):
        SelfSpeculative(model, heads=folder)


def test_peft_lora_target_generates_exactly():
    base = tiny_model("llama", seed=6)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    peft_model = get_peft_model(base, lora).eval()
    prompt = random_prompt(8, seed=9)
    expected = peft_model.generate(input_ids=prompt, max_new_tokens=30, do_sample=False)
    spec = SelfSpeculative(peft_model, exit_layer=2, num_draft_tokens=4)
    assert torch.equal(spec.generate(prompt, max_new_tokens=30, do_sample=False), expected)
    # the LoRA layers are active in what selfspec runs: without them the output differs
    with peft_model.disable_adapter():
        assert not torch.equal(base.generate(prompt, max_new_tokens=30, do_sample=False), expected)


def test_peft_prompt_learning_is_refused():
    from peft import PromptTuningConfig

    peft_model = get_peft_model(tiny_model("llama"), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(UnsupportedModelError, match="PROMPT_TUNING"):
        SelfSpeculative(peft_model)


def test_stats_print_the_figures_people_look_at(model):
    stats = GenerationStats(new_tokens=12, target_passes=9, iterations=8, row_passes=9, proposed=10, accepted=4,
                            accepted_per_position=[3, 1], proposed_per_position=[6, 4], alpha=0.45,
                            draft_seconds=0.5, verify_seconds=1.0, total_seconds=2.0)  # fmt: skip
    assert str(stats) == (
        "12 new tokens in 2.00 s (6.0 tokens/s), 9 target passes (prefill + 8 iterations), 1.33 tokens per pass\n"
        "drafts: 4 of 10 accepted, alpha_hat 0.400 (accepted / proposed), alpha 0.450 (analytic: mean of sum_x "
        "min(p, q))\naccepted / proposed by draft position 1, 2, ...: 3/6, 1/4\n"
        "time: draft 0.50 s, verify 1.00 s, other 0.50 s"
    )
    assert repr(stats) == (
        "GenerationStats(new_tokens=12, target_passes=9, proposed=10, accepted=4, alpha_hat=0.400, alpha=0.450, "
        "tokens_per_pass=1.33, tokens_per_second=6.0)"
    )
    plain = SelfSpeculative(model, num_draft_tokens=0)
    plain.generate(random_prompt(4), max_new_tokens=5)
    assert str(plain.stats).splitlines()[1] == "drafts: none proposed (plain decoding steps only)"
    assert "5 new tokens" in str(plain.stats) and "1.00 tokens per pass" in str(plain.stats)
