"""Property-based tests (hypothesis) of the accept-reject rule and the tree rule.

p and q are drawn over small vocabularies as the library receives them: logits (random, masked with
-inf, tied, one-hot, very peaked, flat; in float32, float16 or bfloat16, as a model emits them) go through
`process_scores` (float32, optionally a temperature) and a softmax. Pairs may be equal, disjoint, nearly
equal, or have a one-hot q.

The law of what a rule commits is assembled exactly from the rule's own code: the uniform u is replaced
by the midpoint of each interval on which the test `u * q < p` is constant (floating-point
multiplication by q > 0 is monotone in u, so acceptance is {u < t} with t = p/q up to rounding, and the
midpoint of [0, t) and of [t, 1) decides the whole interval; a fine grid checks t itself), and the
sampler is replaced by a recorder of the distribution it is handed. The committed tokens, continued by
the target itself, must then have the target's joint law. Every distribution handed to a sampler must be
finite, non-negative and not all zero.
"""

from __future__ import annotations

import itertools
import math
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LogitsProcessorList, TemperatureLogitsWarper

from selfspec.engine import verify
from selfspec.engine.generation import process_scores
from selfspec.engine.tree import CandidateTree
from selfspec.engine.verify import accept_greedy, accept_sampling, accept_tree, inverse_cdf, residual_distribution

ATOL = 1e-5  # float32 arithmetic on probabilities; the rule itself is exact
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
NEG_INF = float("-inf")

LOGIT_KINDS = ["random", "masked", "ties", "one_hot", "peaked", "flat"]
MODEL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ----------------------------------------------------------------------------------------- strategies
@st.composite
def logits(draw, vocab: int, kind: str | None = None) -> torch.Tensor:
    """Logits [V] as a model emits them: in float32, float16 or bfloat16, at least one finite."""
    kind = kind or draw(st.sampled_from(LOGIT_KINDS))
    values = torch.tensor(draw(st.lists(st.floats(-8, 8, width=32), min_size=vocab, max_size=vocab)))
    keep = draw(st.integers(0, vocab - 1))  # a token that stays allowed
    if kind == "masked":
        banned = torch.tensor(draw(st.lists(st.booleans(), min_size=vocab, max_size=vocab)))
        banned[keep] = False
        values[banned] = NEG_INF
    elif kind == "ties":
        values = values.round().clamp(-1, 1)  # three distinct values over the vocabulary
    elif kind == "one_hot":
        values = torch.full((vocab,), NEG_INF)
        values[keep] = 0.0
    elif kind == "peaked":  # the others get e^-100 or less: denormal or zero in float32
        values[keep] += draw(st.floats(60, 110))
    elif kind == "flat":
        values = torch.zeros(vocab)
    return values.to(draw(st.sampled_from(MODEL_DTYPES)))


@st.composite
def probabilities(draw, vocab: int, kind: str | None = None) -> torch.Tensor:
    """float32 probabilities [V], made from logits exactly as selfspec makes p and q."""
    raw = draw(logits(vocab, kind))
    temperature = draw(st.sampled_from([1.0, 1.0, 0.5, 2.0]))
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)] if temperature != 1.0 else [])
    prefix, tokens = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long)
    scores = process_scores(processors, prefix, tokens, raw[None, None])  # [1, 1, V] float32
    assert scores.dtype == torch.float32
    return scores[0, 0].softmax(dim=-1)


