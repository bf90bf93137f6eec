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


def test_pad_tokens_without_a_mask_are_masked_as_generate_masks_them():
    """Without `attention_mask`, `generate` masks the prompts' pad tokens (where the pad token is not the EOS token):
    left padding then generates as `generate` does, alone and in a batch; a pad token after the text is refused."""
    model = tiny_model("llama")  # pad token 0, no EOS token
    spec = SelfSpeculative(model, drafter="ngram")
    padded = torch.cat(
        [random_prompt(6, seed=1), torch.cat([torch.zeros(1, 2, dtype=torch.long), random_prompt(4)], 1)]
    )
    for prompts in (padded, padded[1:], torch.cat([random_prompt(6, seed=1), random_prompt(6, seed=2)])):
        expected = model.generate(prompts, max_new_tokens=8, do_sample=False)
        assert torch.equal(spec.generate(prompts, max_new_tokens=8, do_sample=False), expected)
    inside = random_prompt(6, seed=1)
    inside[0, 3] = 0
    with pytest.raises(ValueError, match="holds the pad token 0 after its text, and no attention_mask was given"):
        spec.generate(inside, max_new_tokens=4)


def test_without_a_length_the_default_stops_at_the_models_last_position():
    model = tiny_model("llama")
    model.config.max_position_embeddings = 64
    prompt = random_prompt(55)
    expected = model.generate(prompt, do_sample=False)  # 20 new tokens by default, but only up to position 64
    assert expected.shape == (1, 64)
    assert torch.equal(SelfSpeculative(model, drafter="ngram").generate(prompt, do_sample=False), expected)


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
