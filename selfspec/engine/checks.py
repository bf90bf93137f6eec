"""What a `generate` call refuses before it starts, with the reason: a prompt that is not a [batch, length] tensor
of token ids, a batch of what runs one prompt at a time (trees, streamers, forwards that number positions by cache
slot or see masked cache entries, a longrope switch that the rows would cross apart), a prompt plus max_new_tokens
past the model's positions, and a generation through the point where the model's own generate forgets its cache."""

from __future__ import annotations

import torch

from ..adapter import ModelAdapter
from .generation import GenerationSetup, UnsupportedGenerationArgument


def check_prompt(input_ids, kwargs: dict) -> torch.Tensor:
    """The prompt as `generate` was given it (`input_ids`, the first positional argument or the keyword; `kwargs` the
    call's other arguments), checked: a non-empty [batch, length] tensor of integer token ids."""
    if input_ids is None and kwargs.get("inputs_embeds") is not None:
        raise UnsupportedGenerationArgument("`inputs_embeds` is not supported by selfspec: pass `input_ids`.")
    if input_ids is None:
        raise ValueError("Pass the prompt token ids as `input_ids` (or the first positional argument).")
    if not isinstance(input_ids, torch.Tensor):  # text, or a list of ids: model.generate takes neither
        raise TypeError(
            f"The prompt must be a tensor of token ids, got {type(input_ids).__name__}: tokenize it first, "
            "e.g. spec.generate(**tokenizer(prompt, return_tensors='pt'), max_new_tokens=64)."
        )
    if input_ids.ndim != 2 or input_ids.shape[1] == 0 or input_ids.shape[0] == 0:
        raise ValueError(
            f"The prompt must be a non-empty [batch, length] tensor of token ids; got shape {tuple(input_ids.shape)}."
        )
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(
            f"The prompt's token ids must be integers; got a tensor of dtype {input_ids.dtype}. Pass the ids the "
            "tokenizer returned (or .long() them)."
        )
    return input_ids


def check_call(adapter: ModelAdapter, tree: bool, setup: GenerationSetup, input_ids: torch.Tensor) -> None:
    """What a call refuses before its prefill: a batch of what runs one prompt at a time (`tree`: a tree drafter
    drafts), a prompt and max_new_tokens past the model's positions, a generation through a longrope restart."""
    if input_ids.shape[0] > 1:
        check_batch(adapter, tree, setup, input_ids)
    max_positions = adapter.max_positions
    if max_positions is not None and input_ids.shape[1] + setup.max_new_tokens > max_positions:
        raise ValueError(
            f"The prompt ({input_ids.shape[1]} tokens) plus max_new_tokens ({setup.max_new_tokens}) exceeds the "
            f"model's maximum of {max_positions} positions."
        )
    check_rope_restart(adapter, input_ids, setup)


def check_rope_restart(adapter: ModelAdapter, input_ids: torch.Tensor, setup: GenerationSetup) -> None:
    """Refuse a generation that reaches the sequence index at which the model's `generate` drops its cache and goes
    on from the pending token alone (`ModelAdapter.rope_restart_at`): it forgets the sequence there, which
    selfspec does not imitate. generate's passes hold width, width + 1, ..., width + max_new_tokens - 1 tokens;
    the prefill's has no cache to drop."""
    at, width = adapter.rope_restart_at, input_ids.shape[1]
    if at is not None and width <= at and width + setup.max_new_tokens - 1 >= at + 1:
        raise UnsupportedGenerationArgument(
            f"{type(adapter.model).__name__}'s generate drops its cache when the sequence first holds "
            f"{at + 1} tokens (its longrope switch) and goes on from the last token alone, forgetting the rest; "
            f"selfspec does not follow it there. Keep the prompt plus max_new_tokens within {at + 1} tokens, or "
            f"start from a prompt longer than {at} tokens."
        )


def check_batch(adapter: ModelAdapter, tree: bool, setup: GenerationSetup, input_ids: torch.Tensor) -> None:
    """A batch: what runs one prompt at a time is refused. (Without `attention_mask`, the pad tokens are
    masked as `generate` masks them: `prepare_generation`.)"""
    if setup.streamer is not None:
        raise UnsupportedGenerationArgument("`streamer` takes one sequence: stream one prompt at a time.")
    if setup.config.output_scores or setup.config.output_logits:
        raise UnsupportedGenerationArgument("`output_scores` / `output_logits` are supported for one prompt at a time.")
    if tree:
        raise UnsupportedGenerationArgument("Tree verification runs one prompt at a time; use a chain for batches.")
    if not adapter.padding_keeps_positions:
        raise UnsupportedGenerationArgument(
            f"{type(adapter.model).__name__} ({adapter.model_type}) takes no position_ids: it numbers "
            "positions by cache slot, so the padding slots selfspec inserts between rows that accept different "
            "numbers of drafts would move them. Generate one prompt at a time."
        )
    if adapter.whole_model_only and not adapter.hides_cached_padding:
        raise UnsupportedGenerationArgument(
            f"{type(adapter.model).__name__} ({adapter.model_type}) lets a pass over its cache see "
            "positions the attention mask hides (GIT's forward prepends its image-patch entries to the mask, image "
            "or not), so a batch's padding, and the padding slots selfspec inserts between rows that accept "
            "different numbers of drafts, would be seen. Generate one prompt at a time."
        )
    check_batch_rope(adapter, setup, input_ids)


def check_batch_rope(adapter: ModelAdapter, setup: GenerationSetup, input_ids: torch.Tensor) -> None:
    """Refuse a batch whose generation could cross a longrope switch: `generate` moves every row to the long
    frequencies at one step (its least padded row's position; Phi3's recomputes the cache by padded width), which
    rows that accept different numbers of drafts, or leave the batch, cannot follow."""
    switch, recompute, mask = adapter.rope_switch, adapter.rope_recompute_at, setup.attention_mask
    if switch is None:
        return
    width, new = input_ids.shape[1], setup.max_new_tokens
    pads = (mask == 0).sum(dim=1).tolist() if mask is not None else [0]
    # generate's last pass: position width - 1 - min(pads) + new - 1, padded width width + new - 1
    short = width - min(pads) + new - 2 < switch and (recompute is None or width + new - 2 < recompute)
    if not short and width - max(pads) <= switch:  # nor is every row's first pending token past it
        raise UnsupportedGenerationArgument(
            f"This batch's generation crosses the longrope switch of {adapter.model_type} (position {switch}),"
            " where generate moves every row to the long frequencies at one step, which rows that accept different "
            "numbers of drafts cannot follow. Generate these prompts one at a time, or keep the padded width plus "
            f"max_new_tokens within {switch + 1}."
        )