@st.composite
def pairs(draw, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, q) float32 [V] each, in one of several relations."""
    relation = draw(st.sampled_from(["independent", "independent", "equal", "disjoint", "one_hot_q", "near"]))
    p = draw(probabilities(vocab))
    if relation == "independent":
        return p, draw(probabilities(vocab))
    if relation == "equal":
        return p, p.clone()
    if relation == "one_hot_q":
        return p, draw(probabilities(vocab, "one_hot"))
    if relation == "near":  # q = p with one token nudged: the residual is tiny and must still be valid
        q = p.clone()
        q[draw(st.integers(0, vocab - 1))] += draw(st.sampled_from([1e-7, 1e-4, -1e-4]))
        q = q.clamp_min(0)
        return p, q / q.sum()
    # disjoint supports
    order = draw(st.permutations(range(vocab)))
    split = draw(st.integers(1, vocab - 1))
    p_logits = torch.tensor(draw(st.lists(st.floats(-8, 8, width=32), min_size=vocab, max_size=vocab)))
    q_logits = torch.tensor(draw(st.lists(st.floats(-8, 8, width=32), min_size=vocab, max_size=vocab)))
    p_logits[list(order[split:])] = NEG_INF
    q_logits[list(order[:split])] = NEG_INF
    return p_logits.softmax(-1), q_logits.softmax(-1)


# ------------------------------------------------------------------------------------------- helpers
def assert_sampler_input(distributions: torch.Tensor) -> None:
    """What may be handed to a sampler: finite, non-negative, not all zero, summing to 1 (rows [..., V])."""
    assert distributions.dtype in (torch.float32, torch.float64)
    assert bool(torch.isfinite(distributions).all()), distributions
    assert bool((distributions >= 0).all()), distributions
    totals = distributions.sum(dim=-1)
    assert bool((totals > 0).all()), distributions
    torch.testing.assert_close(totals, torch.ones_like(totals), atol=ATOL, rtol=0)


class Recorder:
    """Stands in for torch.rand (returns fixed u) and the rule's sampler `verify.draw` (records the rows it is
    handed, [rows, V], and returns fixed choices, or 0)."""

    def __init__(self, u: torch.Tensor | None = None, choices: torch.Tensor | None = None):
        self.u, self.choices, self.handed, self.rand_dtypes = u, choices, [], []

    def rand(self, *size, dtype=None, device=None, generator=None):
        self.rand_dtypes.append(dtype)
        assert tuple(size) == tuple(self.u.shape)
        return self.u.to(dtype or torch.float32)

    def draw(self, distributions, generator=None):
        self.handed.append(distributions.reshape(-1, distributions.shape[-1]).clone())
        if self.choices is not None:
            return self.choices.reshape(distributions.shape[:-1]).clone()
        return torch.zeros(distributions.shape[:-1], dtype=torch.long)


@contextmanager
def recorded(u: torch.Tensor | None = None, choices: torch.Tensor | None = None):
    recorder = Recorder(u, choices)
    with pytest.MonkeyPatch.context() as patch:
        if u is not None:
            patch.setattr(torch, "rand", recorder.rand)
        patch.setattr(verify, "draw", recorder.draw)
        yield recorder


def continued_law(committed: dict[tuple[int, ...], float], target, vocab: int, length: int) -> torch.Tensor:
    """Law of the first `length` tokens when an iteration commits `committed` (token tuple -> probability)
    and the target itself draws the rest: target(prefix) is the target's distribution after prefix."""
    law = torch.zeros(vocab**length, dtype=torch.float64)
    for prefix, weight in committed.items():
        for rest in itertools.product(range(vocab), repeat=length - len(prefix)):
            sequence, probability = prefix + rest, weight
            for k in range(len(prefix), length):
                probability *= float(target(sequence[:k])[sequence[k]])
            law[_index(sequence, vocab)] += probability
    return law


def target_law(target, vocab: int, length: int) -> torch.Tensor:
    return continued_law({(): 1.0}, target, vocab, length)


def _index(sequence: tuple[int, ...], vocab: int) -> int:
    index = 0
    for token in sequence:
        index = index * vocab + token
    return index


# ----------------------------------------------------------------------------------------- residual
@settings(max_examples=150, **SETTINGS)
@given(st.integers(2, 8).flatmap(pairs))
def test_residual_is_a_valid_distribution_on_the_support_of_p(pair):
    p, q = pair
    residual = residual_distribution(p, q)
    assert_sampler_input(residual)
    assert bool((residual[p == 0] == 0).all())  # never a token the target rules out
    positive = (p - q).clamp_min(0)
    if positive.sum() > 0:  # the normalised positive part of p - q
        torch.testing.assert_close(residual, positive / positive.sum(), atol=1e-6, rtol=1e-5)
    else:  # p <= q everywhere (p == q up to rounding): p itself
        assert torch.equal(residual, p)
    # no draft (q = 0): the bonus token is drawn from p itself
    torch.testing.assert_close(residual_distribution(p, torch.zeros_like(p)), p, atol=1e-6, rtol=1e-6)


