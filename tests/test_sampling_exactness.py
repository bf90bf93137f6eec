"""Sampled self-speculative output is distributed exactly as the target's processed distribution.

A tiny model with a 4-token vocabulary: the exact law of the first three generated tokens is computed by
enumerating all 64 continuations with full forward passes (no cache, processing reimplemented here),
and thousands of `SelfSpeculative.generate(do_sample=True)` samples are compared with it by a chi-square
test at a fixed seed. The same test, run with a broken rule (resampling from p after a rejection
instead of from the residual), must fail: that shows the test can tell.

The samples are drawn one prompt per call for the basic rule, the broken one and the trees (which verify one
prompt at a time), and otherwise ROWS copies of the prompt per call: every row samples on its own and accepts its
own number of drafts, so the law per row is the same, and the run takes a twenty-fifth of the calls.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare
from test_medusa import medusa_heads
from tiny_models import tiny_model
from transformers import LogitsProcessor, LogitsProcessorList

from selfspec import SelfSpeculative
from selfspec.engine import verify

VOCAB = 4
NEW_TOKENS = 3
SAMPLES = 2500
ROWS = 25  # prompts per call where the batch is not what a test is about
PROMPT = torch.tensor([[1, 2, 3, 1, 0]])


@pytest.fixture(scope="module")
def model():
    # hidden 16, 3 layers: the untrained exit after layer 1 is a poor draft (alpha about 0.7),
    # so rejections and residual draws happen often
    return tiny_model("llama", seed=3, vocab_size=VOCAB, num_layers=3, hidden=16, logit_scale=20.0)


def processed(logits: torch.Tensor, temperature=1.0, top_k=None, top_p=None) -> torch.Tensor:
    """The target's sampling distribution, implemented independently of transformers' processors."""
    scores = logits.double() / temperature
    if top_k is not None:
        kth = scores.topk(top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None:
        probs = scores.softmax(-1)
        order = probs.argsort(descending=True)
        cumulative = probs[order].cumsum(-1)
        keep = cumulative - probs[order] < top_p  # smallest set whose mass reaches top_p
        removed = order[~keep]
        scores[removed] = float("-inf")
    return scores.softmax(-1)


def exact_law(model, no_repeat: bool = False, **processing) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) for all VOCAB^3 continuations, as a flat vector (`no_repeat`: the last token may not
    come again, as `NoRepeat` processes it)."""
    law = torch.zeros(VOCAB**NEW_TOKENS, dtype=torch.float64)
    with torch.no_grad():
        for index, tokens in enumerate(itertools.product(range(VOCAB), repeat=NEW_TOKENS)):
            probability = 1.0
            for step in range(NEW_TOKENS):
                prefix = torch.cat([PROMPT, torch.tensor([tokens[:step]], dtype=torch.long)], dim=1)
                logits = model(prefix).logits[0, -1].clone()
                if no_repeat:
                    logits[prefix[0, -1]] = float("-inf")
                probability *= processed(logits, **processing)[tokens[step]].item()
            law[index] = probability
    return law


def sampled_counts(spec: SelfSpeculative, seed: int = 0, rows: int = 1, **processing) -> torch.Tensor:
    """Counts of the first three generated tokens over SAMPLES samples, drawn `rows` at a time (the prompt in every
    row of a call)."""
    torch.manual_seed(seed)
    counts = torch.zeros(VOCAB**NEW_TOKENS, dtype=torch.float64)
    accepted = proposed = 0
    for _ in range(SAMPLES // rows):
        # two tokens more than the law covers, so that one iteration after the prefill can draft gamma = 2
        # (or a tree of depth 2) into the three tokens checked; the law of a prefix does not depend on them
        prompts = PROMPT.expand(rows, -1)  # its last token is the pad token: text here, as in `exact_law`
        out = spec.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=NEW_TOKENS + 2,
            do_sample=True,
            **processing,
        )
        for t1, t2, t3 in out[:, PROMPT.shape[1] : PROMPT.shape[1] + NEW_TOKENS].tolist():
            counts[(t1 * VOCAB + t2) * VOCAB + t3] += 1
        accepted, proposed = accepted + spec.stats.accepted, proposed + spec.stats.proposed
    # both branches of the rule must run many times for the test to bite
    assert accepted >= 100 and proposed - accepted >= 100, f"{accepted} of {proposed} drafts accepted"
    return counts


def early_exit(model, num_draft_tokens: int) -> SelfSpeculative:
    return SelfSpeculative(model, exit_layer=1, num_draft_tokens=num_draft_tokens)


