"""A reduced draft vocabulary: drafts come from a subset of the LM head's rows, output stays exact."""

from __future__ import annotations

import pytest
import torch
from test_medusa import medusa_heads
from tiny_models import random_prompt, tiny_model

from selfspec import SelfSpeculative, frequent_tokens


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
def test_greedy_with_a_draft_vocabulary_matches_generate(arch):
    model = tiny_model(arch)
    subset = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(0))[:40]
    prompt = random_prompt(6, seed=4)
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
    for options in ({"exit_layer": 2, "num_draft_tokens": 3}, {"heads": medusa_heads(model), "tree": []},
                    {"heads": medusa_heads(model), "tree": [[0], [1], [0, 0], [0, 0, 0]]}):  # fmt: skip
        spec = SelfSpeculative(model, draft_vocab=subset, **options)
        assert torch.equal(spec.generate(prompt, max_new_tokens=30, do_sample=False), expected), options


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
    with pytest.raises(ValueError, match="their own LM heads"):
        SelfSpeculative(model, heads=medusa_heads(model, own_lm_head=True), draft_vocab=[1, 2])


def test_frequent_tokens():
    ids = torch.tensor([[5, 5, 5, 2, 2, 9], [5, 2, 1, 1, 1, 1]])
    assert frequent_tokens(ids, 2).tolist() == [1, 5]  # 1 (4 times) and 5 (4 times), sorted by id
    assert frequent_tokens(ids, 1, always=[9]).tolist() == [1, 9]
    assert frequent_tokens([ids[0], ids[1]], 3).tolist() == [1, 2, 5]
