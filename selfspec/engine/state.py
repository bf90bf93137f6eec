"""The rows being generated, kept right-aligned so that one cache serves a batch with ragged acceptance.

Every row of `sequences` ends with its pending token (committed, not yet in the cache); its left end
is padding. When rows accept different numbers of drafts in one iteration, the rows that took fewer
get that many more padding slots on the left (`append`), so every row still ends at the same index and
every cache layer keeps one length. Positions skip padding (index - pad), and the 2D attention mask
hides it, so each row computes exactly what it would compute alone. The cost: an iteration whose rows
disagree gathers the whole cache once (`ModelAdapter.rearrange`); rows that agree only crop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class DecodeState:
    """`sequences[:, -1]` is each row's pending token. At the start of every iteration each cache layer
    holds the positions of `sequences[:, :-1]`."""

    sequences: torch.Tensor  # [batch, T] long
    cache: DynamicCache
    pad_offset: torch.Tensor  # [batch] long: padding slots at the left of each row
    mask: torch.Tensor | None  # [batch, T] 2D attention mask, or None when no row has padding
    added_pad: list[int]  # per row: padding slots added by `append` (not part of the caller's prompt)
    prompt_pad: list[int]  # per row: the caller's own left padding
    pad_token_id: int = 0  # what fills the added slots

    @property
    def length(self) -> int:
        return self.sequences.shape[1]

    @property
    def batch_size(self) -> int:
        return self.sequences.shape[0]

    def position_ids(self, start: int, count: int) -> torch.Tensor:
        """Position ids [batch, count] of sequence indices start..start+count-1."""
        index = torch.arange(start, start + count, device=self.sequences.device)[None, :]
        # as model.generate numbers them: padding slots get position 1 (they are masked anyway)
        return torch.where(index < self.pad_offset[:, None], 1, index - self.pad_offset[:, None])

    def attention_mask(self, end: int) -> torch.Tensor | None:
        """2D mask over sequence indices 0..end-1 (indices past T are drafts: visible), or None."""
        if self.mask is None:
            return None
        extra = end - self.mask.shape[1]
        if extra <= 0:
            return self.mask[:, :end]
        return torch.cat([self.mask, self.mask.new_ones(self.batch_size, extra)], dim=1)

    def host_pad_offsets(self) -> list[int]:
        """`pad_offset` as known on the host, without a device round trip."""
        return [prompt + added for prompt, added in zip(self.prompt_pad, self.added_pad, strict=True)]

    def processor_inputs(self) -> torch.Tensor | list[torch.Tensor]:
        """The input ids logits processors see: what `model.generate` would pass (the caller's padded
        prompt and the generated tokens), as one tensor, or one [1, n] tensor per row once rows differ."""
        if not any(self.added_pad):
            return self.sequences
        return [self.sequences[row : row + 1, added:] for row, added in enumerate(self.added_pad)]

    def append(self, committed: torch.Tensor, counts: list[int]) -> None:
        """Append `committed[b, :counts[b]]` to row b ([batch, W] tokens), right-aligned."""
        width = max(counts)
        if all(count == width for count in counts):
            self.sequences = torch.cat([self.sequences, committed[:, :width]], dim=1)
            if self.mask is not None:
                self.mask = torch.cat([self.mask, self.mask.new_ones(self.batch_size, width)], dim=1)
            return
        if self.mask is None:
            self.mask = torch.ones_like(self.sequences)
        shift = torch.tensor([width - count for count in counts], device=self.sequences.device)  # [batch]
        index = self.shifted_index(self.length, width, shift)  # [batch, T + width] into [old row, committed]
        self.sequences = torch.cat([self.sequences, committed], dim=1).gather(1, index)
        self.mask = torch.cat([self.mask, self.mask.new_ones(committed.shape)], dim=1).gather(1, index)
        filler = torch.arange(self.length, device=index.device)[None, :] < shift[:, None]
        self.sequences = self.sequences.masked_fill(filler, self.pad_token_id)
        self.mask = self.mask.masked_fill(filler, 0)
        self.pad_offset = self.pad_offset + shift
        self.added_pad = [added + width - count for added, count in zip(self.added_pad, counts, strict=True)]

    @staticmethod
    def shifted_index(old: int, width: int, shift: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Gather index [batch, old + width] over [old entries, new entries] that moves each row right by
        `shift[b]` slots (filled with index 0) and takes new entries keep[b, :width - shift[b]]
        (default: the first ones, in order)."""
        batch = shift.shape[0]
        slot = torch.arange(old + width, device=shift.device)[None, :].expand(batch, -1)  # target slot
        source = slot - shift[:, None]  # the slot's entry before the shift
        if keep is not None:
            new = (source - old).clamp(0, keep.shape[1] - 1)
            source = torch.where(source >= old, old + keep.gather(1, new), source)
        return source.clamp_min(0)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (a [k] long index): the others have finished."""
        self.sequences, self.pad_offset = self.sequences[rows], self.pad_offset[rows]
        self.mask = self.mask[rows] if self.mask is not None else None
        keep = rows.tolist()
        self.added_pad = [self.added_pad[row] for row in keep]
        self.prompt_pad = [self.prompt_pad[row] for row in keep]
        self.cache.batch_select_indices(rows)
