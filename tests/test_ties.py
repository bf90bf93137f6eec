"""Half-precision greedy comparison: a divergence counts as a tie only where the output took a token whose
reference score is within TIE_STEPS rounding steps of the model's dtype of the best."""

from __future__ import annotations

import math

import torch
from tiny_models import random_prompt, tiny_model

from selfspec.measure.ties import TIE, compare_greedy, first_divergence, rounding_step


def test_first_divergence_and_rounding_step():
    a = torch.tensor([[1, 2, 3, 4]])
    assert first_divergence(a, a.clone()) is None
    assert first_divergence(a, torch.tensor([[1, 2, 9, 4]])) == 2
    assert first_divergence(a, torch.tensor([[1, 2, 3]])) == 3
    assert rounding_step(30.0, torch.bfloat16) == 0.125 and rounding_step(-1.5, torch.bfloat16) == 2**-7
    assert rounding_step(30.0, torch.float16) == 2**-6


def tied_model(prompt: torch.Tensor):
    """A bfloat16 tiny model whose first greedy token after `prompt` has a twin: another LM-head row made
    equal to its row, so the two tie exactly there. Returns the model and the pair."""
    model = tiny_model("llama")
    with torch.no_grad():
        first = int(model(prompt).logits[0, -1].argmax())
        twin = (first + 1) % model.config.vocab_size
        head = model.get_output_embeddings().weight
        head[twin] = head[first]
    return model.to(torch.bfloat16), {first, twin}


def test_a_divergence_at_a_tie_is_a_tie_and_any_other_is_not():
    prompt = random_prompt(6)
    model, pair = tied_model(prompt)
    reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    assert int(reference[0, 6]) in pair
    other = reference.clone()
    other[0, 6] = (pair - {int(reference[0, 6])}).pop()  # the other token of the tied pair
    assert compare_greedy(model, prompt, reference, reference.clone()) is True
    assert compare_greedy(model, prompt, reference, other) == TIE
    wrong = reference.clone()
    wrong[0, 6] = min(set(range(3, 20)) - pair)  # a token far from the best score
    assert compare_greedy(model, prompt, reference, wrong) is False
    assert compare_greedy(model.float(), prompt, reference, other) is False  # float32: no tie rule


def test_gap_shifts_measure_each_new_position(monkeypatch):
    from types import SimpleNamespace

    from selfspec.measure import ties

    model, prompt = tiny_model("llama").to(torch.bfloat16), random_prompt(7)
    base = ties.gap_shifts(model, prompt, max_new_tokens=6)
    assert len(base) == 6 and all(math.isfinite(shift) for shift in base)
    out = ties.greedy_with_scores(model, prompt, 6)
    single = out.scores[2][0].float()
    first = int(single.argmax())
    step = ties.rounding_step(float(single[first]), torch.bfloat16)

    class Moved:  # one pass over the answer that moves the third new position's best score up 3 rounding steps
        dtype = model.dtype

        def __call__(self, ids):
            logits = model(ids).logits.float()
            logits[0, prompt.shape[1] + 1, first] += 3 * step
            return SimpleNamespace(logits=logits)

    monkeypatch.setattr(ties, "greedy_with_scores", lambda *args: out)
    moved = ties.gap_shifts(Moved(), prompt, max_new_tokens=6)
    assert abs(moved[2] - 3.0) <= base[2] + 1e-6  # 3 steps on top of what the pass moved already
    assert moved[:2] + moved[3:] == base[:2] + base[3:]
