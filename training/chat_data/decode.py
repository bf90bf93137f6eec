"""Answers from the target for a batch of prompts, in one left-padded batch whose finished rows leave it: a row
that has produced an end token is dropped from the KV cache, so the batch costs what its live rows cost, not
what its longest answer costs (`model.generate` keeps computing finished rows as padding)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from selfspec.adapter import cache_keyword


@torch.inference_mode()
def decode(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    stop_ids: set[int],
    temperature: float | None = None,
    generator: torch.Generator | None = None,
) -> list[tuple[list[int], bool]]:
    """Per row: (new token ids without the stop token, truncated at `max_new_tokens`). Greedy when
    `temperature` is None, else sampled from softmax(logits / temperature) with `generator` (on the model's
    device, as the inputs are)."""
    rows = input_ids.shape[0]
    outputs: list[list[int]] = [[] for _ in range(rows)]
    finished = [False] * rows
    live = list(range(rows))  # original row of each row still in the batch
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    cache_argument = {cache_keyword(model.forward): cache}
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True, logits_to_keep=1,
        **cache_argument,
    ).logits[:, -1]  # fmt: skip
    next_position = positions[:, -1:] + 1
    for _ in range(max_new_tokens):
        if temperature is None:
            tokens = logits.argmax(-1)
        else:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        keep = []
        for k, (row, token) in enumerate(zip(live, tokens.tolist(), strict=True)):
            if token in stop_ids:
                finished[row] = True
            else:
                outputs[row].append(token)
                keep.append(k)
        if not keep:
            break
        if len(keep) < len(live):
            index = torch.tensor(keep, device=tokens.device)
            cache.batch_select_indices(index)
            live, tokens, next_position = [live[k] for k in keep], tokens[index], next_position[index]
            attention_mask = attention_mask[index]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(live), 1)], dim=-1)
        logits = model(
            input_ids=tokens[:, None], attention_mask=attention_mask, position_ids=next_position, use_cache=True,
            **cache_argument,
        ).logits[:, -1]  # fmt: skip
        next_position = next_position + 1
    return [(tokens, not done) for tokens, done in zip(outputs, finished, strict=True)]
