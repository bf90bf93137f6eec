"""Suffix drafting: propose the most frequent continuations of the text's longest earlier match in this prompt and
what has been generated, or in earlier calls' answers where that match is clearly longer (`CACHE_MARGIN`).

Model-free like n-gram lookup, with three differences (the idea of SuffixDecoding, arXiv 2411.04975):
- It remembers. A cache shared across calls holds earlier answers, bounded in tokens and evicted least recently
  used first, so the same task over many inputs, or a revision of an earlier answer, drafts from what came before.
- It counts. Every earlier occurrence of the longest matched suffix votes for what followed it; the draft follows
  the most frequent continuation while its estimated probability (the product of count ratios along the way) stays
  at or above `min_token_prob`.
- Its drafts grow with the match: at most `max_spec_factor` tokens per matched token.

q is a point mass on each proposal, so the accept-reject rule stays exact for greedy and sampled decoding alike.

An index (`SuffixIndex`) maps each pair of consecutive tokens to where it occurred; the longest match is found by
extending the candidates' matches backwards, at most `max_match_length` tokens, most recent occurrence first. Adding
a token costs O(1); a lookup stops once `max_candidates` occurrences share the longest match so far, so it favours
recent text: an older, longer match behind that many recent shorter ones is not found.
"""

from __future__ import annotations

import os
import sys
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..engine.drafter import Draft, Drafter, Processing, Verified
from ..engine.state import DecodeState
from ..engine.tree import CandidateTree
from .memory import SuffixMemory

CACHED_REQUESTS = 10_000  # the cache's default bound in answers
CACHED_TOKENS = 200_000  # the cache's default bound in tokens (13.8 MiB on Python source in SmolLM2's tokens)
# how much longer the cache's match must be than the text's own to be drafted from instead: replaying recorded
# SmolLM2 answers (docs/benchmarks.md), 2 to 8 drafted about as many tokens per pass on Spec-Bench questions and on a
# repeated task, 1 fewer, and never preferring the cache fewer on the repeated task
CACHE_MARGIN = 4


class SuffixIndex:
    """Token sequences and where each token and each pair of tokens occurred in them.

    Sequences are kept as int32 arrays under an id; `extend` appends to one (the text of a call grows), `drop`
    forgets one (eviction). Index entries of dropped sequences are skipped on look-up and purged once they are
    as many as the live ones."""

    def __init__(self):
        self.sequences: OrderedDict[int, array] = OrderedDict()  # id -> tokens; least recently used first
        # the pair a, b (as the key a << 32 | b), or the token a -> where they occurred: int64 entries, each
        # id << 32 | the index of the token after them
        self._pairs: dict[int, array] = {}
        self._singles: dict[int, array] = {}
        self._next_id = 0
        self.tokens = 0  # live tokens
        self._dead = 0  # index entries of dropped sequences not purged yet

    def __len__(self) -> int:
        return len(self.sequences)

    def add(self, tokens) -> int:
        """A new sequence; returns its id."""
        uid, self._next_id = self._next_id, self._next_id + 1
        self.sequences[uid] = array("i")
        self.extend(uid, tokens)
        return uid

    def extend(self, uid: int, tokens) -> None:
        sequence = self.sequences[uid]
        for token in tokens:
            end = len(sequence)
            if end >= 1:
                self._pairs.setdefault(sequence[end - 1] << 32 | token, array("q")).append(uid << 32 | end + 1)
            self._singles.setdefault(token, array("q")).append(uid << 32 | end + 1)
            sequence.append(token)
        self.tokens += len(tokens)

    def touch(self, uid: int) -> None:
        """Mark a sequence as just used (the last to be evicted)."""
        if uid in self.sequences:
            self.sequences.move_to_end(uid)

    def drop(self, uid: int) -> None:
        sequence = self.sequences.pop(uid)
        self.tokens -= len(sequence)
        self._dead += 2 * len(sequence)
        if self._dead > 2 * self.tokens:
            self._purge()

    def clear(self) -> None:
        self.__init__()

    def nbytes(self) -> int:
        """Bytes the index holds: sequences, entry lists and the dictionaries (Python objects included)."""
        size = sum(sys.getsizeof(sequence) for sequence in self.sequences.values())
        for table in (self._pairs, self._singles):
            size += sys.getsizeof(table)
            size += sum(sys.getsizeof(key) + sys.getsizeof(entries) for key, entries in table.items())
        return size

    def _purge(self) -> None:
        for table in (self._pairs, self._singles):
            for key in list(table):
                live = array("q", (entry for entry in table[key] if entry >> 32 in self.sequences))
                if live:
                    table[key] = live
                else:
                    del table[key]
        self._dead = 0

    def candidates(self, context: list[int], max_match: int, max_candidates: int) -> tuple[int, list[tuple]]:
        """The longest suffix of `context` (at most `max_match` tokens) that occurred in these sequences with a
        token after it, and its most recent occurrences (at most `max_candidates`) as (sequence, where the token
        after it is, id). (0, []) when not even the last token occurred with a successor. The scan runs from the most
        recent occurrence and stops at `max_candidates` of the best length so far (the module docstring)."""
        pair = context[-2] << 32 | context[-1] if len(context) >= 2 and max_match >= 2 else None
        # the last pair's occurrences, else the last token's: a pair may have occurred only at the end of a sequence,
        # with nothing after it (the text being generated always ends with its own last pair)
        for entries, known in ((self._pairs.get(pair), 2), (self._singles.get(context[-1]) if context else None, 1)):
            if entries:
                best, found = self._longest(entries, known, context, max_match, max_candidates)
                if found:
                    return best, found
        return 0, []

    def _longest(self, entries: array, known: int, context: list[int], max_match: int, max_candidates: int):
        """`candidates` among `entries`, the occurrences of the last `known` tokens of `context`."""
        best, found = 0, []
        for entry in reversed(entries):
            uid, after = entry >> 32, entry & 0xFFFFFFFF
            sequence = self.sequences.get(uid)
            if sequence is None or after >= len(sequence):
                continue
            length = known
            while length < max_match and length < len(context) and after - length - 1 >= 0:
                if sequence[after - length - 1] != context[-length - 1]:
                    break
                length += 1
            if length > best:
                best, found = length, []
            if length == best:
                found.append((sequence, after, uid))
            if len(found) >= max_candidates:
                break
        return best, found


