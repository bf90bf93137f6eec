"""`OneLayerModel`: one decoder layer of a supported family's own class, the body of an EAGLE head."""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, DynamicCache

from ..families import SUPPORTED_ARCHITECTURES, unsupported_message
from .core import UnsupportedModelError
from .grouped import grouped_attention
from .probes import cache_keyword
from .unrolled import only_queries, unrolled_attention

LAYOUTS = ("eagle", "eagle3")
ATTENTION_INPUTS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value")  # what reads the attention's input


class _JoinedInput(nn.Module):
    """In place of a decoder layer's input norm (EAGLE-3): [embed_norm(token states); hidden_norm(hidden)], 2H wide,
    with the token states the caller set in `states` for this pass."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.embed_norm, self.hidden_norm = norm, copy.deepcopy(norm)
        self.states: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.embed_norm(self.states), self.hidden_norm(hidden)], dim=-1)


class OneLayerModel(nn.Module):
    """One decoder layer of a supported family's own class, with that family's position encoding, run on given
    input states with a cache and a 4D mask of the caller's: the body of an EAGLE head (`selfspec.heads.eagle`).

    Built from `ModelAdapter.one_layer_config()` (fresh weights): the family's base model with one layer and its
    token embedding removed (inputs come as states). `forward` returns the layer's output, before `norm`.
    - layout "eagle" (EAGLE-1): the layer without its input norm, and no output norm (`norm` is the identity).
    - layout "eagle3" (EAGLE-3): the layer's input norm becomes [norm(token states); norm(hidden)], read by
      attention projections twice as wide; the residual stays the hidden state; `norm` is the family's final norm.
      Families whose layer reads the normed input elsewhere too (a parallel MLP), or has no input norm, are refused.
    """

    def __init__(self, config: dict, layout: str = "eagle"):
        super().__init__()
        settings = dict(config)
        model_type = settings.pop("model_type", None)
        # the target's load dtype (a bfloat16 checkpoint's config says so) is not the head's: from_config would build
        # the layer in it while the widened projections, fc and fuse are float32. The head is built in the default
        # dtype, as its other parts are, and cast as a whole (SelfSpeculative, training) where needed.
        for name in ("dtype", "torch_dtype"):
            settings.pop(name, None)
        family = SUPPORTED_ARCHITECTURES.get(model_type)
        if family is None:
            raise UnsupportedModelError(unsupported_message(model_type, "a one-layer head body"))
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
        base = AutoModel.from_config(AutoConfig.for_model(model_type, **settings))
        embedding = base.get_input_embeddings()
        for name, child in list(base.named_children()):
            if child is embedding:
                setattr(base, name, None)  # inputs come as states: the target's embedding is not copied
        layer = getattr(base, family.layers)[0]
        self.norm = getattr(base, family.norm) if layout == "eagle3" else nn.Identity()
        setattr(base, family.norm, nn.Identity())
        self.layout, self._family = layout, family
        if layout == "eagle" and family.input_norm:
            setattr(layer, family.input_norm, nn.Identity())
        elif layout == "eagle3":
            self._join_token_states(layer, family, model_type, settings)
        self.base = base
        self._cache_keyword = cache_keyword(base.forward)
        if self.joined is not None:
            self._check_joined(model_type)

    @staticmethod
    def _join_token_states(layer: nn.Module, family, model_type: str, settings: dict) -> None:
        norm = getattr(layer, family.input_norm) if family.input_norm else None
        projections = [
            (module, name, child)
            for module in layer.modules()
            for name, child in module.named_children()
            if name in ATTENTION_INPUTS and isinstance(child, nn.Linear)
        ]
        if norm is None or not projections:
            raise UnsupportedModelError(
                f"layout 'eagle3' joins the token's state into the attention's input: {model_type}'s decoder layer "
                "has no input norm or no linear q/k/v projection to widen; use layout 'eagle'."
            )
        setattr(layer, family.input_norm, _JoinedInput(norm))
        std = settings.get("initializer_range", 0.02)
        for module, name, old in projections:
            wide = nn.Linear(2 * old.in_features, old.out_features, bias=old.bias is not None)
            nn.init.normal_(wide.weight, std=std)
            if wide.bias is not None:
                nn.init.zeros_(wide.bias)
            setattr(module, name, wide)

    @property
    def joined(self) -> _JoinedInput | None:
        """The layer's joined input (layout eagle3), else None."""
        layer = getattr(self.base, self._family.layers)[0]
        norm = getattr(layer, self._family.input_norm) if self._family.input_norm else None
        return norm if isinstance(norm, _JoinedInput) else None

    def _check_joined(self, model_type: str) -> None:
        width = self.joined.embed_norm.weight.shape[-1]
        try:
            with torch.no_grad():
                self(torch.zeros(1, 1, width), torch.zeros(1, 1, dtype=torch.long), None, DynamicCache(),
                     torch.zeros(1, 1, width))  # fmt: skip
        except RuntimeError as error:  # e.g. a parallel MLP reading the 2H-wide joined input
            raise UnsupportedModelError(
                f"layout 'eagle3' does not fit {model_type}'s decoder layer (its normed input feeds more than the "
                f"attention): {error}. Use layout 'eagle'."
            ) from error

    def unrolled(self):
        """A context in which the layer attends with the unrolled training steps' block-sparse attention
        (`selfspec.adapter.unrolled`): every call inside must pass `selfspec.heads.eagle.unrolled_mask`'s pattern."""
        return unrolled_attention(self.base.config)

    @staticmethod
    def only_queries(needed):
        """Inside `unrolled()`: a context in which the block-sparse attention scores only the queries `needed`
        ([batch, n] bool; None: all) marks; the others' outputs are finite and wrong (nothing may read them).
        Attention other than SDPA keeps the dense mask and scores every query."""
        return only_queries(needed)

    def forward(self, hidden, position_ids, attention_mask, cache: DynamicCache, token_states=None) -> torch.Tensor:
        """`hidden` [batch, n, H] at `position_ids` [batch, n] (with layout eagle3, the next tokens' `token_states`
        too), attending to the `cache` and themselves as the float `attention_mask` [batch, 1, n, cached + n]
        allows (None: causal) -> the layer's output [batch, n, H]."""
        joined = self.joined
        if joined is not None:
            joined.states = token_states
        try:
            with grouped_attention(self.base.config):  # inside `unrolled()` the unrolled attention stays
                out = self.base(
                    inputs_embeds=hidden,
                    position_ids=position_ids,
                    attention_mask=attention_mask,
                    use_cache=True,
                    **{self._cache_keyword: cache},
                )
        finally:
            if joined is not None:
                joined.states = None
        return out.last_hidden_state
