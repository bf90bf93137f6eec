"""The drafter interface: everything the decoding loop asks of a source of draft tokens.

A drafter proposes tokens x_1..x_G with the distribution q they were drawn from; the loop verifies them
in one pass of the target and the accept-reject rule (`selfspec.engine.verify`) keeps exactly the tokens the
target would have produced, whatever q is, as long as each x_i really was drawn from q_i (a point mass
for a deterministic proposer). So a drafter decides speed, never output. See docs/design.md.

One iteration, as the loop drives it:

    drafter.available(state)                    may this drafter propose now? (e.g. an n-gram match exists)
    draft = drafter.draft(state, gamma, process, do_sample)        tokens [batch, G <= gamma] and q
    logits, hidden = drafter.verify(target, state, draft)          the target over pending token + drafts
    ... the accept-reject rule, commit ...
    drafter.accept(Verified(...))                                  every drafter, whoever drafted
    drafter.select_rows(rows)                                      rows that finished left the batch
    drafter.end(sequences)                                         the call is over (a cache across calls learns)

`begin(state, hidden)` starts a `generate` call after the prefill. Built-in drafters (`selfspec.drafters`): early
exit, Medusa and EAGLE heads, n-gram prompt lookup, suffix drafting.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .state import DecodeState
from .verify import acceptance_mass, draw

MAX_DRAFT_TOKENS = 32  # more drafts per iteration cannot pay: alpha^32 is negligible for any real draft

# process(tokens [batch, G], logits [batch, P, V], offset) -> processed scores [batch, P, V] of the P
# positions after the committed tokens and tokens[:, :offset + i]
Processing = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


class DrafterContractError(RuntimeError):
    """A drafter returned something the loop cannot verify exactly (wrong shapes, q that is no distribution,
    a token outside the vocabulary)."""


@dataclass
class Draft:
    """What `Drafter.draft` returns: row b proposes tokens[b, :G], token i drawn from q = softmax(scores[b, i]),
    or, with `scores` None, proposed deterministically (q a point mass on it: `Draft.point_mass`)."""

    tokens: torch.Tensor  # [batch, G] long
    scores: torch.Tensor | None  # [batch, G, V] float: processed draft scores; None: point masses

    @classmethod
    def point_mass(cls, tokens: torch.Tensor) -> Draft:
        """Deterministic proposals (n-gram lookup, retrieval ...): q puts all its mass on each proposed token."""
        return cls(tokens, None)

    @classmethod
    def empty(cls, batch: int, device: torch.device) -> Draft:
        """No proposals: the iteration is a plain decoding step."""
        return cls(torch.zeros(batch, 0, dtype=torch.long, device=device), None)

    def first(self, count: int) -> Draft:
        """The first `count` proposals of every row."""
        return Draft(self.tokens[:, :count], None if self.scores is None else self.scores[:, :count])

    def probabilities(self, vocab_size: int) -> torch.Tensor:
        """q [batch, G, V] float32."""
        if self.scores is None:
            q = torch.zeros(*self.tokens.shape, vocab_size, device=self.tokens.device)
            return q.scatter_(-1, self.tokens[..., None], 1.0)
        return self.scores.float().softmax(dim=-1)

    def acceptance_mass(self, p: torch.Tensor) -> torch.Tensor:
        """alpha = sum_x min(p(x), q(x)) at each draft position [batch, G], p [batch, G, V]: for a point mass
        p at its token (no dense q is built)."""
        if self.scores is None:
            return p.gather(-1, self.tokens[..., None]).squeeze(-1).float()
        return acceptance_mass(p, self.probabilities(p.shape[-1]))


@dataclass
class Verified:
    """What one target pass settled, handed to every drafter's `accept`.

    The pass covered P positions (the pending token, then the drafts or tree nodes); row b kept
    `num_accepted[b]` drafts, and the target's distribution at position `last[b]` gave the token that is
    pending now. `path[b, :num_accepted[b] + 1]` are the positions committed in row b, in order (a chain:
    0, 1, 2 ...). `hidden[i]` [batch, P, H] is the target's hidden state at layer `hidden_layers[i]` of the
    union the loop collects (see `Drafter.hidden_layers`), empty when no drafter asked. `own` is True for
    the drafter whose draft this was."""

    num_accepted: torch.Tensor  # [batch] long
    last: torch.Tensor  # [batch] long
    path: torch.Tensor  # [batch, A+1] long
    hidden: dict[int | str, torch.Tensor]
    own: bool


class Drafter(ABC):
    """A source of draft tokens. Subclass it and pass an instance as `SelfSpeculative(model, drafter=...)`.

    Declared capabilities (class attributes, read by the loop):
        hidden_layers: the target's hidden states this drafter reads in `begin` and `accept`: decoder layer
            indices (the layer's output) and/or `FINAL` (after the final norm). () reads none, and the
            target passes skip collecting them.
        max_drafts: the most tokens one `draft` call may return.
        default_drafts: gamma when `SelfSpeculative` is not given `num_draft_tokens` (with adaptive drafting,
            the most it drafts per iteration).
        tree: set when the drafter proposes candidate trees instead of chains: a `CandidateTree` (Medusa's
            fixed shape) or any object whose `max_depth` and `max_nodes` bound the depth and the candidates of
            the trees it drafts (EAGLE's dynamic trees); such a drafter implements `draft_tree`.
        check_drafts: check every draft's values (token range, q at the drafted token), one host sync per
            iteration; the built-in drafters turn it off. Shapes are always checked.

    Args:
        confidence: stop a chain early in an iteration once the drafted token's q is below this (every
            row's, in a batch); `draft_chain` applies it, a drafter that drafts otherwise reads
            `self.confidence` itself. Exact: the stop depends on the drafts alone. None drafts gamma tokens.
    """

    hidden_layers: tuple[int | str, ...] = ()
    max_drafts: int = MAX_DRAFT_TOKENS
    default_drafts: int = 4
    tree = None
    check_drafts: bool = True

    def __init__(self, confidence: float | None = None):
        if confidence is not None and not 0.0 < confidence < 1.0:
            raise ValueError(f"draft_confidence={confidence!r} must be a probability between 0 and 1.")
        self.confidence = confidence

    @property
    def name(self) -> str:
        """How stats and benchmarks label this drafter."""
        return type(self).__name__

    @abstractmethod
    def draft(self, state: DecodeState, gamma: int, process: Processing, do_sample: bool) -> Draft:
        """Up to gamma proposals per row after each row's pending token `state.sequences[:, -1]`.

        `process(tokens, logits, offset)` applies the call's logits processors (temperature, top-k ...) as
        the target's positions will get them; a drafter with logits passes its raw draft logits through it
        (see `draft_chain`) so that q and p are processed alike. With `do_sample`, draw each token from q;
        otherwise propose what you like (greedy keeps drafts that equal the target's argmax)."""

    @abstractmethod
    def estimated_cost(self) -> float:
        """c: one draft token's cost over one plain decoding step of the target (0 for a model-free drafter),
        used by adaptive drafting to choose gamma and between drafters."""

    def tree_cost(self) -> float:
        """Tree drafters: drafting one tree over one plain step, for adaptive drafting. The default is one draft
        token's `estimated_cost` per level of the tree (a head step drafts a whole level)."""
        return self.estimated_cost() * self.tree.max_depth

    def available(self, state: DecodeState) -> bool:
        """Whether this drafter has a proposal for this iteration (an n-gram drafter without a match has
        none; then another drafter, or a plain step, takes the iteration)."""
        return True

    def verify(self, target, state: DecodeState, draft: Draft, hidden_layers=()):
        """The target over each row's pending token and drafts: (logits [batch, G+1, V], hidden states by
        layer). `target` is the loop's `ModelAdapter`. The default is one ordinary pass of the whole model;
        override it only when the draft already computed part of that pass (early exit reuses its layers)."""
        tokens = torch.cat([state.sequences[:, -1:], draft.tokens], dim=1)
        return target_pass(target, state, tokens, hidden_layers)

    def begin(self, state: DecodeState, hidden: dict[int | str, torch.Tensor]) -> None:  # noqa: B027 (optional hook)
        """A `generate` call starts: the prompts are in the cache; `hidden` holds the declared layers' states
        [batch, T, H] over every prompt position (padding included). Reset per-call state here."""

    def accept(self, verified: Verified) -> None:  # noqa: B027 (optional hook)
        """The verify pass's outcome (see `Verified`): roll back what this drafter holds for rejected
        positions, keep what it needs from the committed ones."""

    def select_rows(self, rows: torch.Tensor) -> None:  # noqa: B027 (optional hook)
        """Only `rows` (a [k] long index into the current batch) keep generating: drop the others' state."""

    def end(self, sequences: list[torch.Tensor]) -> None:  # noqa: B027 (optional hook)
        """The `generate` call ended: `sequences[b]` [T_b] is row b of the caller's prompts (as given, padding
        included) followed by what it generated. A drafter that learns across calls keeps what it needs here."""

    def draft_tree(self, state: DecodeState):
        """Tree drafters: (the tree, a `CandidateTree` with its nodes in order; candidate tokens [batch, N] of its
        nodes 1..N; draft logits [batch, N+1, V] at the root and each node, those its children were chosen
        from, zeros where it has none, or None where the candidates are point masses). The loop asks `available`
        first: without a proposal the iteration is a plain step."""
        raise NotImplementedError(f"{self.name} declares a tree but does not implement draft_tree")

    def verify_tree(self, target, state: DecodeState, tree, node_tokens: torch.Tensor, hidden_layers=()):
        """Tree drafters: the target's (logits [batch, N+1, V], hidden by layer) at the root and every node of
        `tree`, in one pass of the whole model with a tree mask."""
        start = state.length - 1
        tokens = torch.cat([state.sequences[:, -1:], node_tokens], dim=1)
        positions = state.position_ids(start, 1) + tree.depth[None, :]  # [batch, N+1]
        mask = target.tree_attention_mask(state.cache, start, tree, state.attention_mask(start))
        return target_pass(target, state, tokens, hidden_layers, mask, positions)


class Drafters(tuple):
    """The drafters of a wrapper in order of preference (`SelfSpeculative.drafters`): a tuple whose repr names each
    one, e.g. `Drafters('ngram', 'eagle')`. An attribute of one drafter read on all of them says which to pick."""

    def __repr__(self) -> str:
        return f"Drafters({', '.join(repr(part.name) for part in self)})"

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"{self!r} are {len(self)} drafters, each with its own {name!r}: read it on one of them, "
            f"e.g. spec.drafters[{len(self) - 1}].{name} (the {self[-1].name} drafter)."
        )


def target_pass(
    target, state: DecodeState, tokens: torch.Tensor, hidden_layers=(), attention_mask=None, positions=None
):
    """All layers of the target over `tokens` [batch, n] at the sequence indices from the pending token on:
    (logits [batch, n, V], {layer: hidden [batch, n, H]} for `hidden_layers`)."""
    start, count = state.length - 1, tokens.shape[1]
    positions = state.position_ids(start, count) if positions is None else positions
    mask = state.attention_mask(start + count) if attention_mask is None else attention_mask
    if not hidden_layers:
        return target.forward(tokens, positions, state.cache, mask), {}
    return target.forward_capturing(tokens, positions, state.cache, mask, layers=hidden_layers)


def pick(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """A token per row from processed scores [batch, V]: sampled from softmax, or the argmax."""
    if do_sample:
        return draw(scores.softmax(dim=-1))
    return scores.argmax(dim=-1)


def draft_chain(
    state: DecodeState,
    gamma: int,
    process: Processing,
    do_sample: bool,
    next_logits: Callable[[int, torch.Tensor], torch.Tensor],
    confidence: float | None = None,
) -> Draft:
    """Draft up to gamma tokens one after the other from raw draft logits: `next_logits(i, token)` gives
    [batch, V] for draft position i, given the token [batch, 1] before it (the pending token for i = 0).
    Each position is processed with its own prefix, as the target's positions will be. With `confidence`,
    drafting stops once every row's drafted token has q below it (one host sync per position): a draft
    that is unsure of itself is likely rejected, and a shorter verify costs less."""
    token, drafted, scores = state.sequences[:, -1:], [], []
    for i in range(gamma):
        logits = next_logits(i, token)[:, None]  # [batch, 1, V]
        drafts = torch.cat(drafted, dim=1) if drafted else state.sequences[:, :0]
        score = process(drafts, logits, i)[:, 0]  # [batch, V]
        token = pick(score, do_sample)[:, None]
        drafted.append(token)
        scores.append(score)
        if confidence is not None and i + 1 < gamma:
            q_token = score.softmax(dim=-1).gather(1, token)  # [batch, 1]
            if bool((q_token < confidence).all()):
                break
    return Draft(torch.cat(drafted, dim=1), torch.stack(scores, dim=1))


def check_draft(drafter: Drafter, draft: Draft, batch: int, gamma: int, vocab_size: int) -> None:
    """Raise `DrafterContractError` naming the drafter and the problem when `draft` cannot be verified."""
    where = f"{drafter.name}.draft"
    if not isinstance(draft, Draft):
        raise DrafterContractError(f"{where} returned {type(draft).__name__}; it must return a selfspec Draft.")
    tokens, scores = draft.tokens, draft.scores
    if tokens.dtype != torch.long or tokens.ndim != 2 or tokens.shape[0] != batch or tokens.shape[1] > gamma:
        raise DrafterContractError(
            f"{where} returned tokens of shape {tuple(tokens.shape)} and dtype {tokens.dtype}; expected long "
            f"[{batch}, G] with G <= {gamma} (the batch and the gamma it was asked for)."
        )
    if scores is not None and (scores.shape != (*tokens.shape, vocab_size) or not scores.is_floating_point()):
        raise DrafterContractError(
            f"{where} returned scores of shape {tuple(scores.shape)} ({scores.dtype}); expected floating "
            f"[{batch}, {tokens.shape[1]}, {vocab_size}] (q = softmax over the model's vocabulary), or None "
            "for point masses."
        )
    if not drafter.check_drafts or tokens.shape[1] == 0:
        return
    if bool(((tokens < 0) | (tokens >= vocab_size)).any()):
        raise DrafterContractError(f"{where} proposed a token outside the vocabulary 0..{vocab_size - 1}.")
    if scores is None:
        return
    if bool(torch.isnan(scores).any()) or bool((scores == float("inf")).any()):
        raise DrafterContractError(f"{where} returned NaN or +inf scores: q is not a distribution.")
    if bool((scores.gather(-1, tokens[..., None]) == float("-inf")).any()):
        raise DrafterContractError(
            f"{where} proposed a token its own q gives probability 0: a draft must be drawn from q, or be "
            "a point mass (Draft.point_mass)."
        )