def token_after(occurrence: tuple, step: int, period_of=None) -> int | None:
    """The token `step` places into an occurrence's continuation (sequence, where it starts, id): past the end of
    the sequence, with the period `period_of(occurrence)` where that is given and not None, else None."""
    sequence, after = occurrence[0], occurrence[1]
    if after + step < len(sequence):
        return sequence[after + step]
    period = period_of(occurrence) if period_of is not None else None
    return sequence[after + step % period] if period else None


def best_continuation(
    occurrences: list[tuple], depth: int, min_token_prob: float, period_of=None
) -> tuple[list[int], float]:
    """Follow the most frequent next token among `occurrences` (sequence, where its continuation starts, id) for
    at most `depth` tokens, while the product of the count ratios stays at or above `min_token_prob`.
    `period_of(occurrence)`: where given and not None, the continuation repeats with that period past the
    sequence's end (the text being generated, caught in a loop)."""
    tokens, probability, alive = [], 1.0, occurrences
    for step in range(depth):
        counts: dict[int, list] = {}
        for occurrence in alive:
            token = token_after(occurrence, step, period_of)
            if token is not None:
                counts.setdefault(token, []).append(occurrence)
        if not counts:
            break
        token, followers = max(counts.items(), key=lambda item: len(item[1]))
        ratio = len(followers) / len(alive)
        if probability * ratio < min_token_prob:
            break
        tokens.append(token)
        probability *= ratio
        alive = followers
    return tokens, probability