# -------------------------------------------------------------------------------- acceptance test
@settings(max_examples=60, **SETTINGS)
@given(st.integers(2, 6).flatmap(pairs), st.data())
def test_acceptance_probability_is_min_one_p_over_q(pair, data):
    """The implemented test, run on a fine deterministic grid of u, accepts with probability
    min(1, p(x)/q(x)) to the grid's resolution (plus one rounding step of u * q, which is coarse only for a
    denormal q: an absolute error below 1e-44 in the law), never when p(x) = 0, and always when p(x) >= q(x)
    for a normal q."""
    p, q = pair
    x = data.draw(st.sampled_from(torch.nonzero(q > 0).flatten().tolist()))
    grid = 4096
    u = ((torch.arange(grid, dtype=torch.float64) + 0.5) / grid).float()[:, None]  # [grid, 1]
    p_rows = torch.stack([p, p]).expand(grid, -1, -1)  # [grid, 2, V]: draft position and bonus
    with recorded(u=u):
        verdict = accept_sampling(p_rows, q.expand(grid, 1, -1), torch.full((grid, 1), x))
    accepted = verdict.num_accepted.double().mean().item()
    p_x, q_x = p[x].item(), q[x].item()
    rounding = 2 * 2.0**-149 / q_x  # two of the smallest float32 steps, relative to q(x)
    assert abs(accepted - min(1.0, p_x / q_x)) <= 1 / grid + rounding
    if p_x == 0:
        assert accepted == 0.0
    if p_x >= q_x and q_x >= torch.finfo(torch.float32).tiny:
        assert accepted == 1.0


# ------------------------------------------------------------------------------ exact chain law
@st.composite
def chain_cases(draw):
    """gamma, V and, for every draft prefix, the target's distribution after it (p, also after all
    gamma drafts: the bonus) and the draft's (q), each pair in one of the relations of `pairs`."""
    gamma = draw(st.integers(1, 3))
    vocab = draw(st.integers(2, {1: 6, 2: 4, 3: 3}[gamma]))
    p_table, q_table = {}, {}
    for k in range(gamma + 1):
        for prefix in itertools.product(range(vocab), repeat=k):
            p_table[prefix], q = draw(pairs(vocab))
            if k < gamma:
                q_table[prefix] = q
    return gamma, vocab, p_table, q_table


@settings(max_examples=80, **SETTINGS)
@given(chain_cases())
def test_committed_tokens_follow_the_target_law_exactly(case):
    """Drafts x_k ~ q(x_<k), u_k on both sides of each acceptance threshold, weighted by the interval
    lengths: the committed tokens (accepted drafts, then the residual or bonus draw), continued by the
    target, have the target's joint law over gamma + 1 tokens."""
    gamma, vocab, p_table, q_table = case
    rows = []  # (drafts, u, weight)
    for drafts in itertools.product(range(vocab), repeat=gamma):
        weight = math.prod(q_table[drafts[:k]][drafts[k]].item() for k in range(gamma))
        if weight == 0:
            continue  # never drafted
        sides = []
        for k in range(gamma):
            p_x, q_x = p_table[drafts[:k]][drafts[k]].item(), q_table[drafts[:k]][drafts[k]].item()
            t = min(1.0, p_x / q_x)
            sides.append([(mid, width) for mid, width in ((t / 2, t), ((1 + t) / 2, 1 - t)) if width > 0])
        for choice in itertools.product(*sides):
            rows.append((drafts, [mid for mid, _ in choice], weight * math.prod(width for _, width in choice)))
    p = torch.stack([torch.stack([p_table[d[:k]] for k in range(gamma + 1)]) for d, _, _ in rows])  # [R, G+1, V]
    q = torch.stack([torch.stack([q_table[d[:k]] for k in range(gamma)]) for d, _, _ in rows])  # [R, G, V]
    drafts = torch.tensor([d for d, _, _ in rows])  # [R, G]
    u = torch.tensor([u for _, u, _ in rows], dtype=torch.float32)  # [R, G]
    with recorded(u=u) as recorder:
        verdict = accept_sampling(p, q, drafts)
    (handed,) = recorder.handed  # one draw per row: the residual at the first rejection, or the bonus
    assert_sampler_input(handed)
    assert recorder.rand_dtypes == [torch.float32]
    committed: dict[tuple[int, ...], float] = {}
    for (row_drafts, _, weight), n, distribution in zip(rows, verdict.num_accepted.tolist(), handed, strict=True):
        assert all(p_table[row_drafts[:k]][row_drafts[k]] > 0 for k in range(n))  # never accepts what p excludes
        for token in torch.nonzero(distribution).flatten().tolist():
            key = row_drafts[:n] + (token,)
            committed[key] = committed.get(key, 0.0) + weight * distribution[token].item()
    law = continued_law(committed, lambda prefix: p_table[prefix], vocab, gamma + 1)
    torch.testing.assert_close(law, target_law(lambda prefix: p_table[prefix], vocab, gamma + 1), atol=ATOL, rtol=0)


