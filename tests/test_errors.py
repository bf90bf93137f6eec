"""Errors that name the problem and say what to do: float token ids, a padded batch without its attention mask, a
model folder given as heads, a draft vocabulary made for another target, a hybrid without heads; and what
`spec.drafter` shows of a hybrid."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_prompt, tiny_model

from selfspec import EarlyExitDrafter, ExitHeads, HeadsMismatchError, NGramDrafter, SelfSpeculative
from selfspec.adapter import ModelAdapter


def test_float_token_ids_are_refused_by_name():
    spec = SelfSpeculative(tiny_model("llama"), drafter="ngram")
    with pytest.raises(TypeError, match=r"token ids must be integers; got a tensor of dtype torch.float32"):
        spec.generate(random_prompt(5).float(), max_new_tokens=4)


def test_a_padded_batch_without_its_mask_is_refused_and_an_unpadded_one_runs():
    model = tiny_model("llama")
    spec = SelfSpeculative(model, drafter="ngram")
    padded = torch.cat(
        [random_prompt(6, seed=1), torch.cat([torch.zeros(1, 2, dtype=torch.long), random_prompt(4)], 1)]
    )
    with pytest.raises(ValueError, match=r"without attention_mask, and row\(s\) \[1\] start with the pad token 0"):
        spec.generate(padded, max_new_tokens=4)
    unpadded = torch.cat([random_prompt(6, seed=1), random_prompt(6, seed=2)])  # no row starts with the pad token
    expected = model.generate(unpadded, attention_mask=torch.ones_like(unpadded), max_new_tokens=8, do_sample=False)
    assert torch.equal(spec.generate(unpadded, max_new_tokens=8, do_sample=False), expected)


def test_a_model_folder_given_as_heads_is_named(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "model")
    with pytest.raises(HeadsMismatchError, match=r"is a model folder \(model_type 'llama'\), not a heads folder"):
        SelfSpeculative(model, heads=tmp_path / "model")


def test_a_draft_vocabulary_of_another_target_is_named():
    model = tiny_model("llama")  # 96 tokens
    with pytest.raises(
        ValueError, match=r"lists ids from 0 to 8191, and this model takes token ids from 0 to 95: it was made for"
    ):
        SelfSpeculative(model, exit_layer=2, draft_vocab=list(range(8192)))


def test_a_hybrid_without_heads_drafts_with_ngram_lookup_and_says_so():
    model = tiny_model("llama")
    with pytest.warns(UserWarning, match="drafter='hybrid' without heads: drafting with n-gram lookup alone"):
        spec = SelfSpeculative(model, drafter="hybrid")
    assert [part.name for part in spec.drafters] == ["ngram"] and "ngram" in repr(spec)
    assert [part.name for part in SelfSpeculative(model, drafter="hybrid", exit_layer=2).drafters] == [
        "ngram",
        "exit 2",
    ]


def test_drafter_and_drafters_show_every_drafter_in_use():
    """`spec.drafters` is the tuple of every drafter; `spec.drafter` is the drafter where there is one, and all of
    them in a hybrid (never its last drafter as if it drafted alone)."""
    model = tiny_model("llama")
    heads = ExitHeads(ModelAdapter(model).fingerprint(), [2])
    hybrid = SelfSpeculative(model, drafter="hybrid", heads=heads)
    assert isinstance(hybrid.drafters, tuple)
    assert [type(part) for part in hybrid.drafters] == [NGramDrafter, EarlyExitDrafter]
    assert hybrid.drafter is hybrid.drafters
    assert repr(hybrid.drafter) == "Drafters('ngram', 'exit 2')"
    assert "drafters=Drafters('ngram', 'exit 2')" in repr(hybrid)
    with pytest.raises(AttributeError, match=r"are 2 drafters, each with its own 'tree'.*spec\.drafters\[1\]\.tree"):
        hybrid.drafter.tree  # noqa: B018
    single = SelfSpeculative(model, heads=heads)
    assert isinstance(single.drafter, EarlyExitDrafter) and single.drafters == (single.drafter,)
    assert repr(single.drafters) == "Drafters('exit 2')"
