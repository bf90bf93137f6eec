"""The distillation and speedup math (selfspec/training/distill.py, selfspec/engine/adaptive.py, the timing of
selfspec/measure/costs.py) on hand-made tensors and tiny models."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import ARCHITECTURES, chat_tokenizer, tiny_model

from selfspec.adapter import ModelAdapter
from selfspec.engine.adaptive import best_gamma, expected_tokens, predicted_speedup
from selfspec.heads import DraftHeads, EagleHeads, ExitHeads, MedusaHeads
from selfspec.heads.base import Costs
from selfspec.measure.costs import measure_costs
from selfspec.training.config import HeadsConfig
from selfspec.training.distill import (
    DistillationObjective,
    acceptance_rate,
    kl_divergence,
    score_sums,
    soft_cross_entropy,
    state_digest,
    target_pass,
    top1_agreement,
)


def logits_of(*distributions: list[float]) -> torch.Tensor:
    """Logits `[n, V]` whose softmax is each given distribution (zeros become -inf)."""
    return torch.tensor(distributions, dtype=torch.float64).log()


P = logits_of([0.5, 0.5, 0.0], [0.1, 0.2, 0.7])
Q = logits_of([0.25, 0.25, 0.5], [0.1, 0.6, 0.3])


def test_alpha_is_the_overlap_of_p_and_q():
    # sum_x min(p, q): 0.25 + 0.25 + 0 = 0.5; 0.1 + 0.2 + 0.3 = 0.6
    torch.testing.assert_close(acceptance_rate(P, Q), torch.tensor([0.5, 0.6]))
    torch.testing.assert_close(acceptance_rate(P, P), torch.tensor([1.0, 1.0]))


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(2, 50))
def test_alpha_is_one_minus_total_variation(seed, vocab):
    generator = torch.Generator().manual_seed(seed)
    p_logits, q_logits = torch.randn(2, 3, vocab, generator=generator) * 3
    p, q = p_logits.softmax(-1), q_logits.softmax(-1)
    total_variation = 0.5 * (p - q).abs().sum(-1)
    torch.testing.assert_close(acceptance_rate(p_logits, q_logits), 1 - total_variation)
    # symmetric in p and q
    torch.testing.assert_close(acceptance_rate(p_logits, q_logits), acceptance_rate(q_logits, p_logits))


def test_kl_and_soft_cross_entropy_by_hand():
    # KL(p || q) = sum p log(p / q) over the support of p
    first = 0.5 * math.log(0.5 / 0.25) * 2
    second = 0.1 * math.log(0.1 / 0.1) + 0.2 * math.log(0.2 / 0.6) + 0.7 * math.log(0.7 / 0.3)
    torch.testing.assert_close(kl_divergence(P, Q), torch.tensor([first, second], dtype=torch.float32))
    entropy = torch.tensor([math.log(2), -(0.1 * math.log(0.1) + 0.2 * math.log(0.2) + 0.7 * math.log(0.7))])
    torch.testing.assert_close(soft_cross_entropy(P, Q), kl_divergence(P, Q) + entropy.float())
    torch.testing.assert_close(kl_divergence(P, P), torch.zeros(2))


def test_kl_gradient_equals_soft_cross_entropy_gradient():
    p = torch.randn(4, 7)
    q1 = torch.randn(4, 7, requires_grad=True)
    q2 = q1.detach().clone().requires_grad_(True)
    kl_divergence(p, q1).sum().backward()
    soft_cross_entropy(p, q2).sum().backward()
    torch.testing.assert_close(q1.grad, q2.grad)


def test_top1_agreement():
    assert top1_agreement(logits_of([0.1, 0.9], [0.6, 0.4]), logits_of([0.2, 0.8], [0.3, 0.7])).tolist() == [1.0, 0.0]


def test_expected_tokens_and_predicted_speedup_by_hand():
    alpha, gamma, c = 0.8, 4, 0.1
    closed_form = (1 - alpha ** (gamma + 1)) / (1 - alpha)  # 3.3616
    assert expected_tokens([alpha] * gamma) == pytest.approx(closed_form) == pytest.approx(3.3616)
    assert predicted_speedup(alpha, gamma, c) == pytest.approx(3.3616 / 1.4)
    assert predicted_speedup(alpha, gamma, c, 1.5) == pytest.approx(3.3616 / 1.9)
    assert expected_tokens([1.0] * 3) == 4  # alpha = 1: every draft and the bonus token
    assert expected_tokens([0.5, 0.2]) == pytest.approx(1 + 0.5 + 0.1)  # chain with varying alphas
    assert predicted_speedup(0.0, 3, 0.2) == pytest.approx(1 / 1.6)  # nothing accepted: slower than plain


def test_best_gamma_has_an_interior_optimum():
    gamma, speedup = best_gamma(0.8, 0.1, max_gamma=16)
    speedups = [predicted_speedup(0.8, g, 0.1) for g in range(1, 17)]
    assert 1 < gamma < 16 and speedup == max(speedups) == speedups[gamma - 1]
    assert best_gamma(0.8, 0.0, max_gamma=5)[0] == 5  # free drafts: more is always better
    # measured v(gamma) growing with gamma moves the optimum down
    assert best_gamma(0.8, 0.1, 16, v=lambda g: 1 + 0.2 * g)[0] < gamma


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_hidden_states_k_is_what_the_drafter_exits_from(arch):
    """Exit heads train on `hidden_states[k]`; at generation they read `run_lower(k)`: the two must agree."""
    model = tiny_model(arch)
    adapter = ModelAdapter(model)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    hidden_states, logits = target_pass(model, ids)
    positions = torch.arange(9)[None].expand(2, -1)
    with torch.no_grad():  # as in training and in generation
        lower = [adapter.run_lower(ids, positions, adapter.new_cache(), k) for k in range(1, adapter.num_layers)]
        full, normed = adapter.forward_with_hidden(ids, positions, adapter.new_cache())
    for k in range(1, adapter.num_layers):
        assert torch.equal(hidden_states[k], lower[k - 1]), k
    assert torch.equal(hidden_states[-1], normed) and torch.equal(logits, full)


def test_drafts_pair_each_head_with_its_teacher():
    model = tiny_model("llama")
    adapter = ModelAdapter(model)
    hidden_states, logits = target_pass(model, torch.randint(3, 96, (2, 6)))
    exit_drafts = ExitHeads(adapter.fingerprint(), [1, 3]).distillation_drafts(adapter, hidden_states)
    assert [d.name for d in exit_drafts] == ["exit_1", "exit_3"]
    for draft, k in zip(exit_drafts, [1, 3], strict=True):  # untrained: the model's own norm and LM head
        assert torch.equal(draft.teacher(logits), logits)
        assert torch.equal(draft.head(draft.hidden), adapter.head_logits(hidden_states[k]))
    medusa = MedusaHeads(adapter.fingerprint(), num_heads=3)
    medusa_drafts = medusa.distillation_drafts(adapter, hidden_states)
    assert [d.name for d in medusa_drafts] == medusa.draft_names() == ["medusa_0", "medusa_1", "medusa_2"]
    for i, draft in enumerate(medusa_drafts):  # head i at position t is taught by the target at t+1+i
        assert torch.equal(draft.hidden, hidden_states[-1][:, : 6 - 1 - i])
        assert torch.equal(draft.teacher(logits), logits[:, 1 + i :])
        # the per-sequence application agrees with MedusaHeads.logits, which generation uses
        torch.testing.assert_close(
            draft.head(draft.hidden)[:, 2], medusa.logits(hidden_states[-1][:, 2], adapter)[:, i]
        )


@pytest.mark.parametrize("kind", ["exit", "medusa"])
def test_objective_recomputation_gives_the_same_loss_and_gradients(kind):
    model = tiny_model("gemma2").requires_grad_(False)  # soft-capped logits
    adapter = ModelAdapter(model)
    torch.manual_seed(0)
    heads = ExitHeads(adapter.fingerprint(), [1, 2]) if kind == "exit" else MedusaHeads(adapter.fingerprint(), 2)
    for parameter in heads.parameters():  # leave the zero initialisation so that gradients reach every weight
        torch.nn.init.normal_(parameter, std=0.05)
    hidden_states, logits = target_pass(model, torch.randint(3, 96, (2, 7)))
    results = []
    for recompute in (False, True):
        heads.zero_grad()
        losses = DistillationObjective(heads, adapter, recompute_logits=recompute)(hidden_states, logits)
        losses.sum().backward()
        results.append((losses.detach(), [p.grad.clone() for p in heads.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0])
    for plain, recomputed in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(plain, recomputed)
    assert all(p.grad is not None for p in heads.parameters()) and not any(p.requires_grad for p in model.parameters())
    assert len(list(DistillationObjective(heads, adapter).parameters())) == len(list(heads.parameters()))


def test_measure_costs_times_every_draft():
    model = tiny_model("llama")
    adapter = ModelAdapter(model)
    tokens = torch.randint(3, 96, (1, 20))
    costs = measure_costs(adapter, ExitHeads(adapter.fingerprint(), [1, 2]), tokens, repeats=3, max_gamma=2)
    assert costs.step_s > 0 and set(costs.draft_s) == {"exit_1", "exit_2"} and set(costs.verify_s) == {1, 2}
    assert all(costs.c(name) > 0 for name in costs.draft_s) and costs.v(1) > 0 and costs.v(7) == 1.0
    medusa = MedusaHeads(adapter.fingerprint(), 3)
    medusa_costs = measure_costs(adapter, medusa, tokens, repeats=3)
    assert set(medusa_costs.draft_s) == {"medusa_0", "medusa_1", "medusa_2"} and medusa_costs.verify_s == {}


def test_measure_costs_on_a_half_precision_target_with_float32_heads():
    """Training keeps the heads in float32 on a bfloat16 target; their costs are timed in the target's dtype,
    and the heads being trained are left as they are."""
    adapter = ModelAdapter(tiny_model("llama").to(torch.bfloat16))
    tokens = torch.randint(3, 96, (1, 12))
    for heads in (MedusaHeads(adapter.fingerprint(), 2), ExitHeads(adapter.fingerprint(), [1])):
        costs = measure_costs(adapter, heads, tokens, repeats=1)
        assert all(seconds > 0 for seconds in costs.draft_s.values())
        assert all(p.dtype == torch.float32 for p in heads.parameters())


def test_speedups_for_exit_depths_and_a_medusa_chain():
    heads = ExitHeads(tiny_fingerprint(), [1, 2])
    costs = Costs(step_s=1.0, draft_s={"exit_1": 0.1, "exit_2": 0.5})
    table = heads.speedups({"exit_1": 0.8, "exit_2": 0.9}, costs, max_gamma=8)
    assert table["exit_1"]["c"] == 0.1 and (table["exit_1"]["gamma"], table["exit_1"]["speedup"]) == best_gamma(
        0.8, 0.1, 8
    )
    medusa = MedusaHeads(tiny_fingerprint(), 2)
    chain = medusa.speedups(
        {"medusa_0": 0.5, "medusa_1": 0.4}, Costs(1.0, dict.fromkeys(medusa.draft_names(), 0.05)), 8
    )
    assert chain["medusa_1"]["gamma"] == 2
    assert chain["medusa_1"]["speedup"] == pytest.approx((1 + 0.5 + 0.5 * 0.4) / (1 + 0.05))


def test_a_kind_that_lacks_a_method_is_named():
    class Bare(DraftHeads):
        kind = "bare"

    heads = Bare(tiny_fingerprint())
    with pytest.raises(NotImplementedError, match=r"heads of kind 'bare' \(Bare\) do not implement draft_names"):
        heads.draft_names()
    with pytest.raises(NotImplementedError, match=r"heads of kind 'bare' \(Bare\) do not implement from_config"):
        Bare.from_config(None, ModelAdapter(tiny_model("llama")))


def tiny_fingerprint():
    return ModelAdapter(tiny_model("llama")).fingerprint()


def test_state_digest_sees_a_single_bit():
    model = tiny_model("gpt2")
    before = state_digest(model)
    assert state_digest(model) == before
    with torch.no_grad():
        weight = next(model.parameters())
        weight.view(-1)[0] = torch.nextafter(weight.view(-1)[0], torch.tensor(math.inf))
    assert state_digest(model) != before


@pytest.mark.parametrize("kind", ["exit", "medusa"])
def test_objective_and_scores_match_the_definitions(kind):
    model = tiny_model("qwen2")
    adapter = ModelAdapter(model)
    torch.manual_seed(0)
    heads = ExitHeads(adapter.fingerprint(), [1, 3]) if kind == "exit" else MedusaHeads(adapter.fingerprint(), 2)
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter, std=0.05)
    hidden_states, logits = target_pass(model, torch.randint(3, 96, (2, 7)))
    with torch.no_grad():
        pairs = [
            (draft.teacher(logits), draft.head(draft.hidden))
            for draft in heads.distillation_drafts(adapter, hidden_states)
        ]
        kl = DistillationObjective(heads, adapter, loss="kl")(hidden_states, logits)
        ce = DistillationObjective(heads, adapter, loss="soft_ce")(hidden_states, logits)
        tv = DistillationObjective(heads, adapter, loss="tv")(hidden_states, logits)
        sharp = DistillationObjective(heads, adapter, teacher_temperature=0.5)(hidden_states, logits)
        sums = score_sums(heads, adapter, hidden_states, logits)
    torch.testing.assert_close(kl, torch.stack([kl_divergence(p, q).mean() for p, q in pairs]))
    # a teacher at T = 0.5: KL(softmax(p / T) || q), not the same loss
    torch.testing.assert_close(sharp, torch.stack([kl_divergence(p / 0.5, q).mean() for p, q in pairs]))
    assert not torch.allclose(sharp, kl)
    torch.testing.assert_close(ce, torch.stack([soft_cross_entropy(p, q).mean() for p, q in pairs]))
    # 0.9 TV(p, q) + 0.1 KL(p || q), TV = 1 - alpha
    mixed = [0.9 * (1 - acceptance_rate(p, q)).mean() + 0.1 * kl_divergence(p, q).mean() for p, q in pairs]
    torch.testing.assert_close(tv, torch.stack(mixed))
    expected, chain = [], None
    for p, q in pairs:
        agree = top1_agreement(p, q)
        chain = agree if chain is None else chain[:, : agree.shape[1]] * agree  # every earlier draft agreed too
        sums_row = [kl_divergence(p, q).sum(), acceptance_rate(p, q).sum(), agree.sum(), p[..., 0].numel()]
        expected.append(sums_row + [chain.sum()])
    torch.testing.assert_close(sums, torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-5)


def test_a_mask_and_a_draft_vocabulary_change_what_the_loss_averages():
    """The masked loss is the mean over the marked teacher positions; with a draft vocabulary, q and p are the
    softmax of their logits on its tokens only."""
    model = tiny_model("llama")
    adapter = ModelAdapter(model)
    torch.manual_seed(0)
    heads = MedusaHeads(adapter.fingerprint(), 2)
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter, std=0.05)
    hidden_states, logits = target_pass(model, torch.randint(3, 96, (2, 9)))
    mask = torch.rand(2, 9) < 0.5
    ids = torch.tensor(sorted(torch.randperm(model.config.vocab_size)[:40].tolist()))
    vocab = adapter.draft_vocabulary(ids)
    with torch.no_grad():
        drafts = heads.distillation_drafts(adapter, hidden_states)
        masked = DistillationObjective(heads, adapter)(hidden_states, logits, mask)
        reduced = DistillationObjective(heads, adapter, vocab=vocab)(hidden_states, logits)
        for k, draft in enumerate(drafts):
            p, q, keep = draft.teacher(logits), draft.head(draft.hidden), draft.teacher(mask)
            torch.testing.assert_close(masked[k], kl_divergence(p, q)[keep].mean())
            torch.testing.assert_close(reduced[k], kl_divergence(p[..., ids], q[..., ids]).mean())
        sums = score_sums(heads, adapter, hidden_states, logits, mask=mask)
        reduced_sums = score_sums(heads, adapter, hidden_states, logits, vocab=vocab)
        # training's target pass over the draft vocabulary: the target's logits on its rows only
        compact_states, compact_logits = target_pass(model, ids_batch := torch.randint(3, 96, (2, 5)), adapter,
                                                     vocab.compacted())  # fmt: skip
        full_states, full_logits = target_pass(model, ids_batch)
    assert sums[0, 3] == drafts[0].teacher(mask).sum() and sums[1, 3] == drafts[1].teacher(mask).sum()
    for k, draft in enumerate(drafts):  # KL over the draft vocabulary: p and q renormalised on its tokens
        p, q = draft.teacher(logits)[..., ids], draft.head(draft.hidden)[..., ids]
        torch.testing.assert_close(reduced_sums[k, 0].float(), kl_divergence(p, q).sum(), rtol=1e-4, atol=1e-4)
    assert torch.isfinite(reduced_sums).all()
    torch.testing.assert_close(compact_logits, full_logits[..., ids], rtol=1e-4, atol=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(compact_states, full_states, strict=True))


@pytest.mark.parametrize("recompute_logits", [False, True])
def test_the_masked_loss_computes_only_the_marked_positions_with_the_same_value_and_gradient(recompute_logits):
    """The objective runs the LM head and the loss on the marked positions only: its value and its gradient
    equal those of the loss over every position weighted by the mask (an EAGLE head, unrolled; a row with
    no marked position adds nothing)."""
    model = tiny_model("llama")
    adapter = ModelAdapter(model)
    torch.manual_seed(0)
    heads = EagleHeads.from_config(HeadsConfig(kind="eagle", feature_layers=[0, 1], unroll=3, layout="eagle3"), adapter)
    hidden_states, logits = target_pass(model, torch.randint(3, 96, (2, 12)))
    mask = torch.rand(2, 12) < 0.4
    mask[1] = False  # a row of prompt only
    objective = DistillationObjective(heads, adapter, recompute_logits=recompute_logits)
    masked = objective(hidden_states, logits, mask)
    grads = torch.autograd.grad(masked.sum(), list(heads.parameters()))
    reference = []
    for draft in heads.distillation_drafts(adapter, hidden_states):
        weight = draft.teacher(mask).float()
        kl = kl_divergence(draft.teacher(logits), draft.head(draft.hidden))  # every position
        reference.append(draft.weight * (kl * weight).sum() / weight.sum().clamp(min=1))
    reference = torch.stack(reference)
    expected = torch.autograd.grad(reference.sum(), list(heads.parameters()))
    torch.testing.assert_close(masked, reference)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_scores_over_a_draft_vocabulary_are_those_of_its_drafts_spread_over_the_whole_vocabulary(kind):
    """With a draft vocabulary, `score_sums` works on its tokens alone; alpha, top-1 and the chain equal those of
    q spread over the whole vocabulary (-inf off it) against the whole p, and KL that of both renormalised on it."""
    model = tiny_model("llama")
    adapter = ModelAdapter(model)
    torch.manual_seed(0)
    if kind == "medusa":
        heads = MedusaHeads(adapter.fingerprint(), 3)
    else:
        heads = EagleHeads.from_config(HeadsConfig(kind="eagle", feature_layers=[0, 1], unroll=3), adapter)
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter, std=0.05)
    hidden_states, logits = target_pass(model, torch.randint(3, 96, (4, 11)))
    # the target's two best tokens at each position: some drafts agree with it, some do not
    ids = logits.topk(2, dim=-1).indices.flatten().unique()
    vocab = adapter.draft_vocabulary(ids)
    mask = torch.rand(4, 11) < 0.6
    with torch.no_grad():
        sums = score_sums(heads, adapter, hidden_states, logits, vocab, mask)
        expected, chain = [], None
        for draft in heads.distillation_drafts(adapter, hidden_states, vocab):  # q spread over [..., V]
            p, q, keep = draft.teacher(logits), draft.head(draft.hidden), draft.teacher(mask)
            agree = (q.argmax(-1) == p.argmax(-1)).double()
            chain = agree if chain is None else chain[:, : agree.shape[1]] * agree
            alpha = torch.minimum(p.softmax(-1), q.softmax(-1)).sum(-1)
            kl = kl_divergence(p[..., ids], q[..., ids])
            expected.append([kl[keep].sum(), alpha[keep].sum(), agree[keep].sum(), keep.sum(), chain[keep].sum()])
    torch.testing.assert_close(sums, torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    assert 0 < sums[0, 2] < sums[0, 3]  # some drafts agree and some do not: the test tells them apart


def test_the_copy_probe_splits_answer_tokens_by_whether_a_copy_predicts_them():
    """training/probe_copying.py: a token is "copied" where it continues an earlier occurrence of the two tokens
    before it; the split counts each answer token once, and its top-1 sums are those of score_sums on each part."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
    from probe_copying import copyable, lookup_right, split_by_copying

    # index m flags token m + 1: 9 at index 5 continues (1, 2) -> 9 seen at 0-2; 7 at index 6 does not
    assert copyable([1, 2, 9, 4, 1, 2, 9, 7]) == [False, False, False, False, False, True, False, False]
    # lookup drafts the latest continuation: after (1, 2) 9, then 7; the last 9 is copyable but not looked up
    tokens = [1, 2, 9, 4, 1, 2, 7, 1, 2, 9]
    assert [m for m, flag in enumerate(copyable(tokens)) if flag] == [8]
    assert not any(lookup_right(tokens)) and lookup_right([1, 2, 9, 1, 2, 9]) == [False] * 4 + [True, False]
    model = tiny_model("llama")
    adapter = ModelAdapter(model)
    torch.manual_seed(0)
    heads = MedusaHeads(adapter.fingerprint(), 2)
    prompt, answer = [5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11, 12]  # 7 and 8 continue (5, 6) and (6, 7)
    with torch.no_grad():
        table = split_by_copying(model, adapter, heads, None, [{"prompt": prompt, "answer": answer, "category": "x"}])
        flags = torch.tensor([copyable(prompt + answer)])
        mask = torch.zeros(1, 12, dtype=torch.bool)
        mask[0, 5:-1] = True  # the positions whose next token is an answer token
        hidden_states, logits = target_pass(model, torch.tensor([prompt + answer]))
        copied = score_sums(heads, adapter, hidden_states, logits, None, mask & flags)[0]
        other = score_sums(heads, adapter, hidden_states, logits, None, mask & ~flags)[0]
    assert flags[0, 5:-1].tolist() == [False, False, True, True, False, False]
    assert copied[3] == 2 and other[3] == 4  # the first draft is taught at every answer token here
    both = (copied[2] + other[2]) / 6
    row = f"| x | 6 | 1.000 | 1.000 | 0.33 | 0.33 | {copied[2] / 2:.3f} | {other[2] / 4:.3f} | {both:.3f} |"
    assert row in table and table[-1].startswith("| overall | 6 |")
    for ids, share in (([5, 6, 7, 8, 11], "0.833 | 0.833"), ([6, 7, 8, 11, 12], "0.833 | 1.000")):
        # 12 is in neither the vocabulary nor the prompt; 5 is not in the vocabulary but joins it with the prompt
        vocab = adapter.draft_vocabulary(ids)
        with torch.no_grad():
            record = {"prompt": prompt, "answer": answer, "category": "x"}
            table = split_by_copying(model, adapter, heads, vocab, [record])
        assert table[-1].startswith(f"| overall | 6 | {share} | 0.33 | 0.33 |")
    from probe_copying import joined_share

    assert joined_share({1}, [2], [3, 2, 3, 4, 1]) == 3  # 2 from the prompt, the second 3 after the first, 1


