"""The accept-reject rule on hand-made p and q: its exact output distribution must be p.

Two kinds of check. Analytic: the distribution of the committed token is assembled from the rule's own
pieces (its acceptance probability, measured over a uniform grid of u, and its residual vector), and
must equal p. Sampled: the vectorised rule runs on 200,000 rows at once and the empirical distribution
of what it commits must match p (first token) and the joint target law (two drafts).
"""

from __future__ import annotations

import pytest
import torch

from selfspec.engine import verify
from selfspec.engine.drafter import Draft
from selfspec.engine.tree import CandidateTree
from selfspec.engine.verify import (
    accept_greedy,
    accept_sampling,
    acceptance_mass,
    candidates_mass,
    residual_distribution,
)


def dist(*values: float) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return t / t.sum()


CASES = {
    "generic": (dist(0.5, 0.3, 0.15, 0.05), dist(0.1, 0.2, 0.3, 0.4)),
    "q zero where p is not": (dist(0.4, 0.3, 0.2, 0.1), dist(0.0, 0.0, 0.5, 0.5)),
    "p zero where q is not": (dist(0.0, 0.0, 0.5, 0.5), dist(0.4, 0.3, 0.2, 0.1)),
    "p equals q": (dist(0.25, 0.25, 0.4, 0.1), dist(0.25, 0.25, 0.4, 0.1)),
    "one-hot p": (dist(0, 0, 1, 0), dist(0.3, 0.3, 0.2, 0.2)),
    "one-hot q": (dist(0.3, 0.3, 0.2, 0.2), dist(0, 1, 0, 0)),
    "disjoint supports": (dist(0.6, 0.4, 0, 0), dist(0, 0, 0.7, 0.3)),
}


def acceptance_probability(p_x: float, q_x: float, grid: int = 100_000) -> float:
    """P(accept) of the implemented test u * q < p, u uniform on [0, 1), over a fine grid of u."""
    u = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    return ((u * q_x) < p_x).double().mean().item()


@pytest.mark.parametrize("case", CASES)
def test_committed_token_distribution_is_p_analytically(case):
    p, q = CASES[case]
    residual = residual_distribution(p, q)
    assert torch.all(residual >= 0) and torch.isclose(residual.sum(), torch.tensor(1.0, dtype=torch.float64))
    committed = torch.zeros_like(p)
    for x in range(len(p)):
        if q[x] == 0:
            continue  # never drafted
        accept = acceptance_probability(p[x].item(), q[x].item())
        committed[x] += q[x] * accept
        committed += q[x] * (1 - accept) * residual
    torch.testing.assert_close(committed, p, atol=1e-4, rtol=0)


def test_residual_is_normalised_positive_part():
    p, q = dist(0.5, 0.3, 0.15, 0.05), dist(0.1, 0.2, 0.3, 0.4)
    expected = torch.tensor([0.4, 0.1, 0.0, 0.0], dtype=torch.float64) / 0.5
    torch.testing.assert_close(residual_distribution(p, q), expected)
    # no draft (q = 0): the residual is p itself, which is how the bonus token is drawn
    torch.testing.assert_close(residual_distribution(p, torch.zeros_like(p)), p)
    # p == q: nothing to correct; p is returned rather than 0/0
    torch.testing.assert_close(residual_distribution(p, p.clone()), p)


def test_acceptance_mass_is_one_minus_total_variation():
    p, q = dist(0.5, 0.3, 0.15, 0.05), dist(0.1, 0.2, 0.3, 0.4)
    tv = 0.5 * (p - q).abs().sum()
    torch.testing.assert_close(acceptance_mass(p, q), 1 - tv)


def test_a_drafts_acceptance_mass_is_the_dense_one_for_point_masses_and_for_scores():
    torch.manual_seed(0)
    p, tokens, scores = torch.randn(2, 3, 11).softmax(dim=-1), torch.randint(0, 11, (2, 3)), torch.randn(2, 3, 11)
    for draft in (Draft.point_mass(tokens), Draft(tokens, scores)):  # the point mass: p at the token, no dense q
        expected = acceptance_mass(p, draft.probabilities(11))
        torch.testing.assert_close(draft.acceptance_mass(p), expected)
    torch.testing.assert_close(Draft.point_mass(tokens).acceptance_mass(p), p.gather(-1, tokens[..., None])[..., 0])


def test_a_tree_steps_alpha_is_ps_mass_on_the_candidates_it_could_take():
    tree = CandidateTree.from_paths([[0], [1], [0, 0]])  # nodes 1 = [0], 2 = [1] (a leaf), 3 = [0, 0]
    node_tokens = torch.tensor([[5, 7, 2], [5, 7, 2]])
    p = torch.randn(2, 2, 8, generator=torch.Generator().manual_seed(0)).softmax(dim=-1)
    stood = torch.tensor([[0, 1], [0, 2]])  # row 0 took node 1 (it has a child), row 1 took the leaf node 2
    mass, tested = candidates_mass(p, stood, node_tokens, tree)
    expected = torch.stack([p[:, 0, 5] + p[:, 0, 7], torch.stack([p[0, 1, 2], torch.tensor(0.0)])], dim=1)
    torch.testing.assert_close(mass, expected)
    assert tested.tolist() == [[True, True], [True, False]]  # a leaf offers nothing to test


