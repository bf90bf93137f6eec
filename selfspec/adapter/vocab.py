"""The LM head as drafts read it: `DraftVocabulary` (a subset of its rows and/or an int8 copy of them), the subset one
`generate` call drafts from (`CallVocabulary`: the call's own tokens join it), where a draft vocabulary's token ids
come from (a JSON file, `read_token_ids`; your data, `frequent_tokens`), and what one draft token reads of the head
(`draft_head_size`, for the drafters' estimate of c)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import torch
from torch import nn


@dataclass
class DraftVocabulary:
    """The LM head as drafts read it: a subset of its rows and/or an int8 copy of them.

    A subset (`ids`): their rows, copied once (N x hidden extra memory), so a draft token's LM-head product
    reads N rows instead of the whole vocabulary. Tokens outside get -inf, which the accept-reject rule
    handles exactly (q is zero there; the residual covers them). int8 (`scales` set): the rows quantised
    per row (symmetric, scale = max |w| / 127) and multiplied by torch's int8 weight-only kernel in
    bfloat16, a quarter of float32's bytes. Either way only q changes; the verify pass uses the model's
    own LM head.

    With `context` on, each `generate` call drafts from the subset joined by the tokens of its own prompt and answer
    (`CallVocabulary`): the names and rare words an answer copies from its prompt are outside any vocabulary of
    frequent tokens, and their rows cost little (a few dozen per prompt)."""

    ids: torch.Tensor  # [N] token ids, no repeats: sorted, then any a call joined (all V for an int8 whole head)
    weight: torch.Tensor  # [N, H], int8 when `scales` is set
    bias: torch.Tensor | None  # [N]
    vocab_size: int
    scales: torch.Tensor | None = None  # [N] bfloat16 row scales of an int8 `weight`
    compact: bool = False  # logits stay [..., N] (training's loss over the subset), not spread to [..., V]
    context: bool = False  # a call's own tokens join the subset for that call (`CallVocabulary`)

    def compacted(self) -> DraftVocabulary:
        """The same rows, whose logits stay over the subset: [..., N], position k for token `ids[k]`."""
        return replace(self, compact=True)

    @classmethod
    def from_lm_head(
        cls, lm_head: nn.Module, hidden_size: int, token_ids=None, quant: str | None = None, context: bool = False
    ):
        """These token ids' rows of `lm_head` (None: all), in its dtype or, with quant="int8", quantised per row.
        `token_ids` may be a JSON file's path; `context`: see the class docstring."""
        if isinstance(token_ids, str | os.PathLike):
            token_ids = read_token_ids(token_ids)
        if quant not in (None, "int8"):
            raise ValueError(f"draft_quant must be None or 'int8', got {quant!r}")
        vocab_size, device, dtype = lm_head.weight.shape[0], lm_head.weight.device, lm_head.weight.dtype
        if token_ids is None:
            ids = torch.arange(vocab_size)
        else:
            ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().unique()  # sorted, no repeats
            if ids.numel() == 0:
                raise ValueError(f"draft_vocab must list token ids from 0 to {vocab_size - 1} (got none); None drafts "
                                 "from the whole vocabulary")  # fmt: skip
            if ids[0] < 0:
                raise ValueError(f"draft_vocab lists a negative token id ({int(ids[0])}): token ids run from 0")
            if ids[-1] >= vocab_size:
                raise ValueError(
                    f"draft_vocab lists ids from {int(ids[0])} to {int(ids[-1])}, and this model takes token ids "
                    f"from 0 to {vocab_size - 1}: it was made for another target (make one for this model with "
                    "selfspec.frequent_tokens or training/make_draft_vocab.py)"
                )
        ids = ids.to(device)
        bias = getattr(lm_head, "bias", None)
        with torch.no_grad():
            weight = lm_head.weight.index_select(0, ids)
            bias = bias.index_select(0, ids) if bias is not None else None
        if quant is None:
            return cls(ids, weight, bias, vocab_size, context=context)
        with torch.no_grad():
            scales = (weight.float().abs().amax(dim=1) / 127).clamp(min=1e-12)
            weight = torch.round(weight.float() / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        vocab = cls(ids, weight, bias, vocab_size, scales.to(torch.bfloat16), context=context)
        try:  # the kernel's support depends on the device and the shapes: fail here, not mid-generation
            vocab.project(torch.zeros(1, hidden_size, device=device, dtype=dtype))
        except (RuntimeError, NotImplementedError) as error:
            raise ValueError(
                f"draft_quant='int8' needs torch's int8 weight-only kernel (torch._weight_int8pack_mm) for a "
                f"{tuple(weight.shape)} head on {device}; it failed: {error}"
            ) from error
        return vocab

    def project(self, normed: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., N] logits of these rows, in the dtype of `normed`."""
        if self.scales is None:
            return nn.functional.linear(normed, self.weight, self.bias)
        flat = normed.reshape(-1, normed.shape[-1]).to(self.scales.dtype)
        logits = torch._weight_int8pack_mm(flat, self.weight, self.scales)
        logits = logits.reshape(*normed.shape[:-1], -1).to(normed.dtype)
        return logits + self.bias if self.bias is not None else logits

    @property
    def rows(self) -> torch.Tensor | None:
        """The token ids, or None when they are the whole vocabulary (an int8 copy of the whole head)."""
        return None if self.ids.numel() == self.vocab_size else self.ids

    def spread(self, partial: torch.Tensor) -> torch.Tensor:
        """[..., N] logits of the subset -> [..., V] with -inf elsewhere (as they are when `compact`)."""
        if self.rows is None or self.compact:
            return partial
        full = partial.new_full((*partial.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.ids, partial)


@dataclass
class JoinedVocabulary(DraftVocabulary):
    """A draft vocabulary joined by one call's own tokens (`CallVocabulary`): `ids` are the subset's, then the joined
    ones; `weight` (and `bias`, `scales`) hold the joined rows only, projected after the subset's own rows, which are
    not copied again."""

    subset: DraftVocabulary | None = None

    def project(self, normed: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.subset.project(normed), super().project(normed)], dim=-1)

    @property
    def rows(self) -> torch.Tensor:
        """The token ids, always: the joined ones follow the subset's, so even ids that cover the whole vocabulary
        are not in token order."""
        return self.ids


class CallVocabulary:
    """The draft vocabulary one `generate` call drafts from, as a drafter keeps it: `vocab` (None: the whole LM head)
    and, where its `context` is on, the call's tokens it lacks, joined as the call goes (the prompt's at `begin`, the
    answer's at each `follow`)."""

    def __init__(self, vocab: DraftVocabulary | None, lm_head: nn.Module):
        self.base, self.lm_head = vocab, lm_head
        self.joins = vocab is not None and vocab.context and not vocab.compact and vocab.rows is not None
        self.current, self._seen = vocab, 0
        if self.joins:  # token id -> in `current`: a lookup per new token, not a search of the subset
            self._member = torch.zeros(vocab.vocab_size, dtype=torch.bool, device=vocab.ids.device)
            self._member[vocab.ids] = True

    def begin(self, sequences: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """A new call: the base vocabulary joined by the prompts `sequences` [batch, T], but for the positions
        `mask` [batch, T] marks as padding (0)."""
        if isinstance(self.current, JoinedVocabulary):
            self._member[self.current.ids[self.base.ids.numel() :]] = False
        self.current, self._seen = self.base, sequences.shape[1]
        if self.joins:
            self._join(sequences if mask is None else sequences[mask.bool()])

    def follow(self, sequences: torch.Tensor) -> DraftVocabulary | None:
        """The vocabulary to draft from now: joined by the tokens of `sequences` [batch, T] not seen before."""
        if self.joins and sequences.shape[1] > self._seen:
            self._join(sequences[:, self._seen :])
        self._seen = sequences.shape[1]
        return self.current

    def _join(self, tokens: torch.Tensor) -> None:
        current, tokens = self.current, tokens.flatten().to(self._member.device)
        new = tokens[~self._member[tokens]]
        if new.numel() == 0:
            return
        new = new.unique()
        self._member[new] = True
        quant = "int8" if self.base.scales is not None else None
        rows = DraftVocabulary.from_lm_head(self.lm_head, self.base.weight.shape[1], new, quant)
        if not isinstance(current, JoinedVocabulary):  # the first rows this call joins
            self.current = JoinedVocabulary(**{**vars(rows), "ids": torch.cat([current.ids, rows.ids])}, subset=current)
            return
        cat = lambda old, more: None if old is None else torch.cat([old, more])  # noqa: E731
        self.current = replace(
            current,
            ids=torch.cat([current.ids, rows.ids]),
            weight=torch.cat([current.weight, rows.weight]),
            bias=cat(current.bias, rows.bias),
            scales=cat(current.scales, rows.scales),
        )


def read_token_ids(path: str | os.PathLike) -> list[int]:
    """The token ids in a JSON file holding one list of integers (a draft vocabulary such as
    `heads/demo-target/draft_vocab.json`)."""
    try:
        with open(path, encoding="utf-8") as file:
            ids = json.load(file)
    except FileNotFoundError:
        raise FileNotFoundError(f"draft_vocab: no file at {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"draft_vocab: {path} is not JSON: {error}") from error
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"draft_vocab: {path} must hold one JSON list of integer token ids")
    return ids


def frequent_tokens(token_ids, count: int, always=()) -> torch.Tensor:
    """The `count` most frequent token ids in `token_ids` (a tensor, or an iterable of tensors, e.g. your
    tokenised data), plus `always` (e.g. the EOS id): a draft vocabulary for `SelfSpeculative(draft_vocab=)`.
    Ties go to the smaller id; the result is sorted."""
    if count < 1:  # a slice [:-5] would keep every id but the five rarest
        raise ValueError(f"frequent_tokens: count must be a positive number of ids, got {count!r}")
    parts = [token_ids] if isinstance(token_ids, torch.Tensor) else list(token_ids)
    flat = torch.cat([torch.as_tensor(part).flatten() for part in parts]).long()
    order = torch.sort(torch.bincount(flat), descending=True, stable=True).indices[:count]  # ties: smaller id
    return torch.cat([order, torch.as_tensor(list(always), dtype=torch.long)]).unique()


def draft_head_size(lm_head: nn.Module, vocab: DraftVocabulary | None, lora=None) -> int:
    """Parameters of the LM head a draft token reads: all of `lm_head`, or the draft vocabulary's rows, and the
    factors of a draft LoRA (`selfspec.heads.lora.DraftLoRA`; B's rows for the draft vocabulary only)."""
    if vocab is None:
        size = sum(p.numel() for p in lm_head.parameters())
    else:
        # in the model's dtype's units: an int8 copy reads a quarter of float32's bytes
        weight = vocab.weight.numel() * vocab.weight.element_size() / lm_head.weight.dtype.itemsize
        size = weight + (vocab.bias.numel() if vocab.bias is not None else 0)
    if lora is not None:
        rows = lm_head.weight.shape[0] if vocab is None else vocab.ids.numel()
        size += lora.r * (lora.lora_A.in_features + rows)
    return size