def continuation_tree(occurrences: list[tuple], depth: int, nodes: int, min_token_prob: float, period_of=None):
    """The `nodes` most likely continuations of `occurrences` as a tree: {path of sibling ranks: token}. A node's
    probability is the share of the occurrences that continue through it (at least `min_token_prob`); a parent is
    at least as likely as its children, so it is kept before them."""
    level = {(): occurrences}  # path of tokens -> the occurrences that continue along it
    scored = []  # (-probability, depth, token path)
    for step in range(depth):
        below = {}
        for tokens, alive in level.items():
            for occurrence in alive:
                token = token_after(occurrence, step, period_of)
                if token is not None:
                    below.setdefault((*tokens, token), []).append(occurrence)
        level = {path: alive for path, alive in below.items() if len(alive) / len(occurrences) >= min_token_prob}
        scored += [(-len(alive) / len(occurrences), step, path) for path, alive in level.items()]
    ranks = {}  # token path -> rank path: a node's rank among its kept siblings, most frequent first
    for _, _, path in sorted(scored)[:nodes]:
        siblings = sum(1 for other in ranks if len(other) == len(path) and other[:-1] == path[:-1])
        ranks[path] = (*ranks[path[:-1]], siblings) if len(path) > 1 else (siblings,)
    return {rank: path[-1] for path, rank in ranks.items()}


@dataclass(frozen=True)
class SuffixTree:
    """The shape of the suffix drafter's trees: at most `nodes` candidates, at most `depth` deep."""

    nodes: int
    depth: int

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def max_nodes(self) -> int:
        return self.nodes