ROWS = 200_000


def _sampled_rule(p_rows: torch.Tensor, q_rows: torch.Tensor, seed: int = 0):
    """Run accept_sampling on ROWS copies: drafts drawn from q, as the drafter draws them."""
    torch.manual_seed(seed)
    gamma = q_rows.shape[0]
    p = p_rows.float().expand(ROWS, -1, -1).contiguous()  # [ROWS, G+1, V]
    q = q_rows.float().expand(ROWS, -1, -1).contiguous()  # [ROWS, G, V]
    drafts = torch.multinomial(q.reshape(-1, q.shape[-1]), 1).reshape(ROWS, gamma)
    return drafts, accept_sampling(p, q, drafts)


@pytest.mark.parametrize("case", CASES)
def test_sampled_first_token_distribution_is_p(case):
    p, q = CASES[case]
    p_rows = torch.stack([p, dist(1, 1, 1, 1)])  # position 2 is the bonus distribution
    drafts, verdict = _sampled_rule(p_rows, q[None])
    first = torch.where(verdict.num_accepted == 1, drafts[:, 0], verdict.next_token)
    empirical = torch.bincount(first, minlength=len(p)).double() / ROWS
    # 5 standard errors of a frequency at 200k rows is below 0.006
    torch.testing.assert_close(empirical, p, atol=0.006, rtol=0)


def test_sampled_two_drafts_follow_the_joint_target_law():
    """Two drafts with position-dependent p and q: the first two committed tokens are distributed as
    p1(a) p2(b). (p2 does not depend on a here, as when the target's second distribution is fixed.)"""
    p1, p2, p3 = dist(0.5, 0.2, 0.2, 0.1), dist(0.1, 0.6, 0.1, 0.2), dist(0.25, 0.25, 0.25, 0.25)
    q1, q2 = dist(0.25, 0.25, 0.25, 0.25), dist(0.7, 0.1, 0.1, 0.1)
    drafts, verdict = _sampled_rule(torch.stack([p1, p2, p3]), torch.stack([q1, q2]))
    n = verdict.num_accepted
    first = torch.where(n >= 1, drafts[:, 0], verdict.next_token)
    # the second token exists in this iteration only when the first draft was accepted
    kept = n >= 1
    second = torch.where(n[kept] == 2, drafts[kept, 1], verdict.next_token[kept])
    empirical_first = torch.bincount(first, minlength=4).double() / ROWS
    torch.testing.assert_close(empirical_first, p1, atol=0.006, rtol=0)
    empirical_second = torch.bincount(second, minlength=4).double() / kept.sum()
    torch.testing.assert_close(empirical_second, p2, atol=0.01, rtol=0)
    # all accepted: the bonus comes from p3
    bonus = verdict.next_token[n == 2]
    torch.testing.assert_close(torch.bincount(bonus, minlength=4).double() / len(bonus), p3, atol=0.02, rtol=0)


def test_no_drafts_draw_the_next_token_from_p():
    """gamma = 0: nothing to test, the token comes from p_1 itself."""
    p = dist(0.1, 0.0, 0.6, 0.3)
    torch.manual_seed(0)
    verdict = accept_sampling(
        p.float().expand(ROWS, 1, -1).contiguous(), torch.zeros(ROWS, 0, 4), torch.zeros(ROWS, 0, dtype=torch.long)
    )
    assert bool((verdict.num_accepted == 0).all())
    empirical = torch.bincount(verdict.next_token, minlength=4).double() / ROWS
    torch.testing.assert_close(empirical, p, atol=0.006, rtol=0)


def test_a_rule_without_residual_fails_the_same_check(monkeypatch):
    """Resampling from p after a rejection (no residual) is biased; the check above must see it."""
    p, q = CASES["generic"]
    monkeypatch.setattr(verify, "residual_distribution", lambda p_at, q_at: p_at)
    drafts, verdict = _sampled_rule(torch.stack([p, dist(1, 1, 1, 1)]), q[None])
    first = torch.where(verdict.num_accepted == 1, drafts[:, 0], verdict.next_token)
    empirical = torch.bincount(first, minlength=len(p)).double() / ROWS
    assert (empirical - p).abs().max() > 0.05


def test_greedy_keeps_the_matching_prefix_then_the_target_choice():
    # target argmax per position: 2, 0, 3, 1
    scores = torch.tensor([[[0, 1, 5, 2], [9, 1, 1, 1], [0, 0, 0, 7], [0, 4, 0, 0]]], dtype=torch.float32)
    for drafts, accepted, next_token in [
        ([2, 0, 3], 3, 1),  # all match: bonus = argmax of the last position
        ([2, 0, 1], 2, 3),  # third differs: commit the target's choice there
        ([1, 0, 3], 0, 2),  # first differs: later matches do not count
    ]:
        verdict = accept_greedy(scores, torch.tensor([drafts]))
        assert verdict.num_accepted.tolist() == [accepted]
        assert verdict.next_token.tolist() == [next_token]