def test_the_sampling_probe_agrees_with_score_sums_at_its_limits():
    """training/probe_copying.py --temperature: one draw from q at T=1 is accepted with score_sums' alpha; as T goes
    to 0, p_T of the head's best guess becomes its top-1 agreement; three guesses take more than one, five more; the
    sampling table follows the copy split's, from the same passes."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
    from probe_copying import sampling_sums, split_by_copying

    model = tiny_model("llama")
    adapter = ModelAdapter(model)
    torch.manual_seed(0)
    heads = MedusaHeads(adapter.fingerprint(), 2)
    tokens = torch.randint(0, model.config.vocab_size, (1, 64))
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[0, 8:-1] = True
    with torch.no_grad():
        hidden_states, logits = target_pass(model, tokens)
        reference = score_sums(heads, adapter, hidden_states, logits, None, mask)[0]
        at_one = sampling_sums(heads, adapter, hidden_states, logits, None, mask, 1.0)
        cold = sampling_sums(heads, adapter, hidden_states, logits, None, mask, 1e-4)
        warm = sampling_sums(heads, adapter, hidden_states, logits, None, mask, 0.7)
    assert 0 < reference[2] < reference[3]  # the head agrees at some positions and not at others
    torch.testing.assert_close(at_one[3], reference[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cold[0], reference[2], rtol=1e-4, atol=1e-4)
    assert at_one[4] == cold[4] == reference[3] > 0
    assert warm[0] < warm[1] < warm[2] <= warm[4] and 0 < warm[3] <= warm[4]  # more guesses, more of p_T
    record = {"prompt": tokens[0, :9].tolist(), "answer": tokens[0, 9:].tolist(), "category": "x"}
    with torch.no_grad():
        table = split_by_copying(model, adapter, heads, None, [record], 0.7)
    n = float(warm[4])  # the answer's positions are the mask's: 8 .. 62
    row = f"| overall | {n:.0f} | {warm[0] / n:.3f} | {warm[1] / n:.3f} | {warm[2] / n:.3f} | {warm[3] / n:.3f} |"
    assert table[-1] == row


def test_the_copy_probe_reads_greedy_first_turns_of_a_chat_data_set(tmp_path):
    """training/probe_copying.py --data: per kind, the first --per_kind greedy rows' first turns, the prompt as
    the template renders it for generation and the answer as the model generated it (through its end-of-turn
    token), cut to --max_new_tokens; sampled rows are skipped, a row that is not packed chat is named."""
    import gzip
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
    from probe_copying import data_records

    def row(kind, sampled, user, answer, follow_up=None):
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        if follow_up:
            messages += [{"role": "user", "content": follow_up}, {"role": "assistant", "content": "w9"}]
        return {"kind": kind, "sampled": sampled, "messages": messages}

    rows = [row("qa", True, "w1", "w2 w3"), row("qa", False, "w1 w4", "w5 w6 w7", "w8"),
            row("qa", False, "w2", "w3"), row("rag", False, "w6", "w7")]  # fmt: skip
    path = tmp_path / "heldout.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = chat_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    records = data_records([str(path)], tokenizer, per_kind=1, max_new_tokens=8)
    assert [r["category"] for r in records] == ["qa", "rag"]  # the sampled row and the second greedy qa row left
    assert records[0]["prompt"] == ids(["user", ":", "w1", "w4", "assistant", ":"])
    assert records[0]["answer"] == ids(["w5", "w6", "w7", "</s>"])  # the first turn only
    two = data_records([str(path)], tokenizer, per_kind=2, max_new_tokens=2)
    assert [r["answer"] for r in two] == [ids(["w5", "w6"]), ids(["w3", "</s>"]), ids(["w7", "</s>"])]
    bad = tmp_path / "plain.jsonl"
    bad.write_text(json.dumps({"text": "w1 w2"}) + "\n")
    with pytest.raises(ValueError, match="plain.jsonl: row 1 is not a packed chat row"):
        data_records([str(bad)], tokenizer, 1, 8)
    bad.write_text(json.dumps(row("qa", False, "w1", "w2")) + "\nnot json\n")
    with pytest.raises(ValueError, match="plain.jsonl: row 2 is not a packed chat row"):
        data_records([str(bad)], tokenizer, 5, 8)
