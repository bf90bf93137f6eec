"""The EAGLE drafter: an `EagleHeads` head drafting chains from the target's features (`selfspec.heads.eagle`).

The head keeps a KV cache of its own, one entry per sequence index i: (f_i, token i+1) -> o_i. Only entries
made of the target's true features stay in it. A draft of G tokens runs G head steps: step 0 takes the
backlog, every (feature, next token) pair committed since the last draft, ending with the feature that gave
the pending token and the pending token itself; steps 1..G-1 feed the head's own output back with the token
just drafted. After the verify pass the G-1 fed-back entries are dropped, and the features of the committed
positions join the backlog. So each row's head sees what it saw in training.

Batches: rows commit different counts, so the backlog is kept right-aligned with a count per row, and the
cache's slots carry a validity flag per row; unused slots are masked, never removed. No host synchronisation.

Dynamic trees (EAGLE-2, one prompt at a time): from the root, the `top_k` best tokens; then, depth by depth, the
`top_k` frontier nodes with the highest cumulative draft log-probability run through the head together (each
attends to its own ancestors' entries) and propose their `top_k` best children; finally the `nodes` best of all
drafted nodes by cumulative log-probability (ancestors come first) make the tree that one pass verifies. The
candidates are deterministic, so the tree rule keeps the output exact, greedy or sampled.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..adapter import CallVocabulary, ModelAdapter, additive_mask, draft_head_size
from ..engine.drafter import Draft, Drafter, Processing, Verified, draft_chain
from ..engine.state import DecodeState
from ..engine.tree import CandidateTree
from ..heads import EagleHeads


def append_right_aligned(old, old_counts, new, new_counts):
    """Per row b, the last old_counts[b] entries of `old` [batch, W, F] followed by the first new_counts[b] of
    `new` [batch, P, F], right-aligned in [batch, W + P, F] (the slots before them hold filler); and the counts."""
    width, extra = old.shape[1], new.shape[1]
    slot = torch.arange(width + extra, device=new.device)[None, :]
    counts = old_counts + new_counts
    k = slot - (width + extra - counts)[:, None]  # the entry's place in row b's sequence (< 0: filler)
    source = torch.where(k < old_counts[:, None], width - old_counts[:, None] + k, width + k - old_counts[:, None])
    index = source.clamp(0, width + extra - 1)[..., None].expand(-1, -1, new.shape[-1])
    return torch.cat([old, new], dim=1).gather(1, index), counts


@dataclass(frozen=True)
class DynamicTree:
    """The shape of EAGLE-2's dynamic draft trees: `nodes` candidates verified in one pass (the budget), from
    `top_k` children per expanded node and `top_k` expanded nodes per depth, at most `depth` deep."""

    nodes: int = 8
    top_k: int = 3
    depth: int = 4

    def __post_init__(self):
        for name in ("nodes", "top_k", "depth"):  # counts: a float or a bool would fail only in generate
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"tree={self.__dict__}: {name} must be a whole number of at least 1, got {value!r}.")
            object.__setattr__(self, name, int(value))
        if not (self.nodes >= 1 and self.top_k >= 1 and self.depth >= 1):
            raise ValueError(f"tree={self.__dict__}: nodes, top_k and depth must be at least 1.")

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def max_nodes(self) -> int:
        return self.nodes


class EagleDrafter(Drafter):
    """Drafts with an EAGLE head: reads the target's features at `heads.features`, one head step per token."""

    check_drafts = False

    def __init__(
        self, adapter: ModelAdapter, heads: EagleHeads, vocab=None, confidence: float | None = None, tree=None
    ):
        super().__init__(confidence)
        self.adapter, self.heads, self.vocab = adapter, heads, vocab
        self._vocab = CallVocabulary(vocab, adapter.lm_head)  # joined by each call's tokens (vocab.context)
        self.tree = tree  # a DynamicTree: draft trees instead of chains
        self.hidden_layers = heads.features
        self._cache = DynamicCache()
        self._valid = self._backlog = self._counts = self._outputs = None
        self._fed_back = 0  # entries of the current draft that hold fed-back outputs (dropped after verifying)

    @classmethod
    def from_heads(cls, heads: EagleHeads, adapter: ModelAdapter, exit_layer, tree, vocab, confidence):
        """The drafter of an EAGLE head: chains, or dynamic trees of the shape `tree` gives as a dict."""
        if exit_layer is not None:
            raise ValueError("exit_layer does not apply to an EAGLE head: it drafts from the target's features.")
        if tree is not None and not isinstance(tree, dict):
            raise ValueError(
                f"tree={tree!r}: an EAGLE head drafts dynamic trees, given as a dict such as "
                "{'nodes': 8, 'top_k': 3, 'depth': 4} (paths of ranks are for Medusa heads)."
            )
        try:
            shape = DynamicTree(**tree) if tree else None
        except TypeError as error:
            raise ValueError(f"tree={tree!r}: expected the keys nodes, top_k and depth ({error}).") from error
        if shape is not None and shape.top_k > adapter.vocab_size:
            raise ValueError(f"tree={tree!r}: top_k {shape.top_k} exceeds the model's {adapter.vocab_size} tokens.")
        return cls(adapter, heads, vocab, confidence, shape)

    @property
    def name(self) -> str:
        return "eagle"

    def estimated_cost(self) -> float:
        """c from the weights a draft token reads: the head's layers and the (draft) LM head, over the target's
        layers and LM head."""
        head = sum(p.numel() for p in self.heads.parameters())
        head -= sum(p.numel() for p in self.heads.draft_lora.parameters()) if self.heads.draft_lora else 0
        target = sum(p.numel() for p in self.adapter.layers.parameters())
        target += sum(p.numel() for p in self.adapter.lm_head.parameters())
        return (head + draft_head_size(self.adapter.lm_head, self.vocab, self.heads.draft_lora)) / target

    def _features(self, hidden: dict) -> torch.Tensor:
        return torch.cat([hidden[layer] for layer in self.hidden_layers], dim=-1)

    def begin(self, state: DecodeState, hidden: dict) -> None:
        """The prompt's features wait in the backlog (each row's padding excluded); the head's cache is empty."""
        self._vocab.begin(state.sequences, state.mask)
        features = self._features(hidden)  # [batch, T, F]
        self._cache = DynamicCache()
        self._valid = torch.zeros(state.batch_size, 0, dtype=torch.bool, device=features.device)
        self._backlog, self._counts = features, features.shape[1] - state.pad_offset
        self._fed_back = 0

    def _mask(self, new_valid: torch.Tensor) -> torch.Tensor:
        """Float mask [batch, 1, n, S + n] for n new entries: the valid cached slots and, causally, the valid new
        ones (an invalid entry sees itself, so that nothing is computed from an empty row)."""
        n = new_valid.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=new_valid.device).tril()
        new = (causal[None] & new_valid[:, None, :]) | torch.eye(n, dtype=torch.bool, device=new_valid.device)[None]
        visible = torch.cat([self._valid[:, None, :].expand(-1, n, -1), new], dim=2)
        return additive_mask(visible, next(self.heads.parameters()).dtype)[:, None]

    def _run(self, state: DecodeState, hidden, tokens, start: int, new_valid) -> torch.Tensor:
        """Head step over entries whose tokens `tokens` [batch, n] sit at sequence indices start..start+n-1 (each
        entry one index before its token); returns the last entry's output [batch, 1, H]."""
        count = tokens.shape[1]
        token_positions = state.position_ids(start, count)
        positions = (token_positions - 1).clamp_min(0)
        outputs = self.heads.step(
            hidden, self.adapter.embed(tokens, token_positions), positions, self._mask(new_valid), self._cache
        )
        self._valid = torch.cat([self._valid, new_valid], dim=1)
        return outputs[:, -1:]

    def _run_backlog(self, state: DecodeState) -> torch.Tensor:
        """The backlog through the head (true features only), ending with the pending token's entry: its output
        [batch, 1, H]. The backlog is then empty."""
        width = min(self._backlog.shape[1], state.length - 1)  # older slots can only be filler
        backlog = self._backlog[:, -width:]
        valid = torch.arange(width, device=backlog.device)[None, :] >= (width - self._counts)[:, None]
        outputs = self._run(state, self.heads.fused(backlog), state.sequences[:, -width:], state.length - width, valid)
        self._backlog, self._counts = backlog[:, :0], torch.zeros_like(self._counts)
        return outputs

    def draft(self, state: DecodeState, gamma: int, process: Processing, do_sample: bool) -> Draft:
        length, vocab = state.length, self._vocab.follow(state.sequences)

        def next_logits(i: int, token: torch.Tensor) -> torch.Tensor:
            if i == 0:
                self._outputs = self._run_backlog(state)
            else:  # the head's own output fed back, with the token drafted last
                valid = torch.ones(state.batch_size, 1, dtype=torch.bool, device=token.device)
                self._outputs = self._run(state, self._outputs, token, length - 1 + i, valid)
                self._fed_back += 1
            return self.heads.logits(self._outputs[:, 0], self.adapter, vocab)

        return draft_chain(state, gamma, process, do_sample, next_logits, self.confidence)

    def draft_tree(self, state: DecodeState):
        """A dynamic tree (see the module docstring) for one prompt: (the tree, node tokens [1, N], the draft
        logits [1, N+1, V] at the root and each node, zeros at nodes that were not expanded)."""
        shape, length, vocab = self.tree, state.length, self._vocab.follow(state.sequences)
        root = self._run_backlog(state)
        logits = {0: self.heads.logits(root[:, 0], self.adapter, vocab)[0]}  # node -> [V]
        outputs, tokens, parent, score, path = {0: root}, {}, {0: None}, {0: 0.0}, {0: ()}
        frontier = self._children(0, logits[0], tokens, parent, score, path)
        true_slots = self._valid[0].clone()  # the cache's slots so far; fed-back entries follow
        speculative: list[int] = []  # the node of each fed-back entry in the head's cache, in order
        token_position = state.position_ids(length - 1, 1)  # the pending token's position
        for depth in range(1, shape.depth):
            expand = sorted(frontier, key=lambda node: -score[node])[: shape.top_k]
            visible = torch.tensor(
                [[self._is_ancestor(slot, node, parent) for slot in speculative + expand] for node in expand],
                dtype=torch.bool,
            )
            ids = torch.tensor([[tokens[node] for node in expand]], device=root.device)
            positions = (token_position + depth).expand(1, len(expand))
            hidden = torch.cat([outputs[parent[node]] for node in expand], dim=1)
            mask = self._tree_mask(true_slots, visible)
            out = self.heads.step(hidden, self.adapter.embed(ids, positions), positions - 1, mask, self._cache)
            speculative += expand
            self._fed_back += len(expand)  # dropped after the verify pass, with their slots' flags
            self._valid = torch.cat([self._valid, self._valid.new_zeros(1, len(expand))], dim=1)
            node_logits = self.heads.logits(out[0], self.adapter, vocab)  # [k, V]
            frontier = []
            for index, node in enumerate(expand):
                outputs[node], logits[node] = out[:, index : index + 1], node_logits[index]
                frontier += self._children(node, node_logits[index], tokens, parent, score, path)
        kept = sorted(tokens, key=lambda node: (-score[node], len(path[node])))[: shape.nodes]
        tree = CandidateTree.from_paths([list(path[node]) for node in kept])
        order = {tuple(p): node for node, p in ((n, path[n]) for n in kept)}
        nodes = [order[p] for p in tree.paths]
        node_tokens = torch.tensor([[tokens[node] for node in nodes]], device=root.device)
        zeros = torch.zeros_like(logits[0])
        node_logits = torch.stack([logits[0]] + [logits.get(node, zeros) for node in nodes])[None]
        return tree.to(root.device), node_tokens, node_logits

    def _children(self, node: int, logits: torch.Tensor, tokens, parent, score, path) -> list[int]:
        """Add `node`'s `top_k` best children (by draft log-probability) to the tree being grown; their ids."""
        best = logits.float().log_softmax(dim=-1).topk(self.tree.top_k)
        children = []
        for rank, (value, token) in enumerate(zip(best.values.tolist(), best.indices.tolist(), strict=True)):
            child = len(parent)
            tokens[child], parent[child], score[child] = token, node, score[node] + value
            path[child] = (*path[node], rank)
            children.append(child)
        return children

    @staticmethod
    def _is_ancestor(candidate: int, node: int, parent: dict) -> bool:
        """Whether `candidate` is `node` or one of its ancestors."""
        while node is not None:
            if node == candidate:
                return True
            node = parent[node]
        return False

    def _tree_mask(self, true_slots: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Float mask [1, 1, k, S + extra] for k tree entries: the valid ones of the S `true_slots`, and the
        fed-back entries (then the new ones) that `visible` [k, extra] allows."""
        seen = torch.cat([true_slots[None, :].expand(visible.shape[0], -1), visible.to(true_slots.device)], dim=1)
        return additive_mask(seen, next(self.heads.parameters()).dtype)[None, None]

    def accept(self, verified: Verified) -> None:
        """Drop the fed-back entries; the features of the committed positions join the backlog."""
        if self._fed_back:
            ModelAdapter.crop(self._cache, self._fed_back)
            self._valid = self._valid[:, : -self._fed_back]
            self._fed_back = 0
        features = self._features(verified.hidden)  # [batch, P, F] over the pass's positions
        path = verified.path[..., None].expand(-1, -1, features.shape[-1])
        committed = features.gather(1, path)  # in the order they were committed
        self._backlog, self._counts = append_right_aligned(
            self._backlog, self._counts, committed, verified.num_accepted + 1
        )

    def select_rows(self, rows: torch.Tensor) -> None:
        self._cache.batch_select_indices(rows)
        self._valid, self._backlog, self._counts = self._valid[rows], self._backlog[rows], self._counts[rows]
