"""The drafter interface: a drafter written outside the package, the n-gram drafter and hybrid drafting stay
exact (greedy token-identical to `model.generate`, sampling distributed as the target's law), and a drafter
that breaks the contract gets an error naming the problem."""

from __future__ import annotations

import pytest
import torch
from test_eagle import eagle_heads
from test_medusa import medusa_heads
from test_sampling_exactness import ROWS, chi_square_pvalue, exact_law, sampled_counts
from test_sampling_exactness import model as sampling_model  # noqa: F401  (the 4-token model fixture)
from tiny_models import padded_prompts, random_prompt, tiny_model

from selfspec import Draft, Drafter, DrafterContractError, ExitHeads, NGramDrafter, SelfSpeculative
from selfspec.adapter import ModelAdapter
from selfspec.drafters.ngram import find_continuations


class ShiftDrafter(Drafter):
    """A user's drafter: q is a fixed random distribution mixed with a guess at the next token (the pending
    token plus one); tokens are drawn from q when sampling, its argmax otherwise."""

    def __init__(self, vocab_size: int, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.base = torch.randn(vocab_size, generator=generator)
        self.vocab_size = vocab_size
        self.calls = 0

    def estimated_cost(self) -> float:
        return 0.0

    def draft(self, state, gamma, process, do_sample):
        self.calls += 1
        token, tokens, scores = state.sequences[:, -1], [], []
        for _ in range(gamma):
            score = self.base.expand(token.shape[0], -1).clone()
            score.scatter_add_(
                1, ((token + 1) % self.vocab_size)[:, None], torch.full_like(token[:, None], 3.0).float()
            )
            token = torch.multinomial(score.softmax(-1), 1)[:, 0] if do_sample else score.argmax(-1)
            tokens.append(token)
            scores.append(score)
        return Draft(torch.stack(tokens, dim=1), torch.stack(scores, dim=1))


class BrokenDrafter(Drafter):
    def __init__(self, breakage: str, vocab_size: int):
        super().__init__()
        self.breakage, self.vocab_size = breakage, vocab_size

    def estimated_cost(self) -> float:
        return 0.0

    def draft(self, state, gamma, process, do_sample):
        batch = state.batch_size
        tokens = torch.ones(batch, gamma, dtype=torch.long)
        scores = torch.zeros(batch, gamma, self.vocab_size)
        if self.breakage == "shape":
            return Draft(tokens[:, None], scores)
        if self.breakage == "too many":
            return Draft(torch.ones(batch, gamma + 1, dtype=torch.long), torch.zeros(batch, gamma + 1, self.vocab_size))
        if self.breakage == "vocabulary":
            return Draft(tokens * self.vocab_size, scores)
        if self.breakage == "nan":
            return Draft(tokens, scores.fill_(float("nan")))
        if self.breakage == "zero q":
            return Draft(tokens, scores.index_fill_(-1, torch.tensor([1]), float("-inf")))
        return tokens  # not a Draft


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_user_drafter_greedy_matches_generate(arch):
    model = tiny_model(arch)
    drafter = ShiftDrafter(model.config.vocab_size)
    for gamma, length in ((1, 3), (4, 17), (6, 9)):
        prompt = random_prompt(length, seed=gamma)
        expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
        spec = SelfSpeculative(model, drafter=drafter, num_draft_tokens=gamma)
        assert torch.equal(spec.generate(prompt, max_new_tokens=30, do_sample=False), expected)
        assert spec.stats.proposed > 0
    assert drafter.calls > 0


def test_user_drafter_sampling_is_distributed_as_the_target(sampling_model):  # noqa: F811
    spec = SelfSpeculative(sampling_model, drafter=ShiftDrafter(4, seed=1), num_draft_tokens=2)
    counts = sampled_counts(spec, rows=ROWS, temperature=0.8)  # rows accept on their own
    assert chi_square_pvalue(counts, exact_law(sampling_model, temperature=0.8)) > 1e-3


def test_ngram_sampling_is_distributed_as_the_target(sampling_model):  # noqa: F811
    spec = SelfSpeculative(sampling_model, drafter="ngram", prompt_lookup_num_tokens=2, max_matching_ngram_size=1)
    counts = sampled_counts(spec, rows=ROWS)
    assert chi_square_pvalue(counts, exact_law(sampling_model)) > 1e-3


def test_sampling_test_tells_a_broken_rule(sampling_model, monkeypatch):  # noqa: F811
    """The batched chi-square above can fail: resampling from p after a rejection (not from the residual)
    distorts the law, and the test sees it."""
    from selfspec.engine import verify

    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    spec = SelfSpeculative(sampling_model, drafter=ShiftDrafter(4, seed=1), num_draft_tokens=2)
    counts = sampled_counts(spec, rows=ROWS, temperature=0.8)
    assert chi_square_pvalue(counts, exact_law(sampling_model, temperature=0.8)) < 1e-3


@pytest.mark.parametrize("breakage,message", [
    ("shape", "tokens of shape"), ("too many", "G <= 2"), ("vocabulary", "outside the vocabulary"),
    ("nan", "NaN"), ("zero q", "probability 0"), ("type", "must return a selfspec Draft"),
])  # fmt: skip
def test_contract_breaking_drafter_gets_a_clear_error(breakage, message):
    model = tiny_model("llama")
    spec = SelfSpeculative(model, drafter=BrokenDrafter(breakage, 96), num_draft_tokens=2)
    with pytest.raises(DrafterContractError, match=message):
        spec.generate(random_prompt(5), max_new_tokens=8)


def test_find_continuations_takes_the_most_recent_longest_match():
    #                          0  1  2  3  4  5  6  7  8
    sequences = torch.tensor([[5, 6, 7, 9, 6, 7, 8, 5, 6], [0, 0, 4, 3, 2, 4, 3, 2, 4]])
    found, start, period = find_continuations(sequences, torch.tensor([0, 2]), max_ngram=2, min_ngram=1)
    # row 0: "5 6" occurs at 0 -> continuation from 2 (the bigram wins over the later unigram "6" at 4)
    # row 1: "2 4" occurs at 4 -> continuation from 6; period 3 repeats "3 2 4"
    assert found.tolist() == [True, True] and start.tolist() == [2, 6] and period.tolist() == [7, 3]
    none, _, _ = find_continuations(torch.tensor([[0, 0, 1, 2, 3]]), torch.tensor([2]), 2, 1)
    assert none.tolist() == [False]  # padding (the zeros) never matches


def test_ngram_proposes_the_periodic_continuation():
    model = tiny_model("llama")
    drafter = NGramDrafter(prompt_lookup_num_tokens=7)
    spec = SelfSpeculative(model, drafter=drafter)
    state = type("State", (), {})()
    state.sequences = torch.tensor([[9, 4, 3, 2, 4, 3]])
    state.pad_offset = torch.tensor([0])
    assert drafter.available(state)
    draft = drafter.draft(state, 7, None, False)
    assert draft.tokens.tolist() == [[2, 4, 3, 2, 4, 3, 2]] and draft.scores is None
    assert spec.num_draft_tokens == 7


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "gpt_neox"])
def test_ngram_and_hybrid_greedy_match_generate(arch):
    model = tiny_model(arch)
    heads = ExitHeads(ModelAdapter(model).fingerprint(), [1, 2])
    repetitive = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6]])
    for prompt in (random_prompt(12, seed=3), repetitive):
        expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
        for options in (
            {"drafter": "ngram"},
            {"drafter": "ngram", "prompt_lookup_num_tokens": 3, "max_matching_ngram_size": 3},
            {"drafter": "hybrid", "heads": heads, "exit_layer": 2, "num_draft_tokens": 4},
            {"drafter": "hybrid"},  # adaptive, untrained exit
            {"drafter": "hybrid", "heads": medusa_heads(model, num_heads=3), "tree": []},
        ):
            spec = SelfSpeculative(model, **options)
            actual = spec.generate(prompt, max_new_tokens=40, do_sample=False)
            assert torch.equal(actual, expected), f"{arch} {options}"
    assert spec.stats.proposed > 0


