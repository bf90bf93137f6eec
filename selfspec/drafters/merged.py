"""Merged trees: several drafters' proposals verified together, in one pass of the target.

The drafters guess differently. A head guesses the next words from the target's features; n-gram lookup and
suffix drafting copy what followed the same words earlier in the text. A chain hybrid has to choose one of them
each iteration; a merged tree takes both: each part's candidates (a tree drafter's tree, a chain drafter's chain
as one path) join one candidate tree, where a prefix they share is one node, and one verify pass with a tree mask
checks them all. The tree rule (`engine.verify.accept_tree`) keeps the longest path the target agrees with.

Exact, greedy and sampled: every candidate is chosen from the text and the drafters' own state (chain parts draft
greedily, from their raw scores), never from the verdict, and the tree rule is exact for any such candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..engine.drafter import Draft, Drafter, DrafterContractError, Processing, Verified
from ..engine.state import DecodeState
from ..engine.tree import CandidateTree


@dataclass(frozen=True)
class MergedShape:
    """The shape the loop reads off a merged tree: how deep its deepest candidate may be, and how many candidates
    it may have (every part's, before shared prefixes merge)."""

    max_depth: int
    max_nodes: int | None


def unprocessed(tokens: torch.Tensor, logits: torch.Tensor, offset: int) -> torch.Tensor:
    """A chain part drafts from its raw scores: its greedy candidates must not depend on the call's sampling."""
    return logits


def token_paths(tree: CandidateTree, node_tokens: list[int]) -> list[tuple[int, ...]]:
    """Each node's tokens from the root down, parents first (`tree`'s node order)."""
    return [tuple(node_tokens[node - 1] for node in tree.prefixes[node]) for node in range(1, tree.num_nodes + 1)]


def merge_paths(parts: list[list[tuple[int, ...]]]) -> tuple[CandidateTree, list[int]]:
    """One candidate tree of the token paths of every part (each part's parents before their children); a path
    several parts propose is one node. Returns the tree and its node tokens in its node order."""
    ranks: dict[tuple[int, ...], tuple[int, ...]] = {}  # token path -> its path of sibling ranks
    children: dict[tuple[int, ...], int] = {}  # token path -> how many children it has so far
    for paths in parts:
        for path in paths:
            if path in ranks:
                continue
            parent = path[:-1]
            rank = children.get(parent, 0)
            children[parent] = rank + 1
            ranks[path] = (*ranks[parent], rank) if parent else (rank,)
    tree = CandidateTree.from_paths(list(ranks.values()))
    tokens = {rank: path[-1] for path, rank in ranks.items()}
    return tree, [tokens[rank] for rank in tree.paths]


class MergedTreeDrafter(Drafter):
    """Drafts one tree of what every part proposes (see the module docstring), for one prompt at a time.

    Args:
        parts: the drafters, at least two and one of them a tree drafter; a chain part proposes its
            `default_drafts` tokens. Parts that run the target's layers themselves (early exit) are refused:
            the merged tree is verified by one ordinary pass.

    The tree is as deep as its deepest part: a chain part's whole chain (n-gram lookup: `prompt_lookup_num_tokens`)
    counts. Near the end of a call, where the deepest candidate would not fit (the last 10 tokens with lookup's
    default, so every token of a call of 10 or fewer), the loop drafts chains: then the first part with a proposal
    drafts alone. `accept` tells each part `own` only where it drafted.
    """

    def __init__(self, parts: list[Drafter]):
        super().__init__()
        parts = list(parts)
        if len(parts) < 2 or not any(part.tree is not None for part in parts):
            raise ValueError(
                f"A merged tree needs two drafters or more, one of them a tree drafter; got {[p.name for p in parts]}."
            )
        for part in parts:
            if type(part).verify is not Drafter.verify or type(part).verify_tree is not Drafter.verify_tree:
                raise ValueError(
                    f"{part.name} runs the target's layers its own way: it cannot join a merged tree, which one "
                    "ordinary pass of the target verifies. Merge n-gram lookup, suffix drafting, Medusa or EAGLE heads."
                )
        self.parts = tuple(parts)
        self.check_drafts = any(part.check_drafts for part in parts)  # the loop checks the chains near a call's end
        counts = [
            getattr(part.tree, "max_nodes", None) if part.tree is not None else part.default_drafts for part in parts
        ]
        nodes = None if None in counts else sum(counts)  # a part without max_nodes: unknown (adaptive=False only)
        self.tree = MergedShape(max(self._depth(part) for part in parts), nodes)
        self.hidden_layers = tuple(dict.fromkeys(layer for part in parts for layer in part.hidden_layers))
        self.max_drafts = max(part.max_drafts for part in parts)
        self.default_drafts = max(part.default_drafts for part in parts)
        self._ready: list[bool] | None = None  # from `available`: which parts propose this iteration
        self._drafted: list[bool] = [False] * len(parts)  # which parts drafted the iteration being verified

    @staticmethod
    def _depth(part: Drafter) -> int:
        return part.tree.max_depth if part.tree is not None else part.default_drafts

    @property
    def name(self) -> str:
        return " + ".join(part.name for part in self.parts)

    def estimated_cost(self) -> float:
        return sum(part.estimated_cost() for part in self.parts)

    def tree_cost(self) -> float:
        """Every part's drafting: a tree part's tree, a chain part's whole chain."""
        return sum(
            part.tree_cost() if part.tree is not None else part.estimated_cost() * part.default_drafts
            for part in self.parts
        )

    def available(self, state: DecodeState) -> bool:
        self._ready = [part.available(state) for part in self.parts]
        return any(self._ready)

    def _take_ready(self, state: DecodeState) -> list[bool]:
        ready = self._ready if self._ready is not None else [part.available(state) for part in self.parts]
        self._ready = None
        return ready

    def draft(self, state: DecodeState, gamma: int, process: Processing, do_sample: bool) -> Draft:
        """A chain (the loop asks for one where the tree's depth does not fit): the first ready part's."""
        ready = self._take_ready(state)
        index = next((index for index, ok in enumerate(ready) if ok), None)
        self._drafted = [i == index for i in range(len(self.parts))]
        if index is None:
            return Draft.empty(state.batch_size, state.sequences.device)
        part = self.parts[index]
        return part.draft(state, min(gamma, part.max_drafts), process, do_sample)

    def draft_tree(self, state: DecodeState):
        """(the merged tree, node tokens [1, N], None: the candidates are chosen deterministically, so the alpha tally
        reads them as point masses)."""
        paths = []
        self._drafted = self._take_ready(state)
        for part, ok in zip(self.parts, self._drafted, strict=True):
            if not ok:
                continue
            if part.tree is not None:
                tree, node_tokens, _ = part.draft_tree(state)
                paths.append(token_paths(tree, node_tokens[0].tolist()))
                deepest = max(map(len, paths[-1]), default=0)
            else:
                chain = part.draft(state, self._depth(part), unprocessed, False).tokens[0].tolist()
                paths.append([tuple(chain[: i + 1]) for i in range(len(chain))])
                deepest = len(chain)
            if deepest > self._depth(part):  # the loop left room for this depth only
                raise DrafterContractError(f"{part.name} drafted {deepest} deep in a merged tree; it may draft "
                                           f"{self._depth(part)}.")  # fmt: skip
        if not any(paths):
            raise DrafterContractError(f"{self.name}: every part said it had a proposal, and none proposed a token.")
        tree, tokens = merge_paths(paths)
        device = state.sequences.device
        return tree.to(device), torch.tensor([tokens], dtype=torch.long, device=device), None

    def begin(self, state: DecodeState, hidden: dict) -> None:
        self._ready = None
        for part in self.parts:
            part.begin(state, hidden)

    def accept(self, verified: Verified) -> None:
        """Every part learns the verdict; `path` and `last` index the merged tree's nodes (or the chain's positions)."""
        self._ready = None
        for part, drafted in zip(self.parts, self._drafted, strict=True):
            part.accept(replace(verified, own=verified.own and drafted))
        self._drafted = [False] * len(self.parts)

    def select_rows(self, rows: torch.Tensor) -> None:
        for part in self.parts:
            part.select_rows(rows)

    def end(self, sequences: list[torch.Tensor]) -> None:
        for part in self.parts:
            part.end(sequences)
