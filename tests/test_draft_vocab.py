"""A reduced draft vocabulary: drafts come from a subset of the LM head's rows, output stays exact."""

from __future__ import annotations

import json

import pytest
import torch
from test_medusa import medusa_heads
from tiny_models import random_prompt, tiny_model

from selfspec import SelfSpeculative, frequent_tokens
from selfspec.adapter import ModelAdapter


@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
def test_greedy_with_a_reduced_or_int8_draft_head_matches_generate(arch, quant):
    model = tiny_model(arch)
    subset = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(0))[:40]
    prompt = random_prompt(6, seed=4)
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
    tree = [[0], [1], [0, 0], [0, 0, 0]]
    for options in ({"exit_layer": 2, "num_draft_tokens": 3, "draft_vocab": subset}, {"exit_layer": 1},
                    {"heads": medusa_heads(model), "tree": [], "draft_vocab": subset},
                    {"heads": medusa_heads(model), "tree": tree, "draft_vocab": subset}):  # fmt: skip
        spec = SelfSpeculative(model, draft_quant=quant, **options)
        if quant == "int8":
            assert spec.drafter.vocab.weight.dtype == torch.int8
        assert torch.equal(spec.generate(prompt, max_new_tokens=30, do_sample=False), expected), options
        assert spec.stats.proposed > 0


def test_drafts_stay_inside_the_draft_vocabulary():
    model = tiny_model("llama")
    subset = [3, 5, 7, 11, 13]
    spec = SelfSpeculative(model, exit_layer=2, num_draft_tokens=4, draft_vocab=subset)
    hidden = torch.randn(2, model.config.hidden_size)
    logits = spec.drafter.exit_logits(hidden)
    assert logits.shape == (2, model.config.vocab_size)
    outside = torch.ones(model.config.vocab_size, dtype=torch.bool)
    outside[subset] = False
    assert torch.isneginf(logits[:, outside]).all() and torch.isfinite(logits[:, ~outside]).all()
    full = SelfSpeculative(model, exit_layer=2).drafter.exit_logits(hidden)
    torch.testing.assert_close(logits[:, subset], full[:, subset])  # the same rows of the same LM head
    assert spec.draft_cost < SelfSpeculative(model, exit_layer=2).draft_cost


def test_draft_vocabulary_errors():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="token ids from 0 to 95"):
        SelfSpeculative(model, draft_vocab=[1, 96])
    with pytest.raises(ValueError, match="token ids from 0 to 95"):
        SelfSpeculative(model, draft_vocab=[])
    with pytest.raises(ValueError, match="apply to the shared LM head; these Medusa heads have their own"):
        SelfSpeculative(model, heads=medusa_heads(model, own_lm_head=True), draft_vocab=[1, 2])


def test_draft_vocab_from_a_json_file(tmp_path):
    model = tiny_model("llama")
    subset = [3, 5, 7, 11, 13]
    (tmp_path / "vocab.json").write_text(json.dumps(subset))
    assert ModelAdapter(model).draft_vocabulary(tmp_path / "vocab.json").ids.tolist() == subset
    prompt = random_prompt(5, seed=2)
    spec = SelfSpeculative(model, exit_layer=2, draft_vocab=str(tmp_path / "vocab.json"))  # a path, as the CLI takes
    assert torch.equal(spec.generate(prompt, max_new_tokens=12), model.generate(prompt, max_new_tokens=12))
    with pytest.raises(FileNotFoundError, match="draft_vocab: no file at .*missing.json"):
        SelfSpeculative(model, draft_vocab=tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"ids": [1, 2]}')
    with pytest.raises(ValueError, match="bad.json must hold one JSON list of integer token ids"):
        SelfSpeculative(model, draft_vocab=tmp_path / "bad.json")


def test_frequent_tokens():
    ids = torch.tensor([[5, 5, 5, 2, 2, 9], [5, 2, 1, 1, 1, 1]])
    assert frequent_tokens(ids, 2).tolist() == [1, 5]  # 1 (4 times) and 5 (4 times), sorted by id
    assert frequent_tokens(ids, 1, always=[9]).tolist() == [1, 9]
    assert frequent_tokens([ids[0], ids[1]], 3).tolist() == [1, 2, 5]


# ------------------------------------------------------------------------------ int8 draft LM head


def test_int8_draft_head_is_close_to_the_full_head_and_cheaper():
    model = tiny_model("llama")
    full = SelfSpeculative(model, exit_layer=2)
    int8 = SelfSpeculative(model, exit_layer=2, draft_quant="int8")
    hidden = torch.randn(3, model.config.hidden_size)
    exact, quantised = full.drafter.exit_logits(hidden), int8.drafter.exit_logits(hidden)
    assert not torch.equal(exact, quantised)  # the int8 path is the one taken
    error = (exact - quantised).abs().max() / exact.abs().max()
    assert error < 0.02, f"int8 logits off by {error:.3%} of their range"
    assert int8.draft_cost < full.draft_cost


def test_int8_draft_head_errors():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="draft_quant must be None or 'int8', got 'int4'"):
        SelfSpeculative(model, draft_quant="int4")
    with pytest.raises(ValueError, match="draft_vocab and draft_quant apply to the shared LM head"):
        SelfSpeculative(model, heads=medusa_heads(model, own_lm_head=True), draft_quant="int8")


def test_profile_reports_the_alpha_and_c_of_a_draft_head():
    from selfspec.adapter import ModelAdapter
    from selfspec.heads import ExitHeads
    from selfspec.measure.profile import format_table, profile_heads
    from selfspec.training.config import EvalConfig

    model = tiny_model("llama")
    adapter = ModelAdapter(model)
    heads = ExitHeads(adapter.fingerprint(), [1, 2])
    rows = torch.randint(0, model.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
    config = EvalConfig(max_rows=4, batch_size=2, timing_context=8, timing_repeats=2, max_gamma=2)
    every = profile_heads(model, heads, rows, config, vocab=adapter.draft_vocabulary(range(model.config.vocab_size)))
    for row in every:  # all rows of the head, unquantised: the same q as the model's own head
        assert row["draft_alpha"] == pytest.approx(row["alpha"], abs=1e-6) and row["draft_top1"] == row["top1"]
    int8 = profile_heads(model, heads, rows, config, vocab=adapter.draft_vocabulary(None, "int8"))
    for row in int8:
        assert row["draft_alpha"] != row["alpha"] and abs(row["draft_alpha"] - row["alpha"]) < 0.02, row
        assert row["draft_c"] > 0
    assert "alpha, draft head" in format_table(int8) and "c, draft head" in format_table(int8)
