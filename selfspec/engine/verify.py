"""The accept-reject rule: which drafted tokens are kept, and the one token drawn after them.

Speculative sampling (docs/design.md, "The math"), for drafts x_1..x_G with x_i ~ q_i and target p_1..p_{G+1}:
accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection j draw from the residual
max(0, p_j - q_j) / sum(max(0, p_j - q_j)); if all G are accepted draw a bonus token from p_{G+1}.
Every committed token is then distributed exactly as p. Greedy keeps drafts while they equal argmax p_i
and commits argmax p at the first mismatch (or after the last draft).

Everything is vectorised over the batch and the draft positions. A chain's greedy verification never waits for
the host; sampling waits only for the sampler's check of its rows, and the tree walk asks after each level whether a
row walks on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Verdict:
    """Outcome of one verification: `num_accepted[b]` drafts kept in row b, then `next_token[b]`."""

    num_accepted: torch.Tensor  # [batch] long, 0..G
    next_token: torch.Tensor  # [batch] long


def _leading_true(flags: torch.Tensor) -> torch.Tensor:
    """Number of leading True values along the last dimension: [batch, G] bool -> [batch] long."""
    return flags.long().cumprod(dim=-1).sum(dim=-1)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), renormalised; where p <= q everywhere (p == q), p itself: [..., V] -> [..., V].

    With q = 0 (no draft at that position) this is p, which makes the bonus token the same draw.
    The p == q fallback is never reached by an exact rule (a draft from q == p is always accepted); it
    keeps rounding from ever handing a zero or NaN vector to the sampler.
    """
    residual = (p - q).clamp_min(0)
    total = residual.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, residual / torch.where(total > 0, total, 1), p)