@settings(max_examples=40, **SETTINGS)
@given(st.integers(1, 4), st.integers(2, 6), st.data())
def test_random_draws_commit_only_tokens_the_rule_allows(gamma, vocab, data):
    """With the real random u and sampler, over many rows: accepted drafts have p > 0, and the token after
    them lies in the support of the residual at that position (of p for the bonus)."""
    rows = 64
    pair_list = [data.draw(pairs(vocab)) for _ in range(gamma)]
    p = torch.stack([pq[0] for pq in pair_list] + [data.draw(probabilities(vocab))])  # [G+1, V]
    q = torch.stack([pq[1] for pq in pair_list])  # [G, V]
    torch.manual_seed(data.draw(st.integers(0, 2**16)))
    drafts = torch.multinomial(q, rows, replacement=True).T.contiguous()  # [rows, G], x_k ~ q_k
    verdict = accept_sampling(p.expand(rows, -1, -1), q.expand(rows, -1, -1), drafts)
    for row in range(rows):
        n, token = verdict.num_accepted[row].item(), verdict.next_token[row].item()
        assert 0 <= n <= gamma
        assert all(p[k, drafts[row, k]] > 0 for k in range(n))
        # the first rejected draft failed u * q < p with u < 1: p <= q there (p > q is always accepted)
        if n < gamma:
            assert p[n, drafts[row, n]] <= q[n, drafts[row, n]]
        source = residual_distribution(p[n], q[n]) if n < gamma else p[gamma]
        assert source[token] > 0 and p[n, token] > 0


def test_uniforms_have_float32_resolution_for_low_precision_inputs():
    p = torch.tensor([[[0.125, 0.875], [0.5, 0.5]]], dtype=torch.bfloat16)
    q = torch.tensor([[[1.0, 0.0]]], dtype=torch.bfloat16)
    with recorded(u=torch.full((1, 1), 0.5)) as recorder:
        accept_sampling(p, q, torch.zeros(1, 1, dtype=torch.long))
    assert recorder.rand_dtypes[0] in (torch.float32, torch.float64)


# -------------------------------------------------------------------------------------- greedy chain
@settings(max_examples=150, **SETTINGS)
@given(st.integers(1, 3), st.integers(1, 6), st.integers(2, 7), st.data())
def test_greedy_keeps_exactly_the_matching_prefix(batch, gamma, vocab, data):
    """Random scores (ties and -inf included), drafts that mostly follow the argmax: accept_greedy keeps
    the longest prefix equal to the argmax (first maximum on ties) and commits the argmax after it."""
    values = st.sampled_from([NEG_INF, -1.0, 0.0, 0.0, 1.0, 2.5, 2.5])
    scores = torch.tensor(
        data.draw(st.lists(values, min_size=batch * (gamma + 1) * vocab, max_size=batch * (gamma + 1) * vocab))
    ).reshape(batch, gamma + 1, vocab)
    scores[..., data.draw(st.integers(0, vocab - 1))] = 0.5  # one finite score per position at least
    scores = scores.to(data.draw(st.sampled_from(MODEL_DTYPES))).float()

    def best(row):  # first maximum, computed without torch
        values = row.tolist()
        return max(range(vocab), key=lambda i: (values[i], -i))

    drafts = torch.tensor([[best(scores[b, k]) for k in range(gamma)] for b in range(batch)])
    corrupt = torch.tensor(
        data.draw(st.lists(st.integers(-1, vocab - 1), min_size=batch * gamma, max_size=batch * gamma))
    )
    corrupt = corrupt.reshape(batch, gamma)
    drafts = torch.where(corrupt >= 0, corrupt, drafts)  # -1: keep the argmax
    verdict = accept_greedy(scores, drafts)
    for b in range(batch):
        n = 0
        while n < gamma and drafts[b, n].item() == best(scores[b, n]):
            n += 1
        assert verdict.num_accepted[b].item() == n
        assert verdict.next_token[b].item() == best(scores[b, n])


