"""Adaptive drafting: gamma from the speedup equation, plain decoding when drafting does not pay."""

from __future__ import annotations

import pytest
import torch
from test_medusa import TREE, FutureOracle, medusa_heads
from tiny_models import random_prompt, tiny_model

from selfspec import SelfSpeculative
from selfspec.engine.adaptive import DraftController, TreeController, predicted_speedup


def test_predicted_speedup_is_the_design_equation():
    # alpha 0.6, gamma 3, c 0.1, v 1.2: E = (1 - 0.6^4) / 0.4 = 2.176; cost = 1.2 + 0.3
    assert predicted_speedup(0.6, 3, 0.1, 1.2) == pytest.approx(2.176 / 1.5)
    assert predicted_speedup(1.0, 4, 0.25) == pytest.approx(5 / 2.0)  # every draft accepted
    assert predicted_speedup(0.0, 2, 0.0) == pytest.approx(1.0)  # free drafts, none accepted: break even
    assert predicted_speedup(0.0, 2, 0.1) < 1.0 and predicted_speedup(0.3, 0, 0.5) == 1.0


def test_controller_falls_back_probes_and_recovers():
    controller = DraftController(max_drafts=6, draft_cost=0.2)
    choices = []
    for _ in range(300):  # nothing is ever accepted
        gamma = controller.choose(10)
        choices.append(gamma)
        controller.update(gamma, [0])
    first_plain = choices.index(0)
    assert all(choices[:first_plain]) and first_plain < 10  # drafting stops after a few rejections
    probes = [step for step in range(first_plain, 300) if choices[step]]
    assert all(choices[step] == 1 for step in probes)  # a probe is a single draft
    gaps = [b - a for a, b in zip([first_plain - 1, *probes], probes, strict=False)]
    assert gaps[:6] == [8, 16, 32, 64, 64, 64]  # each rejected probe doubles the wait, up to max_probe_every
    for _ in range(40):  # acceptance recovers on the probes and after
        gamma = max(controller.choose(10), 1)
        controller.update(gamma, [gamma])
    assert controller.choose(10) == 6 and controller.choose(3) == 3  # the budget caps gamma


def test_bad_draft_falls_back_to_plain_decoding_and_stays_exact():
    model = tiny_model("llama", num_layers=8)
    prompt = random_prompt(10)
    expected = model.generate(prompt, max_new_tokens=100, do_sample=False)
    fixed = SelfSpeculative(model, exit_layer=1, num_draft_tokens=4)
    adaptive = SelfSpeculative(model, exit_layer=1)  # num_draft_tokens not given: adaptive
    assert adaptive.adaptive and not fixed.adaptive
    for spec in (fixed, adaptive):
        assert torch.equal(spec.generate(prompt, max_new_tokens=100, do_sample=False), expected)
    assert fixed.stats.alpha_hat < 0.1  # a bad draft
    assert adaptive.stats.proposed < fixed.stats.proposed / 10


@pytest.mark.parametrize("tree", [None, TREE])
def test_good_draft_drafts_the_most(tree):
    """An ideal draft: a chain drafts its four tokens in most iterations, a tree is verified in every iteration it
    fits in (all but the call's last few)."""
    model = tiny_model("qwen2")
    prompt = random_prompt(9, seed=2)
    expected = model.generate(prompt, max_new_tokens=60, do_sample=False)
    oracle = FutureOracle(expected[0, 9:].tolist(), model.config.vocab_size, perfect=True)
    # a given position cost: one measured while the machine is loaded can make wide verify passes look dear
    heads = medusa_heads(model, num_heads=4)
    spec = SelfSpeculative(model, heads=heads, tree=tree or [], adaptive=True, position_cost=0.05)
    spec.heads.logits = oracle.logits
    assert torch.equal(spec.generate(prompt, max_new_tokens=60, do_sample=False, streamer=oracle), expected)
    stats = spec.stats
    if tree is None:
        assert stats.proposed_per_position[3] >= stats.iterations // 2  # four drafts in most iterations
    else:
        assert stats.drafted_by["medusa tree"]["iterations"] >= stats.iterations - 4
        assert stats.tokens_per_pass > 3


def test_tree_controller_falls_back_probes_and_recovers():
    """A tree of 10 candidates verified at v = 1.3 and drafted at c = 0.2 that keeps nothing costs 1.5 steps for
    one token: plain steps soon, a probing tree after 8, 16, 32, then every 64 of them while probes fail."""
    controller = TreeController(verify_costs=(1.0,) + (1.3,) * 10, draft_cost=0.2)
    trees = []
    for _ in range(300):
        tree = controller.choose()
        trees.append(tree)
        if tree:
            controller.update(10, 0)
    first_plain = trees.index(False)
    assert all(trees[:first_plain]) and 1 <= first_plain < 6
    probes = [step for step in range(first_plain, 300) if trees[step]]
    gaps = [b - a for a, b in zip([first_plain - 1, *probes], probes, strict=False)]
    assert gaps[:5] == [8, 16, 32, 64, 64]
    for _ in range(100):  # trees that keep 2 of their candidates from the next probe on: 3 tokens for 1.5 steps
        if controller.choose():
            controller.update(10, 2)
    assert controller.speedup() == pytest.approx(2.0, rel=0.1) and all(controller.choose() for _ in range(5))
    cheap = TreeController(verify_costs=(1.0, 1.0, 1.0), draft_cost=0.0)  # trees at no cost never lose
    for _ in range(50):
        assert cheap.choose()
        cheap.update(2, 0)