def chi_square_pvalue(counts: torch.Tensor, law: torch.Tensor) -> float:
    expected = law * counts.sum()
    rare = expected < 5  # pool rare cells so the chi-square approximation holds
    observed = torch.cat([counts[~rare], counts[rare].sum()[None]])
    expected = torch.cat([expected[~rare], expected[rare].sum()[None]])
    keep = expected > 0
    return float(chisquare(observed[keep].numpy(), expected[keep].numpy()).pvalue)


SETTINGS = [
    pytest.param(1, {"temperature": 1.0}, 1, id="temperature-1-gamma-1-one-row"),
    pytest.param(2, {"temperature": 0.7}, ROWS, id="temperature-0.7-gamma-2"),
    pytest.param(2, {"top_k": 3}, ROWS, id="top-k-3"),
    pytest.param(2, {"top_p": 0.8}, ROWS, id="top-p-0.8"),
]


@pytest.mark.parametrize("num_draft_tokens,processing,rows", SETTINGS)
def test_sampling_is_distributed_as_the_target(model, num_draft_tokens, processing, rows):
    law = exact_law(model, **processing)
    counts = sampled_counts(early_exit(model, num_draft_tokens), rows=rows, **processing)
    pvalue = chi_square_pvalue(counts, law)
    assert pvalue > 1e-3, f"sampled law differs from the target's (chi-square p = {pvalue:.2e})"


def test_medusa_chain_sampling_is_distributed_as_the_target(model):
    heads = medusa_heads(model, num_heads=2, scale=0.3)
    law = exact_law(model, top_k=3)
    counts = sampled_counts(SelfSpeculative(model, heads=heads, num_draft_tokens=2), rows=ROWS, top_k=3)
    pvalue = chi_square_pvalue(counts, law)
    assert pvalue > 1e-3, f"sampled law differs from the target's (chi-square p = {pvalue:.2e})"


def test_reduced_draft_vocabulary_sampling_is_distributed_as_the_target(model):
    """q supported on 2 of the 4 tokens: the other two are reached only through the residual."""
    spec = SelfSpeculative(model, exit_layer=1, num_draft_tokens=2, draft_vocab=[0, 2], draft_vocab_context=False)
    law = exact_law(model, temperature=0.9)
    pvalue = chi_square_pvalue(sampled_counts(spec, rows=ROWS, temperature=0.9), law)
    assert pvalue > 1e-3, f"sampled law differs from the target's (chi-square p = {pvalue:.2e})"


def test_a_draft_vocabulary_joined_by_the_prompts_tokens_samples_as_the_target(model):
    """The prompt holds every token, so they join the 1-token vocabulary after it, out of order: q over [2, 0, 1, 3]."""
    spec = SelfSpeculative(model, exit_layer=1, num_draft_tokens=2, draft_vocab=[2])
    law = exact_law(model, temperature=0.9)
    pvalue = chi_square_pvalue(sampled_counts(spec, rows=ROWS, temperature=0.9), law)
    assert pvalue > 1e-3, f"sampled law differs from the target's (chi-square p = {pvalue:.2e})"
    assert spec.drafter._vocab.current.ids.tolist() == [2, 0, 1, 3]


def test_int8_draft_head_sampling_is_distributed_as_the_target(model):
    spec = SelfSpeculative(model, exit_layer=1, num_draft_tokens=2, draft_quant="int8")
    law = exact_law(model, top_p=0.9)
    pvalue = chi_square_pvalue(sampled_counts(spec, rows=ROWS, top_p=0.9), law)
    assert pvalue > 1e-3, f"sampled law differs from the target's (chi-square p = {pvalue:.2e})"


def test_confidence_stopped_drafts_sampling_is_distributed_as_the_target(model):
    """Chains cut where the draft is unsure: the cut depends on the drafts alone, so the law is unchanged."""
    spec = SelfSpeculative(model, exit_layer=1, num_draft_tokens=2, draft_confidence=0.7)
    law = exact_law(model, temperature=1.0)
    pvalue = chi_square_pvalue(sampled_counts(spec, rows=ROWS, temperature=1.0), law)
    assert pvalue > 1e-3, f"sampled law differs from the target's (chi-square p = {pvalue:.2e})"


TREE = [[0], [1], [0, 0]]  # few candidates in a 4-token vocabulary, so rejections stay common


