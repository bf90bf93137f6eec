"""Batches of prompts of different lengths (left-padded, with an attention mask): exact per row."""

from __future__ import annotations

import pytest
import torch
from test_medusa import medusa_heads
from tiny_models import ARCHITECTURES, padded_prompts, tiny_model

from selfspec import SelfSpeculative, UnsupportedGenerationArgument

PAD = 0


def assert_rows_exact(model, spec, lengths, seed=0, alone=True, **kwargs):
    ids, mask = padded_prompts(lengths, seed)
    kwargs = dict(max_new_tokens=30, do_sample=False, pad_token_id=PAD, **kwargs)
    expected = model.generate(ids, attention_mask=mask, **kwargs)
    actual = spec.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(actual, expected), f"{model.config.model_type} {lengths}"
    for row, length in enumerate(lengths if alone else []):  # and each row as if generated alone
        alone = model.generate(ids[row : row + 1, ids.shape[1] - length :], **kwargs)[0]
        generated = actual[row, ids.shape[1] :]
        assert torch.equal(generated[: alone.shape[0] - length], alone[length:])
        assert bool((generated[alone.shape[0] - length :] == PAD).all())  # finished early: padded
    return spec.stats


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model(request):
    return tiny_model(request.param)


BATCHES = [[3, 9], [1, 14, 6, 6], [5, 2, 11, 1, 8, 3, 7, 4]]  # batch sizes 2, 4 and 8


def test_batched_greedy_matches_generate_per_row(model):
    for lengths, gamma in zip(BATCHES, (2, 4, 3), strict=True):
        stats = assert_rows_exact(model, SelfSpeculative(model, exit_layer=2, num_draft_tokens=gamma), lengths)
        assert stats.new_tokens == 30 * len(lengths)
        # every token a row gained was an accepted draft or the one token of a pass that served the row
        assert stats.new_tokens == stats.accepted + stats.row_passes


def test_rows_finish_at_different_steps(model):
    ids, mask = padded_prompts(BATCHES[1], seed=5)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=PAD)
    # an EOS id that row 0 produces early; other rows stop elsewhere or run to the budget
    eos = int(free[0, ids.shape[1] + 4])
    spec = SelfSpeculative(model, exit_layer=1, num_draft_tokens=4)
    stats = assert_rows_exact(model, spec, BATCHES[1], seed=5, eos_token_id=eos)
    assert stats.new_tokens < 30 * len(BATCHES[1])


def test_batched_medusa_chain(model):
    spec = SelfSpeculative(model, heads=medusa_heads(model, num_heads=3), num_draft_tokens=3)
    assert_rows_exact(model, spec, BATCHES[1], seed=9)


def test_batch_with_processors_sees_each_row_as_generate_does():
    model = tiny_model("llama", seed=2)
    spec = SelfSpeculative(model, exit_layer=1, num_draft_tokens=4)
    # equal to the padded batch; not compared with each row alone: before transformers 5.24 the repetition
    # penalty also counts the padding token of padded rows, so model.generate itself differs there
    assert_rows_exact(model, spec, BATCHES[2], seed=3, alone=False, repetition_penalty=1.4, no_repeat_ngram_size=3)


@pytest.mark.parametrize("extra", [{"repetition_penalty": 1.3}, {"encoder_repetition_penalty": 1.5}])
def test_processors_with_per_row_state_after_rows_leave_the_batch(extra):
    """Rows that finish leave the batch; the rest are processed by their own processors (a repetition penalty's
    prompt length to skip, an encoder penalty's prompt), not by the whole batch's, which raised."""
    model = tiny_model("llama")
    ids, mask = padded_prompts([5, 9, 3], seed=1)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=PAD, **extra)
    eos = int(free[0, ids.shape[1] + 4])  # row 0 ends early; the others go on
    spec = SelfSpeculative(model, exit_layer=2, position_cost=0.0)
    stats = assert_rows_exact(model, spec, [5, 9, 3], seed=1, alone=False, eos_token_id=eos, **extra)
    assert stats.new_tokens < 20 * 3