def test_bad_tree_falls_back_to_plain_decoding_and_stays_exact():
    """Adaptive trees (the default): random Medusa heads' trees are rarely accepted, so after a few the loop takes
    plain steps with a probing tree now and then; a fixed tree (adaptive=False) verifies one every iteration. Both
    give generate's output."""
    model = tiny_model("llama", num_layers=4)
    prompt = random_prompt(10)
    expected = model.generate(prompt, max_new_tokens=100, do_sample=False)
    heads = medusa_heads(model, num_heads=4)
    fixed = SelfSpeculative(model, heads=heads, tree=TREE, adaptive=False)
    adaptive = SelfSpeculative(model, heads=heads, tree=TREE, position_cost=0.1)  # v(10) = 2.1 / 1.1 here
    assert adaptive.adaptive
    for spec in (fixed, adaptive):
        assert torch.equal(spec.generate(prompt, max_new_tokens=100, do_sample=False), expected)
    # a fixed tree: every iteration but the last few of the call, where the deepest candidate would not fit
    assert fixed.stats.drafted_by["medusa tree"]["iterations"] >= fixed.stats.iterations - 4
    assert fixed.stats.alpha_hat < 0.05  # a bad tree
    assert adaptive.stats.drafted_by["medusa tree"]["iterations"] < fixed.stats.iterations / 5


def test_adaptive_sampling_is_reproducible():
    model = tiny_model("gemma", seed=3)
    spec = SelfSpeculative(model, exit_layer=2)
    outputs = []
    for _ in range(2):
        torch.manual_seed(7)
        outputs.append(spec.generate(random_prompt(5), max_new_tokens=40, do_sample=True))
    assert torch.equal(outputs[0], outputs[1])


def test_draft_cost_is_checked():
    with pytest.raises(ValueError, match="draft_cost"):
        SelfSpeculative(tiny_model("llama"), draft_cost=-1.0)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_unsure_drafts_stop_early_and_output_stays_exact(arch):
    from test_medusa import medusa_heads

    model = tiny_model(arch)
    prompt = random_prompt(7, seed=5)
    expected = model.generate(prompt, max_new_tokens=50, do_sample=False)
    for options in ({"exit_layer": 2, "num_draft_tokens": 6}, {"heads": medusa_heads(model), "num_draft_tokens": 4}):
        full = SelfSpeculative(model, adaptive=False, **options)
        full.generate(prompt, max_new_tokens=50, do_sample=False)
        spec = SelfSpeculative(model, adaptive=False, draft_confidence=0.9, **options)
        assert torch.equal(spec.generate(prompt, max_new_tokens=50, do_sample=False), expected), options
        per_iteration = [s.stats.proposed / s.stats.iterations for s in (full, spec)]
        assert per_iteration[1] < per_iteration[0] - 0.5, per_iteration  # shorter chains with the stop
    with pytest.raises(ValueError, match="draft_confidence=1.5 must be a probability"):
        SelfSpeculative(model, exit_layer=2, draft_confidence=1.5)


def test_gamma_shrinks_to_zero_as_the_batch_grows_when_positions_cost():
    from selfspec.engine.adaptive import position_cost_from

    r = position_cost_from(1.2, 1)  # v(1) = 1.2 at one row, as measured on a CPU
    assert r == pytest.approx(0.25)
    controller = DraftController(max_drafts=4, draft_cost=0.05, position_cost=r)
    assert controller.verify_cost_at(1, 1) == pytest.approx(1.2)
    assert controller.verify_cost_at(1, 16) == pytest.approx(9 / 5)  # (1 + 0.25 * 32) / (1 + 0.25 * 16)
    for outcome in [0, 0, 1, 2] * 5:  # each draft accepted with probability 1/2, once the rule reaches it
        controller.update(2, [outcome])
    chosen = [controller.choose(10, rows) for rows in (1, 2, 4, 8, 16)]
    assert chosen[0] >= 1 and chosen[-1] == 0 and chosen == sorted(chosen, reverse=True), chosen
    free = DraftController(max_drafts=4, draft_cost=0.05)  # r = 0: v = 1 at every batch size
    for outcome in [0, 0, 1, 2] * 5:
        free.update(2, [outcome])
    assert free.choose(10, 16) == free.choose(10, 1) >= 1


def test_expected_tokens_follow_acceptance_by_position():
    """E(gamma) comes from how often each draft position is accepted once the rule reaches it. Drafts right
    or wrong in runs (n-gram lookup copies whole spans): a third of the iterations accept all 10 drafts,
    the rest none, so E(10) is about 1 + 10/3, and a long draft pays. Independent acceptances at the same
    first-position rate make E(10) about 2: there it does not."""
    runs = DraftController(max_drafts=10, draft_cost=0.0, position_cost=0.1)
    for outcome in [0, 0, 10] * 10:
        runs.update(10, [outcome])
    assert runs.expected_tokens(10) == pytest.approx(1 + 10 / 3, rel=0.1)
    assert runs.choose(10) == 10
    iid = DraftController(max_drafts=10, draft_cost=0.0, position_cost=0.1)
    for outcome in [0, 0, 1, 2] * 10:  # accepted with probability 1/2 at every position
        iid.update(10, [outcome])
    assert iid.expected_tokens(10) == pytest.approx(2.0, rel=0.15)
    assert iid.choose(10) < 10


def test_batched_generation_with_a_position_cost_stays_exact():
    from tiny_models import padded_prompts

    model = tiny_model("llama")
    ids, mask = padded_prompts([4, 9, 6, 7], seed=3)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    spec = SelfSpeculative(model, exit_layer=3, position_cost=0.5)
    assert torch.equal(spec.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False), expected)
    with pytest.raises(ValueError, match="position_cost=-1"):
        SelfSpeculative(model, position_cost=-1)