# ------------------------------------------------------------------------------------------- trees
@st.composite
def trees(draw, vocab: int, max_nodes: int = 5, max_depth: int = 3) -> CandidateTree:
    """A random candidate tree: sibling ranks distinct and below V, paths given in drawn (unsorted) order."""
    paths: list[tuple[int, ...]] = []
    for _ in range(draw(st.integers(1, max_nodes))):
        parent = draw(st.sampled_from([()] + [path for path in paths if len(path) < max_depth]))
        used = {path[-1] for path in paths if path[:-1] == parent}
        free = [rank for rank in range(vocab) if rank not in used]
        if free:
            paths.append(parent + (draw(st.sampled_from(free)),))
    return CandidateTree.from_paths([list(path) for path in paths])


def node_tokens_from_heads(draw, tree: CandidateTree, vocab: int) -> torch.Tensor:
    """Candidate tokens [1, N] as the Medusa drafter makes them: node (d, r) takes head d's r-th best."""
    heads = [draw(st.permutations(range(vocab))) for _ in range(tree.max_depth)]
    head_scores = torch.tensor(heads, dtype=torch.float32)[None]  # [1, D, V], distinct scores per head
    tokens = tree.node_tokens(head_scores)
    ranking = head_scores[0].argsort(dim=-1, descending=True)
    for i, path in enumerate(tree.paths):  # independent check of the candidate layout
        assert tokens[0, i].item() == ranking[len(path) - 1, path[-1]].item()
    return tokens


def path_nodes(tree: CandidateTree, node: int) -> list[int]:
    """Nodes from the root (exclusive) to `node`, found from the paths alone."""
    if node == 0:
        return []
    path = tree.paths[node - 1]
    return [tree.paths.index(path[:level]) + 1 for level in range(1, len(path) + 1)]


def default_target(vocab: int):
    """The target's distribution after prefixes that are not tree nodes (only the continuation uses them)."""

    def target(prefix: tuple[int, ...]) -> torch.Tensor:
        generator = torch.Generator().manual_seed(_index(prefix, vocab) * 31 + len(prefix))
        return torch.randn(vocab, generator=generator).softmax(-1)

    return target


@st.composite
def tree_cases(draw):
    vocab = draw(st.integers(2, 4))
    tree = draw(trees(vocab))
    node_tokens = node_tokens_from_heads(draw, tree, vocab)
    # the target at each node, after the prompt and the candidate tokens on the node's path
    prefixes = [()] + [
        tuple(node_tokens[0, n - 1].item() for n in path_nodes(tree, v)) for v in range(1, tree.num_nodes + 1)
    ]
    assert len(set(prefixes)) == len(prefixes)  # siblings differ, so nodes are distinct token paths
    p_nodes = {prefix: draw(probabilities(vocab)) for prefix in prefixes}
    fallback = default_target(vocab)
    return vocab, tree, node_tokens, prefixes, lambda prefix: p_nodes[prefix] if prefix in p_nodes else fallback(prefix)


@settings(max_examples=80, **SETTINGS)
@given(tree_cases())
def test_tree_sampling_commits_the_target_law(case):
    """Every joint draw of the target's token at every node (weighted by its probability) is fed to accept_tree,
    whose walk reads the draws at the nodes it reaches: the committed path and token, continued by the target,
    have the target's joint law over depth + 1 tokens (the first committed token is distributed exactly as p
    at the root)."""
    vocab, tree, node_tokens, prefixes, target = case
    p_nodes = torch.stack([target(prefix) for prefix in prefixes])  # [N+1, V]
    supports = [torch.nonzero(row).flatten().tolist() for row in p_nodes]
    choices = torch.tensor(list(itertools.product(*supports)))  # [R, N+1], every joint draw
    rows = choices.shape[0]
    weights = p_nodes.double().gather(1, choices.T).prod(dim=0)  # [R]
    scores = p_nodes.log()  # processed scores whose softmax is p
    reached = []

    def scores_at(node):  # as `generation.TreeScores` is asked: each row's scores at its node
        reached.append(node.clone())
        return scores[node]

    def joint_draw(handed, do_sample):  # row r's draw at its node: choices[r, node]
        assert do_sample and torch.equal(handed, scores[reached[-1]])
        return choices.gather(1, reached[-1][:, None]).squeeze(1)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(verify, "target_token", joint_draw)
        verdict = accept_tree(scores_at, node_tokens.expand(rows, -1), tree, do_sample=True)
    reached = torch.stack(reached, dim=1)  # [R, steps]: each row's node at each step of the walk
    assert torch.equal(verdict.scores, scores[reached])  # the walk hands back what it read
    committed: dict[tuple[int, ...], float] = {}
    for row in range(rows):
        last = verdict.last_node[row].item()
        nodes = path_nodes(tree, last)
        assert verdict.num_accepted[row].item() == len(nodes) == tree.depth[last].item()
        assert tree.ancestors[last, : len(nodes)].tolist() == nodes
        walk = reached[row].tolist()  # the root, the accepted nodes, then the last one while other rows walk on
        assert walk[: len(nodes) + 1] == [0, *nodes] and set(walk[len(nodes) :]) == {last}
        key = tuple(node_tokens[0, n - 1].item() for n in nodes) + (verdict.next_token[row].item(),)
        committed[key] = committed.get(key, 0.0) + weights[row].item()
    length = tree.max_depth + 1
    law = continued_law(committed, target, vocab, length)
    torch.testing.assert_close(law, target_law(target, vocab, length), atol=ATOL, rtol=0)
    # the first committed token alone: exactly p at the root
    first = law.reshape(vocab, -1).sum(dim=1)
    torch.testing.assert_close(first, p_nodes[0].double(), atol=ATOL, rtol=0)