def test_medusa_tree_sampling_is_distributed_as_the_target(model):
    """Tree verification with deterministic top-k candidates (the rule without replacement)."""
    spec = SelfSpeculative(model, heads=medusa_heads(model, num_heads=2, scale=0.3), tree=TREE, adaptive=False)
    law = exact_law(model, temperature=0.8)
    pvalue = chi_square_pvalue(sampled_counts(spec, temperature=0.8), law)
    assert pvalue > 1e-3, f"sampled law differs from the target's (chi-square p = {pvalue:.2e})"


def test_a_lossy_tree_rule_fails_the_same_test(model, monkeypatch):
    """A rule that favours likely candidates (as Medusa's typical acceptance does) is caught."""

    def sharpened(scores, do_sample):  # scores: [batch, V] at each row's node
        p = scores.softmax(dim=-1)
        return torch.multinomial(p**2 / (p**2).sum(-1, keepdim=True), 1).squeeze(-1)

    monkeypatch.setattr(verify, "target_token", sharpened)
    spec = SelfSpeculative(model, heads=medusa_heads(model, num_heads=2, scale=0.3), tree=TREE, adaptive=False)
    pvalue = chi_square_pvalue(sampled_counts(spec, temperature=0.8), exact_law(model, temperature=0.8))
    assert pvalue < 1e-6, f"the lossy rule went unnoticed (chi-square p = {pvalue:.2e})"


def test_batched_sampling_is_distributed_as_the_target_per_row(model):
    """Ten rows at once: every row is a sample of the target's law, although rows accept different
    numbers of drafts per iteration (and are re-aligned). Two masked padding slots lead every row; the
    odd rows hold arbitrary ids there, which the mask must hide."""
    rows = 10
    padded = torch.cat([torch.zeros(rows, 2, dtype=torch.long), PROMPT.expand(rows, -1)], dim=1)
    padded[1::2, :2] = torch.tensor([3, 2])
    mask = torch.ones_like(padded)
    mask[:, :2] = 0
    spec = early_exit(model, 2)
    torch.manual_seed(0)
    counts = torch.zeros(VOCAB**NEW_TOKENS, dtype=torch.float64)
    accepted = proposed = 0
    for _ in range(SAMPLES // rows):
        out = spec.generate(padded, attention_mask=mask, max_new_tokens=NEW_TOKENS + 2, do_sample=True, top_k=3)
        for t1, t2, t3 in out[:, padded.shape[1] : padded.shape[1] + NEW_TOKENS].tolist():
            counts[(t1 * VOCAB + t2) * VOCAB + t3] += 1
        accepted, proposed = accepted + spec.stats.accepted, proposed + spec.stats.proposed
    assert accepted >= 100 and proposed - accepted >= 100, f"{accepted} of {proposed} drafts accepted"
    pvalue = chi_square_pvalue(counts, exact_law(model, top_k=3))
    assert pvalue > 1e-3, f"sampled law differs from the target's (chi-square p = {pvalue:.2e})"


class NoRepeat(LogitsProcessor):
    """A processor that reads the input ids: the last token may not come again."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores.scatter(1, input_ids[:, -1:], float("-inf"))


@pytest.mark.parametrize("rows", [1, 5])
def test_sampling_with_a_processor_that_reads_the_ids_is_distributed_as_the_target(model, rows):
    """Such processors process each row on its own, position by position, and only as far as sampling could have
    gone (the drafts so far are tokens they allow): the law is still the target's, alone and in a batch."""
    spec = early_exit(model, 2)
    counts = sampled_counts(spec, rows=rows, logits_processor=LogitsProcessorList([NoRepeat()]))
    law = exact_law(model, no_repeat=True)
    assert counts[law == 0].sum() == 0  # no token repeats
    pvalue = chi_square_pvalue(counts, law)
    assert pvalue > 1e-3, f"sampled law differs from the target's (chi-square p = {pvalue:.2e})"


def test_a_broken_rule_fails_the_same_test(model, monkeypatch):
    monkeypatch.setattr(verify, "residual_distribution", lambda p_at, q_at: p_at)
    law = exact_law(model)
    counts = sampled_counts(early_exit(model, 1))
    pvalue = chi_square_pvalue(counts, law)
    assert pvalue < 1e-6, f"the broken rule went unnoticed (chi-square p = {pvalue:.2e})"


def test_same_seed_same_sample(model):
    spec = SelfSpeculative(model, exit_layer=1, num_draft_tokens=3)
    outputs = []
    for _ in range(2):
        torch.manual_seed(1234)
        outputs.append(spec.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=20, do_sample=True))
    assert torch.equal(outputs[0], outputs[1])