@pytest.mark.parametrize("drafter", [{"exit_layer": 2, "num_draft_tokens": 3}, {"drafter": "ngram"}])
def test_without_an_eos_a_stopped_row_goes_on_until_every_row_has_stopped(drafter):
    """`generate` pads a row stopped by a stopping criterion only when there is an end-of-sequence token;
    without one the row goes on, unpadded, until every row has stopped, and each row has as many new tokens as
    the last one to stop."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    model = tiny_model("llama")  # no end-of-sequence token
    ids, mask = padded_prompts([5, 9], seed=0)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    rows = free[:, ids.shape[1] :].tolist()
    # a token that stops row 1 early and that row 0 does not make, then one that stops row 0 later
    early = next(k for k in range(3, 10) if rows[1][k] not in rows[1][:k] and rows[1][k] not in rows[0][:20])
    late = next(k for k in range(10, 20) if rows[0][k] not in rows[0][:k] and rows[0][k] not in rows[1][:early])
    stop_tokens = {rows[1][early], rows[0][late]}

    class StopAt(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.isin(input_ids[:, -1], torch.tensor(sorted(stop_tokens)))

    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    criteria = StoppingCriteriaList([StopAt()])
    expected = model.generate(ids, stopping_criteria=criteria, **kwargs)
    assert expected.shape[1] == ids.shape[1] + late + 1  # both rows run to row 0's stop, row 1 unpadded
    assert torch.equal(expected, free[:, : expected.shape[1]])
    spec = SelfSpeculative(model, **drafter)
    assert torch.equal(spec.generate(ids, stopping_criteria=criteria, **kwargs), expected)
    assert spec.stats.new_tokens == 2 * (expected.shape[1] - ids.shape[1])


def test_a_criterion_that_declares_an_eos_token_pads_the_rows_it_stops():
    """`generate` pads stopped rows where a stopping criterion has an `eos_token_id`, though the config has none;
    criteria that would replace generate's own length or end-of-sequence criterion are refused."""
    from transformers import StoppingCriteriaList
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    model = tiny_model("llama")  # no end-of-sequence token
    ids, mask = padded_prompts([4, 7, 5], seed=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=PAD)
    criteria = StoppingCriteriaList([EosTokenCriteria(eos_token_id=37)])
    expected = model.generate(ids, stopping_criteria=criteria, **kwargs)
    assert bool((expected[:, ids.shape[1] :] == 37).any()) and bool((expected[:, -1] == PAD).any())  # a row stopped
    spec = SelfSpeculative(model, exit_layer=2, num_draft_tokens=3)
    assert torch.equal(spec.generate(ids, stopping_criteria=criteria, **kwargs), expected)
    with pytest.raises(UnsupportedGenerationArgument, match="would replace generate's own end-of-sequence"):
        spec.generate(ids, stopping_criteria=criteria, eos_token_id=13, **kwargs)
    with pytest.raises(UnsupportedGenerationArgument, match="pass max_new_tokens= or max_length= instead"):
        spec.generate(ids, stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(30)]), **kwargs)


def test_batch_limits_are_explicit():
    model = tiny_model("llama")
    ids, mask = padded_prompts([3, 5])
    tree_spec = SelfSpeculative(model, heads=medusa_heads(model, num_heads=2), tree=[[0], [0, 0]], adaptive=False)
    with pytest.raises(UnsupportedGenerationArgument, match="one prompt at a time"):
        tree_spec.generate(ids, attention_mask=mask, max_new_tokens=5)

    class Collect:
        def put(self, value):
            pass

        def end(self):
            pass

    with pytest.raises(UnsupportedGenerationArgument, match="streamer"):
        SelfSpeculative(model).generate(ids, attention_mask=mask, max_new_tokens=5, streamer=Collect())


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_a_batch_that_could_cross_a_longrope_switch_is_refused(arch):
    """generate moves every row of a batch to longrope's long frequencies at one step, when its least padded row
    reaches the switch (and Phi3's recomputes the cache then), whatever each row's own position: rows that accept
    different numbers of drafts cannot follow it, and such batches used to leave generate's output. Batches that
    stay before the switch, or start past it, are exact; the others are refused."""
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * 4,
        "long_factor": [8.0, 16.0, 32.0, 64.0],
        "original_max_position_embeddings": 24,
    }
    model = tiny_model(arch, rope_parameters=rope, original_max_position_embeddings=24)
    spec = SelfSpeculative(model, exit_layer=3, num_draft_tokens=4)
    for lengths, new in [([10, 4], 15), ([30, 26], 30)]:  # positions up to 23; every row's from 26 on
        ids, mask = padded_prompts(lengths, seed=5)
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        assert torch.equal(spec.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False), expected)
    for lengths, seed in [([10, 4], 5), ([20, 6], 6), ([4, 12], 6), ([30, 10], 0)]:
        ids, mask = padded_prompts(lengths, seed)
        with pytest.raises(UnsupportedGenerationArgument, match="crosses the longrope switch"):
            spec.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