def stopped_law(committed: dict[tuple[int, ...], float], target, vocab: int, length: int, stop: int) -> dict:
    """Law of the tokens up to the first `stop` token or `length` tokens, whichever comes first, when an iteration
    commits `committed` (cut there too) and the target draws the rest."""
    law: dict[tuple[int, ...], float] = {}

    def extend(prefix: tuple[int, ...], weight: float) -> None:
        if len(prefix) == length or (prefix and prefix[-1] == stop):
            law[prefix] = law.get(prefix, 0.0) + weight
            return
        for token, probability in enumerate(target(prefix).tolist()):
            if probability > 0:
                extend(prefix + (token,), weight * probability)

    for sequence, weight in committed.items():
        cut = sequence.index(stop) + 1 if stop in sequence else len(sequence)
        extend(sequence[: min(cut, length)], weight)
    return law


@settings(max_examples=80, **SETTINGS)
@given(tree_cases(), st.data())
def test_the_tree_walk_ends_where_generate_would(case, data):
    """With an end-of-sequence token and a budget of max_drafts + 1 tokens: the walk asks for no node after an
    accepted end of sequence or deeper than max_drafts, accepts at most max_drafts candidates, and what it commits,
    cut at the end of sequence and at the budget as the commit cuts it, has the target's law."""
    vocab, tree, node_tokens, prefixes, target = case
    stop, max_drafts = data.draw(st.integers(0, vocab - 1)), data.draw(st.integers(0, tree.max_depth))
    p_nodes = torch.stack([target(prefix) for prefix in prefixes])  # [N+1, V]
    choices = torch.tensor(list(itertools.product(*[torch.nonzero(row).flatten().tolist() for row in p_nodes])))
    rows = choices.shape[0]
    weights = p_nodes.double().gather(1, choices.T).prod(dim=0)  # [R]
    scores, reached = p_nodes.log(), []

    def scores_at(node):
        reached.append(node.clone())
        return scores[node]

    def joint_draw(handed, do_sample):
        return choices.gather(1, reached[-1][:, None]).squeeze(1)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(verify, "target_token", joint_draw)
        verdict = accept_tree(
            scores_at, node_tokens.expand(rows, -1), tree, True, torch.tensor([stop]), max_drafts=max_drafts
        )
    asked = set(torch.stack(reached, dim=1).flatten().tolist())
    for node in asked:  # no prefix past an end of sequence or past the budget
        assert tree.depth[node] <= max_drafts
        assert stop not in [node_tokens[0, n - 1].item() for n in path_nodes(tree, node)]
    committed: dict[tuple[int, ...], float] = {}
    for row in range(rows):
        nodes = path_nodes(tree, verdict.last_node[row].item())
        assert verdict.num_accepted[row].item() == len(nodes) <= max_drafts
        key = tuple(node_tokens[0, n - 1].item() for n in nodes) + (verdict.next_token[row].item(),)
        committed[key] = committed.get(key, 0.0) + weights[row].item()
    ours = stopped_law(committed, target, vocab, max_drafts + 1, stop)
    theirs = stopped_law({(): 1.0}, target, vocab, max_drafts + 1, stop)
    for sequence in ours.keys() | theirs.keys():
        assert abs(ours.get(sequence, 0.0) - theirs.get(sequence, 0.0)) < ATOL, sequence


