"""compile=True (selfspec/adapter/static.py): the target's passes run through torch.compile (inductor's C++ backend
here) over a static cache that rolls back by moving its write pointer. Greedy output stays token-identical to
`model.generate` in float32, sampling stays distributed as the target's law, and what it cannot run is refused."""

from __future__ import annotations

import pytest
import torch
from test_eagle import eagle_heads, trained  # noqa: F401 (a fixture)
from test_medusa import medusa_heads
from test_sampling_exactness import PROMPT, VOCAB, chi_square_pvalue, exact_law, sampled_counts
from tiny_models import random_prompt, tiny_model

from selfspec import Drafter, SelfSpeculative
from selfspec.adapter import UnsupportedModelError, static
from selfspec.adapter.static import ROOM
from selfspec.engine.generation import UnsupportedGenerationArgument


def repetitive_prompt(prompts: torch.Tensor, rows=(0, 1)) -> torch.Tensor:
    """Two of the fixture's prompts, repeated: n-gram lookup finds matches in it."""
    return torch.cat([prompts[rows[0]], prompts[rows[1]], prompts[rows[0]], prompts[rows[1]]])[None]


def assert_exact(model, spec: SelfSpeculative, prompt: torch.Tensor, max_new_tokens: int = 30) -> None:
    expected = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
    actual = spec.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
    assert torch.equal(actual, expected), spec


def test_greedy_is_token_identical_with_every_chain_drafter(trained):  # noqa: F811
    """A fitted EAGLE head (drafts often accepted: rollbacks of every length), n-gram lookup, their hybrid and a
    Medusa chain, fixed and adaptive gamma, on several prompts; two generate calls reuse one cache."""
    model, heads, prompts = trained
    medusa = medusa_heads(model, num_heads=3)
    specs = [
        SelfSpeculative(model, heads=heads, num_draft_tokens=3, compile=True),
        SelfSpeculative(model, heads=heads, compile=True),  # adaptive: gamma changes, one graph serves it
        SelfSpeculative(model, drafter="ngram", compile=True),
        SelfSpeculative(model, heads=heads, drafter="hybrid", compile=True),
        SelfSpeculative(model, heads=medusa, tree=[], num_draft_tokens=3, compile=True),
        SelfSpeculative(model, num_draft_tokens=0, compile=True),  # plain decoding through the loop
    ]
    for spec in specs:
        for rows in ((0, 1), (2, 5)):
            assert_exact(model, spec, repetitive_prompt(prompts, rows))
    assert specs[0].stats.accepted > 0
    assert specs[2].stats.accepted > 0  # n-gram drafts of several tokens were verified and accepted
    assert specs[0].adapter.new_cache(10) is specs[0].adapter.new_cache(ROOM)  # one cache, reset between calls


def test_a_call_longer_than_the_cache_gets_a_larger_one():
    model = tiny_model("llama")
    spec = SelfSpeculative(model, drafter="ngram", compile=True)
    short = spec.adapter.new_cache(20)
    prompt = random_prompt(ROOM - 20, seed=3)
    assert_exact(model, spec, prompt, max_new_tokens=40)  # prompt + new tokens > ROOM positions
    assert spec.adapter.new_cache(ROOM + 1) is not short


def test_caches_of_many_sizes_share_the_graphs_without_hitting_the_recompile_limit(monkeypatch):
    """Ten cache sizes on one model (more than torch.compile's 8 recompilations, a hard error with whole graphs):
    the one-position graph makes the cache length dynamic after the second size, and a growing cache doubles."""
    monkeypatch.setattr(static, "ROOM", 16)
    model = tiny_model("llama", seed=5)
    for length in range(4, 164, 16):  # capacities 16, 32, ..., 160 positions: a new size each time
        spec = SelfSpeculative(model, drafter="ngram", compile=True)  # a new adapter: its cache is sized anew
        assert_exact(model, spec, random_prompt(length, seed=length), max_new_tokens=6)
    size = spec.adapter.new_cache(1).layers[0].max_cache_len
    grown = spec.adapter.new_cache(size + 1)
    assert grown.layers[0].max_cache_len == 2 * size  # doubled, not just rounded up
    assert_exact(model, spec, random_prompt(7), max_new_tokens=6)  # allocates the grown cache in float32
    assert spec.adapter.new_cache(10) is grown  # reused while it fits
    model.to(torch.float64)  # a cache allocated in float32 no longer fits the model: a new one
    assert spec.adapter.new_cache(10) is not grown