def draw(distributions: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `distributions` [..., V] (non-negative, not all zero), token t with probability
    distributions[t] / sum: [..., V] -> [...] long. The same law as `torch.multinomial(rows, 1)`, by the inverse
    of the cumulative distribution (see `inverse_cdf`): a float64 cumulative sum and a binary search, where
    torch.multinomial costs about 1 ms per 49,152-token row on a CPU, which a tree of 9 nodes pays 9 times."""
    rows = distributions.reshape(-1, distributions.shape[-1])
    if not bool(valid_rows(rows).all()):  # as torch.multinomial refuses them
        raise ValueError("draw: a row of the distributions is negative somewhere, not finite, or all zero.")
    u = torch.empty(rows.shape[0], 1, dtype=torch.float64, device=rows.device).uniform_(generator=generator)
    return inverse_cdf(rows, u).reshape(distributions.shape[:-1])


def valid_rows(rows: torch.Tensor) -> torch.Tensor:
    """Which rows of `rows` [..., V] can be sampled from: non-negative, finite and not all zero -> [..., 1] bool. A
    NaN or an infinity makes the row's total non-finite, so the total and the least entry tell."""
    total = rows.sum(dim=-1, keepdim=True)
    return torch.isfinite(total) & (total > 0) & (rows.amin(dim=-1, keepdim=True) >= 0)


def inverse_cdf(rows: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row of `rows` [R, V] and uniform u [R, 1] in [0, 1): the token t whose interval [c(t-1), c(t)) of
    the cumulative sum c holds u * c(V-1). A zero entry has an empty interval and is never chosen; u * total is
    kept strictly below the total, so rounding cannot run past the last token with a positive entry."""
    cumulative = rows.double().cumsum(dim=-1)
    total = cumulative[:, -1:]
    target = torch.minimum(u.double() * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, target, right=True).squeeze(-1)


def accept_greedy(target_scores: torch.Tensor, draft_tokens: torch.Tensor) -> Verdict:
    """Greedy verification. target_scores: [batch, G+1, V]; draft_tokens: [batch, G]."""
    choice = target_scores.argmax(dim=-1)  # [batch, G+1]
    gamma = draft_tokens.shape[1]
    num_accepted = _leading_true(draft_tokens == choice[:, :gamma])
    next_token = choice.gather(1, num_accepted[:, None]).squeeze(1)
    return Verdict(num_accepted, next_token)


def accept_sampling(
    p: torch.Tensor, q: torch.Tensor, draft_tokens: torch.Tensor, generator: torch.Generator | None = None
) -> Verdict:
    """Speculative sampling. p: [batch, G+1, V] target probabilities; q: [batch, G, V] draft
    probabilities the drafts were sampled from; draft_tokens: [batch, G]."""
    p, q = p.float(), q.float()  # u and the test need float32 resolution: low-precision uniforms are biased
    batch, gamma = draft_tokens.shape
    p_draft = p[:, :gamma].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [batch, G]
    q_draft = q.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [batch, G], > 0: x_i was drawn from q_i
    u = torch.rand(batch, gamma, device=p.device, dtype=p.dtype, generator=generator)
    num_accepted = _leading_true(u * q_draft < p_draft)  # u < p/q, i.e. probability min(1, p/q)
    # position num_accepted: the residual after a rejection, or p_{G+1} (q taken as zero) for the bonus; rows are
    # indexed, not gathered over the vocabulary
    rows = torch.arange(batch, device=p.device)
    p_at = p[rows, num_accepted]  # [batch, V]
    if gamma == 0:
        q_at = torch.zeros_like(p_at)
    else:
        rejected = (num_accepted < gamma)[:, None]
        q_at = torch.where(rejected, q[rows, num_accepted.clamp_max(gamma - 1)], 0.0)
    next_token = draw(residual_distribution(p_at, q_at), generator)
    return Verdict(num_accepted, next_token)


def acceptance_mass(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Analytic acceptance rate alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q), per position: [..., V] -> [...]."""
    return torch.minimum(p, q).sum(dim=-1)


def candidates_mass(p: torch.Tensor, stood: torch.Tensor, node_tokens: torch.Tensor, tree) -> tuple:
    """alpha at each step of a tree walk with deterministic candidates: p's mass on the children of the node the
    walk stood on, the chance that the target's token is one of them (one child: min(p, q) for a point mass).
    p: [batch, W, V] the target's distributions along the walk; stood: [batch, W] the node at each step;
    node_tokens: [batch, N]. Returns the mass [batch, W] and whether the node has children [batch, W] (a leaf
    tests nothing)."""
    children = tree.parent[1:] == stood[..., None]  # [batch, W, N]
    at_candidates = p.gather(-1, node_tokens[:, None, :].expand(-1, stood.shape[1], -1))  # [batch, W, N]
    return torch.where(children, at_candidates, 0).sum(dim=-1), children.any(dim=-1)


def target_token(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """The target's token after each row of processed scores [batch, V]: a draw from their softmax, or their argmax.
    A tree walk asks it only at nodes it reaches, whose tokens the target allowed: a processor that leaves such a
    row no token (NaN after softmax) meets `draw`'s error, as it would in a chain or in `model.generate`."""
    return draw(scores.softmax(dim=-1)) if do_sample else scores.argmax(dim=-1)


def rows_at(scores: torch.Tensor):
    """For scores [batch, N+1, V] at every node: the function of node [batch] that returns each row's [batch, V]."""
    rows = torch.arange(scores.shape[0], device=scores.device)
    return lambda node: scores[rows, node]


@dataclass
class TreeVerdict(Verdict):
    last_node: torch.Tensor  # [batch] long: the deepest accepted node (0: the root)
    scores: torch.Tensor  # [batch, S, V] each row's processed scores at step s of the walk: its node at depth s,
    # up to the last one read (which a row's later entries repeat); S covers every row's tokens up to the next
    # token, or up to an accepted end of sequence


def accept_tree(
    scores,
    node_tokens: torch.Tensor,
    tree,
    do_sample: bool,
    stop_tokens: torch.Tensor | None = None,
    max_drafts: int | None = None,
) -> TreeVerdict:
    """Tree verification (`tree` a `CandidateTree`). scores: the target's processed scores at the nodes, either
    [batch, N+1, V] or a function of node [batch] long that returns each row's at its node, [batch, V] (a
    `generation.TreeScores`, which processes only the rows asked for); node_tokens: [batch, N] candidate tokens
    of nodes 1..N.

    Walk from the root: the target's token at the current node (`target_token`: a draw from p there, or its
    argmax) is matched against the node's children; the matching child is accepted and the walk goes on from
    it; at a node none of whose children match, that token comes next. For sampling this is the multi-candidate
    rule of docs/design.md ("The math") with deterministic candidates c_1..c_m: accepting c_1 with probability
    p(c_1), else c_2 with p(c_2) / (1 - p(c_1)), ..., else drawing from p without the c's, commits c_j with
    probability p(c_j) and any other token t with p(t); one draw from p matched against the children has
    exactly that law, so every committed token is distributed as p. For greedy it keeps the path that agrees
    with argmax p, as chain greedy does.

    Only the nodes the walk reaches are read (one to three, where a tree has 10 to 20 nodes): the walk stops once
    every row's walk has ended (a host check per level). It also ends where `generate` would: at an accepted
    candidate in `stop_tokens` [K] (end of sequence: that row's next token is then unused, as the commit cuts at
    the stop token) and at depth `max_drafts` (the token budget less one: the next token is drawn there). Neither
    changes what is committed before the end or within the budget; they keep the walk, and the processors behind
    `scores`, from prefixes `generate` never reaches.
    """
    batch = node_tokens.shape[0]
    if isinstance(scores, torch.Tensor):
        scores = rows_at(scores)
    node = node_tokens.new_zeros(batch)  # each row's deepest accepted node
    read = node  # where each row's scores are read: its node while it walks, then the last one read
    walking = torch.ones(batch, dtype=torch.bool, device=node_tokens.device)
    next_token = node_tokens.new_zeros(batch)
    walked = []
    for depth, nodes in enumerate([*tree.levels, None]):  # the children at each depth, then the deepest's tokens
        walked.append(scores(read))
        token = target_token(walked[-1], do_sample)
        next_token = torch.where(walking, token, next_token)  # kept once the row's walk ends here
        if nodes is None or (max_drafts is not None and depth >= max_drafts):
            break
        match = (tree.parent[nodes] == node[:, None]) & (node_tokens[:, nodes - 1] == token[:, None])  # [batch, L]
        walking = walking & match.any(dim=1)  # siblings differ: one match at most
        node = torch.where(walking, nodes[match.long().argmax(dim=1)], node)
        if stop_tokens is not None:  # an accepted end of sequence: nothing after it is read
            walking = walking & ~torch.isin(token, stop_tokens)
        read = torch.where(walking, node, read)
        if not bool(walking.any()):
            break
    return TreeVerdict(tree.depth[node], next_token, node, torch.stack(walked, dim=1))
