"""Greedy self-speculative output is token-identical to `model.generate(do_sample=False)`.

Every supported family, exit layers 1..3 of 4, num_draft_tokens 1..8, prompts of 1 to 50 tokens, and
40 new tokens: well past the sliding window (8) of Qwen2, Mistral, Phi3 and Gemma2.
"""

from __future__ import annotations

import pytest
import torch
from test_eagle import eagle_heads
from tiny_models import ARCHITECTURES, random_prompt, tiny_model

from selfspec import SelfSpeculative

PROMPT_LENGTHS = [1, 5, 17, 50]
# (exit_layer, num_draft_tokens, prompt_length): every gamma 1..8, every exit layer, every prompt length
GRID = [(1 + g % 3, g, PROMPT_LENGTHS[g % 4]) for g in range(1, 9)] + [
    (1 + g % 3, g, PROMPT_LENGTHS[(g + 2) % 4]) for g in range(1, 9)
]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model(request):
    return tiny_model(request.param)


def test_greedy_matches_generate(model):
    for exit_layer, gamma, prompt_length in GRID:
        prompt = random_prompt(prompt_length, seed=prompt_length + gamma)
        expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
        spec = SelfSpeculative(model, exit_layer=exit_layer, num_draft_tokens=gamma)
        actual = spec.generate(prompt, max_new_tokens=40, do_sample=False)
        assert torch.equal(actual, expected), (
            f"{model.config.model_type}: exit_layer={exit_layer} gamma={gamma} prompt={prompt_length}\n"
            f"expected {expected[0, prompt_length:].tolist()}\nactual   {actual[0, prompt_length:].tolist()}"
        )
        assert spec.stats.new_tokens == 40


def test_plain_loop_matches_generate(model):
    """num_draft_tokens=0 is plain decoding through selfspec's loop: one full pass per token, no drafts."""
    prompt = random_prompt(7, seed=11)
    expected = model.generate(prompt, max_new_tokens=25, do_sample=False)
    spec = SelfSpeculative(model, num_draft_tokens=0)
    assert torch.equal(spec.generate(prompt, max_new_tokens=25, do_sample=False), expected)
    assert (spec.stats.proposed, spec.stats.target_passes, spec.stats.new_tokens) == (0, 25, 25)


def test_each_layer_processes_each_position_once(model):
    """KV reuse: the verify pass runs the lower layers only for the position the draft has not seen,
    so every layer processes the prompt plus (gamma + 1) positions per iteration, lower and upper alike
    (re-running the lower layers, as transformers' early exit does, would make it 2 gamma + 1)."""
    positions = [0] * len(model.base_model.layers if hasattr(model.base_model, "layers") else model.base_model.h)
    handles = []
    layers = model.base_model.layers if hasattr(model.base_model, "layers") else model.base_model.h
    for index, layer in enumerate(layers):
        first = next(m for m in layer.modules() if len(list(m.parameters(recurse=False))) > 0)

        def count(module, args, index=index):
            positions[index] += args[0].shape[-2]

        handles.append(first.register_forward_pre_hook(count))
    try:
        spec = SelfSpeculative(model, exit_layer=2, num_draft_tokens=4)
        prompt = random_prompt(9, seed=3)
        spec.generate(prompt, max_new_tokens=30, do_sample=False)
    finally:
        for handle in handles:
            handle.remove()
    stats = spec.stats
    assert stats.iterations > 0 and stats.proposed > 0
    expected = prompt.shape[1] + stats.proposed + stats.iterations
    assert positions == [expected] * len(layers)


def test_greedy_with_processors_matches_generate(model):
    """Processors that read the prefix (repetition penalty, no-repeat n-grams) see the drafted prefix."""
    prompt = random_prompt(12, seed=7)
    kwargs = dict(max_new_tokens=30, do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=3)
    expected = model.generate(prompt, **kwargs)
    actual = SelfSpeculative(model, exit_layer=2, num_draft_tokens=5).generate(prompt, **kwargs)
    assert torch.equal(actual, expected)


LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0] * 4,  # head_dim 8
    "long_factor": [8.0, 16.0, 32.0, 64.0],
    "original_max_position_embeddings": 24,
}


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_longrope_switch_is_crossed_as_generate_crosses_it(arch):
    """Longrope picks long frequencies for a whole forward once any position reaches
    original_max_position_embeddings; plain decoding computes the positions before it with short ones, so a verify
    pass never straddles it. Phi3's generate also drops its cache there and recomputes every position with the long
    frequencies: the answer after the switch attends to past keys rotated by them. Prompts end before the switch,
    on it and past it; chains of the exit drafter (which reuses its lower-layer entries) and n-gram lookup, and an
    EAGLE dynamic tree."""
    # Phi3's config field overrides the rope parameters' original_max_position_embeddings
    model = tiny_model(arch, rope_parameters=dict(LONGROPE), original_max_position_embeddings=24)
    assert model.config.rope_parameters["original_max_position_embeddings"] == 24
    options = [
        {"exit_layer": 1, "num_draft_tokens": 6},
        {"drafter": "ngram"},
        {"heads": eagle_heads(model), "tree": {"nodes": 8, "top_k": 3, "depth": 4}, "adaptive": False},
    ]
    for seed, length in [(0, 10), (1, 24), (2, 30)]:
        prompt = random_prompt(length, seed=seed)
        expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
        for settings in options:
            actual = SelfSpeculative(model, **settings).generate(prompt, max_new_tokens=30, do_sample=False)
            assert torch.equal(actual, expected), (seed, length, settings)
