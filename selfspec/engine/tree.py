"""A candidate tree given as data, turned once into the index tensors tree verification needs.

A tree is a list of paths: `[1, 0]` is the node reached by taking head 1's second-best token, then
head 2's best. Node 0 is the root (the pending token); nodes 1..N follow in the order of the sorted
paths (by depth, then ranks), so a parent always comes before its children.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass
class CandidateTree:
    paths: list[tuple[int, ...]]  # sorted; node i+1 is paths[i]
    parent: torch.Tensor  # [N+1] long, parent node of each node (root: 0)
    depth: torch.Tensor  # [N+1] long, 0 for the root
    rank: torch.Tensor  # [N+1] long, the node's rank among its head's top-k (root: 0)
    ancestors: torch.Tensor  # [N+1, D] long: the nodes on the path from the root (exclusive) to each node, padded 0
    visible: torch.Tensor  # [N+1, N+1] bool: node i attends to node j (j is i or an ancestor of i)
    top_k: list[int]  # candidates needed from head d, d = 0..D-1
    levels: list[torch.Tensor]  # levels[d - 1]: the nodes at depth d
    prefixes: list[list[int]]  # prefixes[v]: node ids (root excluded) whose tokens precede node v's successor

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return len(self.top_k)

    @property
    def max_nodes(self) -> int:
        return self.num_nodes

    @classmethod
    def from_paths(cls, paths: list[list[int]] | list[tuple[int, ...]], num_heads: int | None = None) -> CandidateTree:
        """The tree of `paths` (lists of sibling ranks), checked every time; its index tensors are built once per
        distinct tree and shared after that (nothing changes a tree): dynamic and merged trees change shape every
        iteration, among a few shapes that recur, and building one costs a few hundred microseconds of Python."""
        cleaned = []
        for path in paths:
            if not isinstance(path, (list, tuple)) or not path or not all(isinstance(r, int) and r >= 0 for r in path):
                raise ValueError(f"Tree path {path!r} must be a non-empty list of non-negative integer ranks.")
            cleaned.append(tuple(path))
        if not cleaned:
            raise ValueError("A candidate tree needs at least one path.")
        if len(set(cleaned)) != len(cleaned):
            raise ValueError("The candidate tree lists a path twice.")
        present = set(cleaned)
        for path in cleaned:
            if len(path) > 1 and path[:-1] not in present:
                raise ValueError(f"Tree path {list(path)} has no parent path {list(path[:-1])} in the tree.")
        ordered = tuple(sorted(cleaned, key=lambda p: (len(p), p)))
        max_depth = max(len(p) for p in ordered)
        if num_heads is not None and max_depth > num_heads:
            raise ValueError(f"The candidate tree is {max_depth} deep, but there are only {num_heads} heads.")
        return _built(ordered)

    @classmethod
    def _build(cls, ordered: tuple[tuple[int, ...], ...]) -> CandidateTree:
        """The index tensors of checked paths, sorted by depth, then ranks."""
        ordered = list(ordered)
        max_depth = max(len(p) for p in ordered)
        index = {path: i + 1 for i, path in enumerate(ordered)}
        count = len(ordered) + 1
        parent = torch.zeros(count, dtype=torch.long)
        depth = torch.zeros(count, dtype=torch.long)
        rank = torch.zeros(count, dtype=torch.long)
        ancestors = torch.zeros(count, max_depth, dtype=torch.long)
        visible = torch.eye(count, dtype=torch.bool)
        visible[:, 0] = True
        top_k = [0] * max_depth
        for path, node in index.items():
            parent[node] = index.get(path[:-1], 0)
            depth[node] = len(path)
            rank[node] = path[-1]
            top_k[len(path) - 1] = max(top_k[len(path) - 1], path[-1] + 1)
            for level in range(1, len(path) + 1):
                ancestor = index[path[:level]]
                ancestors[node, level - 1] = ancestor
                visible[node, ancestor] = True
        levels = [torch.tensor([index[p] for p in ordered if len(p) == d]) for d in range(1, max_depth + 1)]
        prefixes = [[]] + [[index[path[:level]] for level in range(1, len(path) + 1)] for path in ordered]
        return cls(ordered, parent, depth, rank, ancestors, visible, top_k, levels, prefixes)

    def to(self, device: torch.device) -> CandidateTree:
        move = {name: getattr(self, name).to(device) for name in ("parent", "depth", "rank", "ancestors", "visible")}
        levels = [level.to(device) for level in self.levels]
        return CandidateTree(self.paths, top_k=self.top_k, levels=levels, prefixes=self.prefixes, **move)

    def node_tokens(self, head_scores: torch.Tensor) -> torch.Tensor:
        """Candidate tokens [batch, N]: node (d, r) takes the r-th best token of head d.
        head_scores: [batch, num_heads, V]."""
        best = head_scores[:, : self.max_depth].topk(max(self.top_k), dim=-1).indices  # [batch, D, K]
        nodes = slice(1, None)
        return best[:, self.depth[nodes] - 1, self.rank[nodes]]


@lru_cache(maxsize=1024)
def _built(ordered: tuple[tuple[int, ...], ...]) -> CandidateTree:
    return CandidateTree._build(ordered)