@pytest.mark.parametrize("arch", ["gpt2", "gemma"])
def test_other_families_are_token_identical(arch):
    """GPT-2 (learned positions, Conv1D attention) and Gemma (scaled embeddings), with n-gram lookup and EAGLE."""
    model = tiny_model(arch)
    prompt = torch.cat([random_prompt(7, seed=1)] * 3, dim=1)
    assert_exact(model, SelfSpeculative(model, drafter="ngram", compile=True), prompt)
    heads = eagle_heads(model, layout="eagle")
    assert_exact(model, SelfSpeculative(model, heads=heads, num_draft_tokens=2, compile=True), prompt)


def test_sampling_is_distributed_as_the_target():
    model = tiny_model("llama", seed=3, vocab_size=VOCAB, num_layers=3, hidden=16, logit_scale=20.0)
    heads = eagle_heads(model, seed=1, layout="eagle3", feature_layers=[0, 1])
    spec = SelfSpeculative(model, heads=heads, num_draft_tokens=2, compile=True)
    counts = sampled_counts(spec, temperature=0.8)
    assert chi_square_pvalue(counts, exact_law(model, temperature=0.8)) > 1e-3
    out = spec.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=4, do_sample=True)
    assert out.shape == (1, PROMPT.shape[1] + 4)


class LastLayerDrafter(Drafter):
    """Reads the last decoder layer's output before the final norm, which the compiled pass does not return."""

    max_drafts = 1

    def __init__(self, layer: int):
        super().__init__()
        self.hidden_layers = (layer,)

    def draft(self, state, gamma, process, do_sample):
        raise AssertionError("not reached")

    def estimated_cost(self) -> float:
        return 0.0


def test_what_it_cannot_run_is_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="exit-head drafter"):
        SelfSpeculative(model, exit_layer=2, compile=True)  # the untrained exit runs the first layers itself
    with pytest.raises(ValueError, match="tree"):
        SelfSpeculative(model, heads=medusa_heads(model), tree=[[0], [1], [0, 0]], compile=True)
    with pytest.raises(TypeError, match="compile='yes'"):
        SelfSpeculative(model, drafter="ngram", compile="yes")
    with pytest.raises(ValueError, match="'dynamic' is set by selfspec"):
        SelfSpeculative(model, drafter="ngram", compile={"dynamic": True})
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        SelfSpeculative(tiny_model("mistral"), drafter="ngram", compile=True)
    # its frequency update branches on a tensor: the first compiled pass raised torch's Unsupported mid-call
    dynamic = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(UnsupportedModelError, match="dynamic rope scaling"):
        SelfSpeculative(dynamic, drafter="ngram", compile=True)
    spec = SelfSpeculative(model, drafter="ngram", compile=True)
    with pytest.raises(UnsupportedGenerationArgument, match="one unpadded prompt at a time"):
        spec.generate(torch.cat([random_prompt(5)] * 2), max_new_tokens=4)
    with pytest.raises(UnsupportedGenerationArgument, match="with padding"):
        spec.generate(random_prompt(5), attention_mask=torch.tensor([[0, 1, 1, 1, 1]]), max_new_tokens=4)
    last = model.config.num_hidden_layers - 1
    with pytest.raises(ValueError, match=f"not {last}"):
        SelfSpeculative(model, drafter=LastLayerDrafter(last), compile=True)
    SelfSpeculative(model, drafter=LastLayerDrafter(last - 1), compile=True)