@settings(max_examples=60, **SETTINGS)
@given(tree_cases())
def test_the_tree_walk_draws_from_p_at_the_nodes_it_reaches(case):
    """The sampler is handed p (the softmax of the processed scores) at the root, then at each accepted node, and
    nowhere else: a walk that follows token 0 while a child holds it draws depth + 1 times."""
    vocab, tree, node_tokens, prefixes, target = case
    p_nodes = torch.stack([target(prefix) for prefix in prefixes])  # [N+1, V]
    with recorded() as recorder:  # every draw returns token 0
        verdict = accept_tree(p_nodes.log()[None], node_tokens, tree, do_sample=True)
    walk, node = [0], 0
    while zero := [v for v in range(1, tree.num_nodes + 1) if tree.parent[v] == node and node_tokens[0, v - 1] == 0]:
        (node,) = zero
        walk.append(node)
    assert verdict.last_node.tolist() == [node] and verdict.next_token.tolist() == [0]
    handed = torch.cat(recorder.handed)  # [draws, V]
    assert_sampler_input(handed)
    torch.testing.assert_close(handed, p_nodes[walk], atol=1e-6, rtol=0)


@settings(max_examples=120, **SETTINGS)
@given(tree_cases())
def test_tree_greedy_follows_the_argmax_path(case):
    """Greedy: from the root, move to the child whose token is the argmax at the current node while there
    is one; commit the argmax where the walk stops."""
    vocab, tree, node_tokens, prefixes, target = case
    p = torch.stack([target(prefix) for prefix in prefixes])[None]  # [1, N+1, V]
    verdict = accept_tree(p, node_tokens, tree, do_sample=False)
    node = 0
    while True:
        values = p[0, node].tolist()
        best = max(range(vocab), key=lambda i: (values[i], -i))
        children = [v for v in range(1, tree.num_nodes + 1) if path_nodes(tree, v)[:-1] == path_nodes(tree, node)]
        matching = [v for v in children if node_tokens[0, v - 1].item() == best]
        if not matching:
            break
        (node,) = matching
    assert verdict.last_node.tolist() == [node]
    assert verdict.num_accepted.tolist() == [len(path_nodes(tree, node))]
    assert verdict.next_token.tolist() == [best]


# ------------------------------------------------------------------------------------------- sampler
@settings(max_examples=100, **SETTINGS)
@given(st.integers(2, 6).flatmap(probabilities))
def test_inverse_cdf_draws_each_token_with_its_probability(p):
    """On a fine grid of u the sampler picks each token for a share of u equal to its probability (to the grid's
    resolution), never a token of probability 0, not even for the largest u below 1."""
    grid = 4096
    u = ((torch.arange(grid, dtype=torch.float64) + 0.5) / grid)[:, None]
    chosen = inverse_cdf(p.expand(grid, -1), u)
    shares = torch.bincount(chosen, minlength=p.shape[-1]).double() / grid
    torch.testing.assert_close(shares, p.double(), atol=2.0 / grid, rtol=0)
    edges = torch.tensor([[0.0], [torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0)).item()]])
    assert bool((p[inverse_cdf(p.expand(2, -1), edges)] > 0).all())


def test_draw_takes_any_leading_shape_and_follows_the_generator():
    p = torch.tensor([[[0.0, 0.3, 0.7], [0.5, 0.0, 0.5]], [[1.0, 0.0, 0.0], [0.0, 0.0, 2.0]]])  # need not sum to 1
    first = verify.draw(p, torch.Generator().manual_seed(3))
    assert first.shape == (2, 2) and first[1].tolist() == [0, 2]
    assert torch.equal(first, verify.draw(p, torch.Generator().manual_seed(3)))
    draws = verify.draw(p[0, :1].expand(20000, -1))
    assert 0 not in draws.tolist() and abs((draws == 2).double().mean().item() - 0.7) < 0.02
    for bad in ([0.0, 0.0], [float("nan"), 1.0], [-0.5, 1.5], [float("inf"), 1.0]):  # refused, as multinomial does
        with pytest.raises(ValueError, match="negative somewhere, not finite, or all zero"):
            verify.draw(torch.tensor([[0.5, 0.5], bad]))
