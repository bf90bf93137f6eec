"""The low-overhead loop: processors applied once where they allow it, greedy without softmaxes, commit on the
host, and the position cost r per batch size (no timings are asserted)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import padded_prompts, random_prompt, tiny_model
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from selfspec import SelfSpeculative
from selfspec.engine.adaptive import DraftController, check_position_cost, position_cost_at, position_cost_from
from selfspec.engine.call import GREEDY_ALPHA_EVERY
from selfspec.engine.generation import process_scores, row_wise
from selfspec.measure.tune import fit_position_costs, time_batched_passes


def per_position(processors, prefix, tokens, logits):
    """The reference: every position processed alone with its own input ids."""
    return torch.stack(
        [processors(torch.cat([prefix, tokens[:, :i]], dim=1), logits[:, i].clone()) for i in range(logits.shape[1])],
        dim=1,
    )


def test_row_wise_processors_process_all_positions_in_one_call_with_the_same_scores():
    torch.manual_seed(0)
    prefix, tokens, logits = torch.randint(0, 50, (2, 7)), torch.randint(0, 50, (2, 3)), torch.randn(2, 4, 50)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.9)])
    assert row_wise(warpers)
    assert torch.equal(process_scores(warpers, prefix, tokens, logits), per_position(warpers, prefix, tokens, logits))
    # a processor that reads the input ids (their length here) keeps the per-position path
    reading = LogitsProcessorList([MinLengthLogitsProcessor(10, eos_token_id=3), TemperatureLogitsWarper(0.7)])
    assert not row_wise(reading)
    processed = process_scores(reading, prefix, tokens, logits)
    assert torch.equal(processed, per_position(reading, prefix, tokens, logits))
    assert processed[:, :3, 3].isinf().all() and processed[:, 3, 3].isfinite().all()  # length 10 reached at i = 3


def test_greedy_tallies_alpha_on_some_iterations_and_stays_exact():
    model = tiny_model("llama")
    prompt = random_prompt(8, seed=4)
    spec = SelfSpeculative(model, exit_layer=2, num_draft_tokens=3)
    softmaxes = []
    real = torch.Tensor.softmax

    def counted(self, *args, **kwargs):
        if self.shape[-1] == model.config.vocab_size:  # not the attention's
            softmaxes.append(self.shape)
        return real(self, *args, **kwargs)

    torch.Tensor.softmax = counted
    try:
        out = spec.generate(prompt, max_new_tokens=40, do_sample=False)
    finally:
        torch.Tensor.softmax = real
    assert torch.equal(out, model.generate(prompt, max_new_tokens=40, do_sample=False))
    drafting = spec.stats.iterations  # every iteration drafts (fixed gamma)
    due = -(-drafting // GREEDY_ALPHA_EVERY)  # the first, then one in GREEDY_ALPHA_EVERY
    assert len(softmaxes) == 2 * due, softmaxes  # p and q of the iterations whose alpha is tallied, nothing else
    assert 0.0 <= spec.stats.alpha <= 1.0


def test_commit_stops_at_eos_inside_the_accepted_drafts():
    model = tiny_model("llama")
    prompt = random_prompt(8, seed=4)
    reference = model.generate(prompt, max_new_tokens=30, do_sample=False)
    eos = int(reference[0, 8 + 11])  # the 12th new token: EOS from here on
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=0)
    for gamma in (1, 3, 4):
        spec = SelfSpeculative(model, exit_layer=3, num_draft_tokens=gamma)
        out = spec.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(out, expected) and int(out[0, -1]) == eos


def test_position_cost_per_batch_size_is_fitted_from_pass_times():
    # passes that cost t0 (1 + r rows positions) with r per batch size: the fit recovers each r
    truth = {1: 0.08, 4: 0.02, 16: 0.003, 64: 0.0005}
    times = {
        (rows, positions): 0.01 * rows**0.5 * (1 + r * rows * positions)
        for rows, r in truth.items()
        for positions in range(1, 6)
    }
    fitted = fit_position_costs(times)
    assert fitted.keys() == truth.keys()
    for rows, r in truth.items():
        assert fitted[rows] == pytest.approx(r)
    assert position_cost_from(1.2, 1, rows=4) == pytest.approx(0.25 / 4)


def test_batch_sizes_keep_drafting_where_verification_is_nearly_free():
    per_size = {1: 0.054, 16: 0.001, 64: 0.0002}  # GPU-like: wide batches verify extra positions almost for free
    single = DraftController(max_drafts=4, draft_cost=0.02, position_cost=per_size[1])
    fitted = DraftController(max_drafts=4, draft_cost=0.02, position_cost=per_size)
    for controller in (single, fitted):
        for outcome in [0, 1, 2, 3] * 5:
            controller.update(3, [outcome])
    assert single.choose(4, 64) == 0  # the batch-1 r extrapolated to 64 rows starves drafting
    assert fitted.choose(4, 64) >= 2 and fitted.choose(4, 1) == single.choose(4, 1) >= 1
    assert position_cost_at(per_size, 40) == pytest.approx(0.001 + (0.0002 - 0.001) * 24 / 48)
    assert position_cost_at(per_size, 128) == 0.0002 and position_cost_at(0.1, 64) == 0.1


def test_position_costs_are_checked_and_read_from_json_keys():
    assert check_position_cost({"16": 0.01, "1": 0.05}) == {1: 0.05, 16: 0.01}
    assert check_position_cost(0) == 0.0
    for bad in (-1, {1: -0.1}, {}, {"x": 0.1}, True, "0.1"):
        with pytest.raises(ValueError, match="position_cost="):
            check_position_cost(bad)


def test_batched_generation_with_per_size_position_costs_stays_exact():
    model = tiny_model("llama")
    ids, mask = padded_prompts([4, 9, 6, 7], seed=3)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    spec = SelfSpeculative(model, exit_layer=3, position_cost={1: 0.3, 4: 0.01})
    assert torch.equal(spec.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False), expected)


def test_batched_pass_times_cover_every_size_and_width():
    from selfspec.adapter import ModelAdapter

    adapter = ModelAdapter(tiny_model("llama"))
    times = time_batched_passes(adapter, random_prompt(12, seed=1), (1, 3), max_gamma=2, repeats=1)
    assert sorted(times) == [(rows, positions) for rows in (1, 3) for positions in (1, 2, 3)]
    assert all(seconds > 0 for seconds in times.values())
    assert sorted(fit_position_costs(times)) == [1, 3]
    modeled = {(rows, n): 1 + {1: 0.05, 3: 0.02}[rows] * rows * n for rows in (1, 3) for n in (1, 2, 3)}  # known r
    assert fit_position_costs(modeled) == pytest.approx({1: 0.05, 3: 0.02})