class SuffixDrafter(Drafter):
    """Suffix drafting (see the module docstring), with vLLM's names for the settings that mean the same there.

    Args:
        num_speculative_tokens: the most tokens one draft proposes (gamma's ceiling and default).
        max_spec_factor: at most this many drafted tokens per matched token (a match of 3 tokens drafts at most 3
            at the default 1.0): a short match is weak evidence.
        min_token_prob: stop drafting once the chain's estimated probability falls below this.
        max_cached_requests: earlier answers kept in the cache shared across calls; 0 switches the cache off
            (the prompt and the text being generated are still searched).
        max_cached_tokens: the cache's bound in tokens; the least recently used answers go first.
        max_match_length: the longest suffix of the text matched against earlier text.
        max_candidates: the most recent occurrences of the matched suffix that vote on the continuation.
        memory: a read-only memory of earlier answers (`SuffixMemory`, or the path of one saved as safetensors),
            searched beside the cache: millions of tokens of the model's own answers, loaded in a fraction of a
            second, that no call evicts.
        tree_nodes: draft a tree of the most likely continuations, at most this many nodes, verified in one pass
            with the lossless tree rule (one prompt at a time); None drafts the best chain.

    `cache` holds the earlier answers; `remember(answers)` adds answers from elsewhere (a chat data set of the
    model's own answers: `selfspec.chat.chat_answers`); `clear_cache()` empties it. Several rows of a batch draft
    independently (each from its own text and the shared cache).
    """

    check_drafts = False
    vocab_size: int | None = None  # the wrapped model's (`bind_vocabulary`)

    def __init__(
        self,
        num_speculative_tokens: int = 16,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        max_cached_requests: int = CACHED_REQUESTS,
        max_cached_tokens: int = CACHED_TOKENS,
        max_match_length: int = 24,
        max_candidates: int = 64,
        tree_nodes: int | None = None,
        memory: SuffixMemory | str | os.PathLike | None = None,
    ):
        super().__init__()
        for name, value in (
            ("num_speculative_tokens", num_speculative_tokens),
            ("max_match_length", max_match_length),
            ("max_candidates", max_candidates),
            ("tree_nodes", 1 if tree_nodes is None else tree_nodes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer.")
        for name, value in (("max_cached_requests", max_cached_requests), ("max_cached_tokens", max_cached_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be a non-negative integer (0 switches the cache off).")
        if not max_spec_factor > 0:
            raise ValueError(f"max_spec_factor={max_spec_factor!r} must be a positive number.")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob={min_token_prob!r} must be a probability between 0 and 1.")
        self.max_drafts = self.default_drafts = num_speculative_tokens
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob
        self.max_cached_requests, self.max_cached_tokens = max_cached_requests, max_cached_tokens
        self.max_match_length, self.max_candidates = max_match_length, max_candidates
        self.tree = SuffixTree(tree_nodes, num_speculative_tokens) if tree_nodes is not None else None
        self.cache = SuffixIndex()  # earlier calls' answers, shared by every row and call
        self.memory = memory if memory is None or isinstance(memory, SuffixMemory) else SuffixMemory.load(memory)
        self._texts: list[SuffixIndex] = []  # per row of the running call: its prompt and what it generated
        self._prompt_width = 0  # the call's prompt width (padding included): answers start there
        self._drafts: list[list[int]] | None = None  # each row's chain from `available`, for `draft`
        self._paths: dict | None = None  # the tree from `available`, for `draft_tree`

    @property
    def name(self) -> str:
        return "suffix"

    def estimated_cost(self) -> float:
        return 0.0  # no weights read: dictionary look-ups on the host

    def clear_cache(self) -> None:
        """Forget every earlier answer."""
        self.cache.clear()

    # ------------------------------------------------------------------ a call
    def begin(self, state: DecodeState, hidden) -> None:
        self._texts = []
        for row, pad in zip(state.sequences.tolist(), state.pad_offset.tolist(), strict=True):
            text = SuffixIndex()
            text.add(row[pad:])
            self._texts.append(text)
        self._prompt_width = state.sequences.shape[1]

    def select_rows(self, rows: torch.Tensor) -> None:
        self._texts = [self._texts[row] for row in rows.tolist()]
        self._drafts = self._paths = None

    def end(self, sequences: list[torch.Tensor]) -> None:
        """Keep each row's answer in the cross-call cache, evicting the least recently used over the bounds."""
        self._texts, self._drafts, self._paths = [], None, None
        if self.max_cached_requests:
            self._keep(sequence[self._prompt_width :].tolist() for sequence in sequences)

    def remember(self, answers) -> int:
        """Put earlier answers (token id sequences: lists or 1-D tensors, as the model generates them, e.g.
        `selfspec.chat.chat_answers` of a chat data set) in the cache shared across calls, as if earlier calls
        had generated them, within its bounds (the least recently used go first). Returns the tokens the cache
        holds now. Raises ValueError when the cache is off (max_cached_requests or max_cached_tokens 0)."""
        if not self.max_cached_requests or not self.max_cached_tokens:
            raise ValueError("this SuffixDrafter's cache is off (max_cached_requests=0 or max_cached_tokens=0): it "
                             "cannot remember answers")  # fmt: skip
        answers = [answer.tolist() if isinstance(answer, torch.Tensor) else answer for answer in answers]
        if any(not isinstance(a, list | tuple) or not all(isinstance(t, int) for t in a) for a in answers):
            raise ValueError("remember() takes a list of answers, each a list (or 1-D tensor) of token ids")
        wrong = next((t for a in answers for t in a if not 0 <= t < (self.vocab_size or 2**31)), None)
        if wrong is not None:
            raise ValueError(f"remember(): token id {wrong} is not in the model's vocabulary ({self._vocabulary()})")
        self._keep(answers)
        return self.cache.tokens

    def bind_vocabulary(self, vocab_size: int) -> None:
        """The wrapped model has `vocab_size` tokens: answers remembered before must hold only those (drafts from
        the cache are not range-checked each iteration), and so must answers remembered later. One drafter serves
        one vocabulary: a model with another would remember ids the first one's drafts cannot hold."""
        if self.vocab_size is not None and vocab_size != self.vocab_size:
            raise ValueError(
                f"this SuffixDrafter already drafts for a model of {self.vocab_size} tokens, and this model has "
                f"{vocab_size}: its answers would become drafts out of the other's vocabulary. Give each model a "
                "SuffixDrafter of its own."
            )
        largest = max((max(sequence) for sequence in self.cache.sequences.values() if sequence), default=-1)
        largest = max(largest, self.memory.largest_token() if self.memory is not None else -1)
        if largest >= vocab_size:
            raise ValueError(
                f"this SuffixDrafter remembers token id {largest}, but the model has {vocab_size} tokens: answers "
                "from another tokenizer? clear_cache() and remember() the model's own."
            )
        self.vocab_size = vocab_size

    def _vocabulary(self) -> str:
        return f"{self.vocab_size} tokens" if self.vocab_size else "token ids are non-negative"

    def _keep(self, answers) -> None:
        """Cache each non-empty answer that fits the token bound, evicting the least recently used over the bounds."""
        for answer in answers:
            if not answer or len(answer) > self.max_cached_tokens:
                continue
            self.cache.add(answer)
            while len(self.cache) > self.max_cached_requests or self.cache.tokens > self.max_cached_tokens:
                self.cache.drop(next(iter(self.cache.sequences)))

    def accept(self, verified: Verified) -> None:
        self._drafts = self._paths = None  # the text changed: `available` looks again

    # ------------------------------------------------------------------ drafting
    def available(self, state: DecodeState) -> bool:
        if self.tree is not None:  # the tree itself (empty: nothing likely enough), kept for `draft_tree`
            self._paths = self._tree_paths(state)
            return bool(self._paths)
        self._drafts = self._continuations(state)
        return any(self._drafts)

    def draft(self, state: DecodeState, gamma: int, process: Processing, do_sample: bool) -> Draft:
        drafts = self._drafts if self._drafts is not None else self._continuations(state)
        self._drafts = None
        width = min(gamma, max(map(len, drafts), default=0))
        pending = state.sequences[:, -1].tolist()
        # rows without a proposal, or with a shorter one, pad with filler (a point mass too: a wasted position)
        rows = [tokens[:width] + [pending[row]] * (width - len(tokens[:width])) for row, tokens in enumerate(drafts)]
        return Draft.point_mass(torch.tensor(rows, dtype=torch.long, device=state.sequences.device).view(-1, width))

    def draft_tree(self, state: DecodeState):
        """The tree of the most likely continuations for one prompt: (the tree, node tokens [1, N], None: the
        candidates are point masses, chosen deterministically)."""
        paths = self._paths if self._paths is not None else self._tree_paths(state)
        self._paths = None
        tree = CandidateTree.from_paths([list(path) for path in paths])
        device = state.sequences.device
        node_tokens = torch.tensor([[paths[path] for path in tree.paths]], device=device)
        return tree.to(device), node_tokens, None

    def _tree_paths(self, state: DecodeState) -> dict:
        """The one prompt's tree of likely continuations now (`continuation_tree`)."""
        self._sync(state)
        occurrences, depth, period_of = self._match(0)
        return continuation_tree(occurrences, depth, self.tree.nodes, self.min_token_prob, period_of)

    def _match(self, row: int) -> tuple[list[tuple], int, object]:
        """Row `row`'s occurrences of its longest matched suffix, in its own text or else in the cache, the draft
        depth that match allows, and the periods of its own text's occurrences. The row's own text (its prompt, the
        answer so far) is the better evidence: the cache's match wins only where the text has none, or where it
        is `CACHE_MARGIN` tokens longer."""
        text = self._texts[row]
        ((_, own),) = text.sequences.items()
        context = own[-self.max_match_length - 1 :].tolist()
        length, occurrences = text.candidates(context, self.max_match_length, self.max_candidates)
        earlier = [index for index in (self.cache if self.max_cached_requests else None, self.memory) if index]
        # the cache before the memory: at equal length its answers are the more recent
        found = [index.candidates(context, self.max_match_length, self.max_candidates) for index in earlier]
        earlier_length, earlier_found = max(found, key=lambda match: match[0], default=(0, []))
        if earlier_found and (not occurrences or earlier_length >= length + CACHE_MARGIN):
            length, occurrences = earlier_length, earlier_found
        for occurrence in occurrences[:1]:
            if occurrence[0] is not own:
                self.cache.touch(occurrence[2])
        # capped before int(): a factor of inf (no cap per matched token) has no integer product
        depth = max(1, int(min(self.max_spec_factor * length, self.max_drafts))) if length else 0
        return occurrences, depth, lambda o: len(own) - o[1] if o[0] is own else None

    def _continuations(self, state: DecodeState) -> list[list[int]]:
        """Each row's best chain now (empty where nothing matched or nothing is likely enough)."""
        self._sync(state)
        chains = []
        for row in range(len(self._texts)):
            occurrences, depth, period_of = self._match(row)
            chains.append(best_continuation(occurrences, depth, self.min_token_prob, period_of)[0])
        return chains

    def _sync(self, state: DecodeState) -> None:
        """Bring each row's text up to the committed tokens (one host read of the new ones)."""
        lengths = (state.length - state.pad_offset).tolist()  # tokens per row, the pending one included
        for row, text in enumerate(self._texts):
            ((uid, sequence),) = text.sequences.items()
            new = lengths[row] - len(sequence)
            if new > 0:
                text.extend(uid, state.sequences[row, state.length - new :].tolist())