def test_ngram_drafts_accepted_on_repetitive_text():
    model = tiny_model("llama")
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8, 9, 10, 11, 12, 5]])
    expected = model.generate(prompt, max_new_tokens=48, do_sample=False)
    spec = SelfSpeculative(model, drafter="ngram", num_draft_tokens=4)
    assert torch.equal(spec.generate(prompt, max_new_tokens=48, do_sample=False), expected)
    # a greedy tiny model falls into a loop, which lookup then predicts
    assert spec.stats.accepted >= 10 and spec.stats.tokens_per_pass > 1.2


def test_ngram_batch_rows_are_exact():
    model = tiny_model("qwen2")
    ids, mask = padded_prompts([3, 11, 7])
    ids[1, -5:] = ids[1, -10:-5]  # a row that repeats itself: lookup has matches there
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    for drafter in ("ngram", "hybrid"):
        actual = SelfSpeculative(model, drafter=drafter).generate(
            ids, attention_mask=mask, max_new_tokens=30, do_sample=False
        )
        assert torch.equal(actual, expected), drafter


def test_drafter_argument_errors():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="drafter='ngram' or 'hybrid'"):
        SelfSpeculative(model, exit_layer=2, prompt_lookup_num_tokens=5)
    with pytest.raises(ValueError, match="drafts without the model"):
        SelfSpeculative(model, drafter="ngram", exit_layer=2)
    with pytest.raises(ValueError, match="configure your drafter itself"):
        SelfSpeculative(model, drafter=NGramDrafter(), draft_confidence=0.5)
    # a tree's size is its own: the chain stop would be read only by the chains near a call's end
    for heads, tree in ((medusa_heads(model), [[0], [1]]), (eagle_heads(model), {"nodes": 3, "top_k": 2, "depth": 2})):
        with pytest.raises(ValueError, match="draft_confidence stops a chain early; .* drafts trees"):
            SelfSpeculative(model, heads=heads, tree=tree, draft_confidence=0.5)
        SelfSpeculative(model, heads=heads, tree=[] if tree == [[0], [1]] else None, draft_confidence=0.5)  # chains
    merged = SelfSpeculative(
        model, drafter="hybrid", heads=medusa_heads(model), tree=[[0], [1]], adaptive=False
    )  # tests/test_merged
    assert repr(merged.drafters) == "Drafters('ngram + medusa tree')"
    with pytest.raises(ValueError, match="drafter='nope'"):
        SelfSpeculative(model, drafter="nope")
    with pytest.raises(ValueError, match="max_matching_ngram_size"):
        NGramDrafter(max_matching_ngram_size=0)
    with pytest.raises(TypeError, match="Can't instantiate abstract class"):
        Drafter()


def test_hybrid_uses_both_drafters():
    model = tiny_model("llama")
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8, 9, 10, 11, 12, 5]])
    spec = SelfSpeculative(model, drafter="hybrid", exit_layer=2, num_draft_tokens=3)
    spec.generate(prompt, max_new_tokens=40, do_sample=False)
    by = spec.stats.drafted_by
    assert set(by) == {"ngram", "exit 2"} and all(entry["iterations"] > 0 for entry in by.values()), by
