"""What a model does that its config does not say, read from the model itself: the name under which its forward
takes the cache, its rope settings and what its `generate` does at a longrope switch, and, for the models outside
the supported families that model-free drafters run on (`ModelAdapter(whole_model=True)`), whether a pass over
several drafts computes what `generate`'s one-token steps do. Each probe returns a fact; `core.ModelAdapter`
decides what to refuse or adapt from it.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers import DynamicCache


def cache_keyword(forward) -> str:
    """The name under which `forward` takes the KV cache: transformers 5.24 renamed `past_key_values` to `cache`,
    and earlier 5.x releases silently swallow `cache=`."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def rope_settings(config) -> list[dict]:
    """The model's rope parameters: one dict, or one per layer type (Gemma 3); [] without any."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    per_type = bool(rope) and all(isinstance(value, dict) for value in rope.values())
    return list(rope.values()) if per_type else [rope] if rope else []


def longrope_switch(config) -> int | None:
    """The position past which longrope moves every position of a forward to its long frequencies (None: no
    longrope)."""
    switches = [
        settings["original_max_position_embeddings"]
        for settings in rope_settings(config)
        if settings.get("rope_type") == "longrope"
    ]
    return min(switches) if switches else None


def generate_at_rope_switch(model: nn.Module, config) -> tuple[str, int] | None:
    """What `model.generate` does to its cache when the sequence first holds config.original_max_position_embeddings + 1
    tokens, read from its `prepare_inputs_for_generation` on such a sequence over a cache of the positions before it:
    ("recompute", that field) where it drops the cache and passes every position again (Phi3's, Phi-MoE's),
    ("restart", that field) where it drops the cache and passes the pending token alone (Phi4-multimodal's in
    transformers 5.25), None where it keeps the cache or the config has no such field."""
    at = getattr(config, "original_max_position_embeddings", None)
    if at is None:
        return None
    past = DynamicCache()
    past.update(torch.zeros(1, 1, at, 1), torch.zeros(1, 1, at, 1), 0)  # only its length is read
    ids = torch.zeros(1, at + 1, dtype=torch.long)
    keyword = cache_keyword(model.prepare_inputs_for_generation)
    inputs = model.prepare_inputs_for_generation(
        ids, attention_mask=torch.ones_like(ids), next_sequence_length=1, use_cache=True, **{keyword: past}
    )
    if inputs.get(keyword) is not None:
        return None
    return ("recompute" if inputs["input_ids"].shape[1] == at + 1 else "restart"), at


def generate_feeds_other_tokens(model: nn.Module) -> bool:
    """Whether `model.generate`'s first pass feeds the forward other tokens than the prompt, read from its
    `prepare_inputs_for_generation`: XLM's appends a mask token to every pass and predicts at it, its forward taking
    the whole sequence and slicing off what its cache holds."""
    ids = torch.tensor([[3, 4, 5]], device=model.get_output_embeddings().weight.device)
    inputs = model.prepare_inputs_for_generation(
        ids, attention_mask=torch.ones_like(ids), next_sequence_length=3, use_cache=True, is_first_iteration=True
    )
    fed = inputs.get("input_ids")
    return fed is None or not torch.equal(fed, ids)


@torch.no_grad()
def attends_ahead(model: nn.Module) -> bool:
    """Whether the first position's logits change with the token after it: BERT-style causal LMs attend both ways
    unless their config says is_decoder=True."""
    ids = torch.tensor([[3, 4], [3, 5]], device=model.get_output_embeddings().weight.device)
    logits = model(input_ids=ids, use_cache=False).logits[:, 0]  # [2, V]
    return not torch.allclose(logits[0], logits[1])


@torch.no_grad()
def token_without_position(model: nn.Module, takes_position_ids: bool) -> int | None:
    """The pad token id where the forward numbers positions from the token ids, giving that token none of its own
    and counting the others (fairseq's make_positions: TrOCR's sinusoidal positions), whatever position ids it is
    passed; None elsewhere. Read from two rows that differ only in a masked middle token, the pad or another: where
    positions follow the position ids, the mask or the cache slot, the last token's logits are the same in both."""
    pad = model.config.pad_token_id
    if pad is None:
        return None
    first, other, last = [token for token in range(3, 7) if token != pad][:3]
    device = model.get_output_embeddings().weight.device
    ids = torch.tensor([[first, pad, last], [first, other, last]], device=device)
    mask = torch.tensor([[1, 0, 1]] * 2, device=device)  # the middle token is masked: only its id can act
    positions = {"position_ids": torch.tensor([[0, 1, 1]] * 2, device=device)} if takes_position_ids else {}
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False, **positions).logits[:, -1]  # [2, V]
    return None if torch.allclose(logits[0], logits[1], equal_nan=True) else pad


@torch.no_grad()
def hides_cached_padding(adapter) -> bool:  # adapter: a core.ModelAdapter
    """Whether positions that a 2D attention mask hides stay hidden from later passes over the cache, as a batch's
    padding needs (the slots selfspec inserts between rows that accept different numbers of drafts included).
    Probed once on one left-padded row: after its prefill, a pass over two more tokens must come out the same when
    the pad's cache entries are overwritten. GIT's forward fails it: once the cache holds anything it prepends its
    image-patch entries to the mask, image or not, so the mask slides off the positions it names."""

    def tensor(rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor(rows, device=adapter.device)

    logits = []
    for overwrite in (False, True):
        cache = adapter.new_cache()
        # positions as `DecodeState.position_ids` numbers a padded row
        adapter.forward(tensor([[3, 5, 6]]), tensor([[1, 0, 1]]), cache, tensor([[0, 1, 1]]))
        adapter.check_cache_filled(cache, 3)  # a forward that keeps no cache is refused for that, by name, first
        if overwrite:  # what the pad left in the cache, made loud: a mask that hides it hides this too
            for layer in cache.layers:
                for entries in (layer.keys, layer.values):
                    entries[:, :, 0] = 4.0
        logits.append(adapter.forward(tensor([[7, 8]]), tensor([[2, 3]]), cache, tensor([[0, 1, 1, 1, 1]]), 2))
    return torch.allclose(*logits)
