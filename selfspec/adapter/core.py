"""`ModelAdapter`: the whole model, its first k decoder layers (the draft) or layers k..L-1 on hidden states the draft
already computed (the verify pass that reuses the lower-layer KV entries), the model's own final norm and LM head,
and the cache's crop and rearrangement. No modeling file is forked: the stock layers are driven through the stock
forward, with a hook that stops the stack after layer k-1 and pass-through stand-ins that skip layers 0..k-1.
"""

from __future__ import annotations

import copy
import inspect
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn
from transformers import DynamicCache

from ..families import (
    MASK_POSITIONED_MODELS,
    MIXED_MASK_MODELS,
    REFUSED_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    Family,
    unsupported_message,
)
from . import probes
from .grouped import grouped_attention
from .packed import PackedLinears, packed_by_default
from .vocab import DraftVocabulary

FINAL = "final"  # among captured hidden states: the last one after the final norm (the LM head's input)


class UnsupportedModelError(ValueError):
    """The model is not a decoder-only causal LM of a family selfspec drives."""


class _StopAfterLayer(Exception):
    """Raised by a forward hook to end the decoder stack early, carrying the hidden state."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model under a peft `PeftModel` (its LoRA layers stay active), or the model itself."""
    get_base_model = getattr(model, "get_base_model", None)
    if callable(get_base_model) and type(model).__module__.startswith("peft"):
        config = model.peft_config.get(model.active_adapter)
        if config is not None and config.is_prompt_learning:
            raise UnsupportedModelError(
                f"peft {config.peft_type} adapters add virtual tokens that selfspec does not drive; "
                "injected adapters such as LoRA are supported."
            )
        return get_base_model()
    return model


@dataclass(frozen=True)
class ModelFingerprint:
    """What heads record about the target they were trained on."""

    model_type: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    name_or_path: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as the float mask attention adds: 0 where visible, the dtype's minimum elsewhere
    (a boolean 4D mask is silently wrong under eager attention)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, torch.finfo(dtype).min)


class ModelAdapter:
    """Drives the decoder stack of a supported Hugging Face causal LM, layer range by layer range.

    `whole_model=True` is for drafters that read no weights (n-gram lookup, suffix drafting): they need the full
    forward and a cache that can be cropped, so any causal LM whose cache layers are plain attention KV layers is
    taken, of a supported family or not; the layer ranges, hidden states and LM-head rows are then unavailable.
    `packed_weights=True` keeps a packed copy of the float32 linear weights for passes over several rows (positions
    times prompts; `selfspec.adapter.packed`); None applies `packed_by_default`, `SelfSpeculative`'s default rule."""

    def __init__(self, model: nn.Module, whole_model: bool = False, packed_weights: bool | None = False):
        self.model = unwrap_model(model)
        config = getattr(self.model, "config", None)
        if config is None:
            raise UnsupportedModelError(f"{type(model).__name__} has no `config`: pass a transformers causal LM.")
        model_type = getattr(config, "model_type", None)
        if getattr(config, "is_encoder_decoder", False):
            raise UnsupportedModelError(
                f"{type(self.model).__name__} ({model_type}) is an encoder-decoder model; "
                "selfspec needs a decoder-only causal LM."
            )
        if model_type not in SUPPORTED_ARCHITECTURES and (not whole_model or model_type in REFUSED_ARCHITECTURES):
            raise UnsupportedModelError(unsupported_message(model_type, type(self.model).__name__))
        if self.model.get_output_embeddings() is None or not hasattr(self.model, "generate"):
            raise UnsupportedModelError(
                f"{type(self.model).__name__} has no language-model head: load it with AutoModelForCausalLM."
            )
        # BERT-style configs, once there is an LM head to read (GPT-NeoX's declares is_decoder=False too: causal)
        if (
            model_type not in SUPPORTED_ARCHITECTURES
            and getattr(config, "is_decoder", True) is False
            and probes.attends_ahead(self.model)
        ):
            raise UnsupportedModelError(
                f"{type(self.model).__name__} ({model_type}) has is_decoder=False: its positions attend to later ones, "
                "so a pass over several drafts computes what one-token steps do not. Load it with is_decoder=True."
            )
        if model_type not in SUPPORTED_ARCHITECTURES and probes.generate_feeds_other_tokens(self.model):
            raise UnsupportedModelError(
                f"{type(self.model).__name__} ({model_type}): its generate feeds the forward other tokens than the "
                "sequence (XLM's appends a mask token to every pass and predicts there), which drafts verified in one "
                "pass over the sequence's own tokens do not reproduce."
            )
        family = SUPPORTED_ARCHITECTURES.get(model_type)
        stack = getattr(self.model, family.stack, None) if family is not None else self.model.base_model
        if stack is None:
            raise UnsupportedModelError(
                f"{type(self.model).__name__} has no decoder stack `.{family.stack}`: "
                "load it with AutoModelForCausalLM."
            )
        self.config = config
        self.model_type = model_type
        self.lm_head: nn.Module = self.model.get_output_embeddings()
        if family is None:  # the whole model only (`whole_model`): no layer ranges, no hidden states
            self.layers = self.final_norm = None
            text = config.get_text_config()
            self.num_layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", 0)
            family = Family("", "", "")
        else:
            self.layers: nn.ModuleList = getattr(stack, family.layers)
            self.final_norm: nn.Module = getattr(stack, family.norm)
            self.num_layers = len(self.layers)
        self.whole_model_only = self.layers is None
        self.family, self.stack = family, stack
        self.hidden_size = config.hidden_size
        self.vocab_size = self.lm_head.weight.shape[0]
        self.softcap = getattr(config, "final_logit_softcapping", None)
        # what the causal LM divides (Granite) or multiplies (Cohere2) its LM head's output by, before any capping
        self.logit_divisor = getattr(config, family.divide_logits_by) if family.divide_logits_by else None
        self.logit_scale = getattr(config, family.multiply_logits_by) if family.multiply_logits_by else None
        self.rope_switch = probes.longrope_switch(config)
        at_switch = probes.generate_at_rope_switch(self.model, config) if self.rope_switch is not None else None
        # the sequence index at which generate recomputes the cache with longrope's long frequencies (None: never)
        self.rope_recompute_at = at_switch[1] if at_switch and at_switch[0] == "recompute" else None
        # the sequence index at which generate drops the cache and goes on from the pending token alone (None: never)
        self.rope_restart_at = at_switch[1] if at_switch and at_switch[0] == "restart" else None
        self._cache_keyword = probes.cache_keyword(self.model.forward)
        takes_position_ids = "position_ids" in inspect.signature(self.model.forward).parameters
        # False where the forward numbers positions itself, by cache slot (BART's and TrOCR's decoders), so that
        # padding added before a row's tokens moves them (BLOOM's and MPT's take none either, but follow the mask)
        self.padding_keeps_positions = takes_position_ids or model_type in MASK_POSITIONED_MODELS
        # the token id the forward gives no position and does not count (a pass over several tokens then numbers
        # the ones after it otherwise than one-token steps do); None for the families selfspec drives
        self.token_without_position = (
            probes.token_without_position(self.model, takes_position_ids) if self.whole_model_only else None
        )
        self._layer_returns_tuple = False
        # passes over several positions multiply with a packed copy of the linear weights (`.packed`)
        if packed_weights is None:
            packed_weights = packed_by_default(self.model)[0]
        self.packed = PackedLinears(self.model) if packed_weights else None

    # ----------------------------------------------------------------------------------------- facts
    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def max_positions(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None) or getattr(self.config, "n_positions", None)

    def fingerprint(self) -> ModelFingerprint:
        return ModelFingerprint(
            model_type=self.model_type,
            num_hidden_layers=self.num_layers,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            name_or_path=str(getattr(self.config, "_name_or_path", "") or ""),
        )

    # ----------------------------------------------------------------------------------------- cache
    def new_cache(self, capacity: int | None = None) -> DynamicCache:
        """A dynamic cache whose sliding-window layers keep their past until cropped (so rollback works). It grows
        as needed: `capacity`, the positions a call may write, is for caches allocated ahead (`CompiledAdapter`)."""
        cache = DynamicCache(config=self.config)
        cache.activate_past_recording()
        if self.whole_model_only:  # a family not checked by selfspec's tests: its cache must roll back as ours do
            odd = {type(layer).__name__ for layer in cache.layers} - {"DynamicLayer", "DynamicSlidingWindowLayer"}
            if odd:
                raise UnsupportedModelError(
                    f"{type(self.model).__name__}'s cache has {', '.join(sorted(odd))} layers, which cannot drop "
                    "rejected drafts: selfspec drafts only where every cache layer is an attention KV layer."
                )
        return cache

    def check_cache_filled(self, cache: DynamicCache, length: int) -> None:
        """After the prefill wrote `length` positions into the empty `cache`: refuse a model whose forward left it
        empty, having swallowed it (a model without a KV cache, such as GPT-1, or one that keeps its state in an
        argument of its own): every later pass would see only its own tokens."""
        if max((layer.get_seq_length() for layer in cache.layers), default=0) != length:
            raise UnsupportedModelError(
                f"{type(self.model).__name__} ({self.model_type}) left the cache empty: its forward keeps no KV cache, "
                "or keeps its state elsewhere. selfspec drafts only where the model reads and writes its past through "
                "the attention KV cache it is passed."
            )

    @cached_property
    def hides_cached_padding(self) -> bool:
        """Whether positions a 2D attention mask hides stay hidden from later passes over the cache, as a batch's
        padding needs (`probes.hides_cached_padding`; probed once, at a model's first batch)."""
        return probes.hides_cached_padding(self)

    @staticmethod
    def crop(cache: DynamicCache, num_tokens: int) -> None:
        """Remove the last `num_tokens` positions from every layer (0 trims sliding layers to their window)."""
        for layer in cache.layers:
            layer.crop(-num_tokens)

    def _cache_view(self, cache: DynamicCache, active: range) -> DynamicCache:
        """The cache as the layers in `active` see it.

        Mask sizes and lengths are read from the first layer of each attention type. While the draft has
        written more positions into the lower layers than the upper ones hold, the inactive slots of the
        view alias an active layer of the same type, so every look-up sees the lengths of the layers
        that actually run. The active slots are the real layer objects: updates land in the real cache.
        """
        layers = list(cache.layers)
        for index in range(len(layers)):
            if index in active:
                continue
            same_type = [j for j in active if type(layers[j]) is type(layers[index])]
            layers[index] = layers[same_type[0] if same_type else active[0]]
        view = copy.copy(cache)
        view.layers = layers
        return view

    @classmethod
    def keep_new(cls, cache: DynamicCache, num_new: int, kept: torch.Tensor) -> None:
        """Of the `num_new` positions the last pass wrote into every layer, keep those at `kept` [batch, width] (in
        order, ascending: a tree's accepted path) right after the earlier positions, and drop the rest. Only the
        kept entries move: the earlier positions stay where they are (`rearrange` rebuilds whole layers)."""
        width = kept.shape[1]
        if torch.equal(kept, torch.arange(width, device=kept.device).expand_as(kept)):  # the first ones: in place
            cls.crop(cache, num_new - width)
            return
        for layer in cache.layers:
            new = layer.keys.shape[-2] - num_new
            index = kept[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            for name in ("keys", "values"):
                entries = getattr(layer, name)
                entries[:, :, new : new + width] = entries[:, :, new:].gather(2, index)
        cls.crop(cache, num_new - width)

    @staticmethod
    def rearrange(cache: DynamicCache, num_new: int, index) -> None:
        """Rebuild every layer from its entries: `index(old)` gives, for a layer holding `old` earlier
        positions and the `num_new` positions of the last pass, a [batch, length] gather index over them
        (see `DecodeState.shifted_index`). Sliding layers then trim back to their window."""
        for layer in cache.layers:
            old = layer.keys.shape[-2] - num_new
            rows = index(old)  # [batch, length]
            gather = rows[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, gather), layer.values.gather(2, gather)
            if layer.is_sliding:
                layer.cumulative_length += rows.shape[1] - old - num_new
            layer.crop(0)

    def tree_attention_mask(self, cache: DynamicCache, start: int, tree, past_mask: torch.Tensor | None):
        """Float masks `[batch, 1, N+1, kv_length]` for verifying `tree` (a `CandidateTree`) whose root sits
        at sequence index `start`: every node sees the visible past and its own ancestors, within the
        window on sliding layers. One mask per attention type present, sized as that type's layers see
        the cache; a dict {type: mask} when a model mixes types. past_mask: the 2D mask [batch, start]
        over the sequence indices before the root (None: nothing is padded)."""
        count = tree.num_nodes + 1
        node_index = start + tree.depth  # [N+1] sequence index each node stands for
        batch = 1 if past_mask is None else past_mask.shape[0]
        masks = {}
        for layer in cache.layers:
            kind = "sliding_attention" if layer.is_sliding else "full_attention"
            if kind in masks:
                continue
            kv_length, kv_offset = layer.get_mask_sizes(count)
            past_index = kv_offset + torch.arange(kv_length - count, device=node_index.device)
            key_index = torch.cat([past_index, node_index])  # [kv_length]
            visible = torch.cat(
                [torch.ones(count, kv_length - count, dtype=torch.bool, device=node_index.device), tree.visible], dim=1
            )[None].expand(batch, -1, -1)  # [batch, N+1, kv_length]
            if layer.is_sliding:
                visible = visible & (key_index[None, :] > node_index[:, None] - layer.sliding_window)[None]
            if past_mask is not None:  # padding stays invisible
                masked_keys = max(0, min(past_mask.shape[1] - kv_offset, kv_length - count))
                keys_ok = torch.ones(batch, kv_length, dtype=torch.bool, device=node_index.device)
                keys_ok[:, :masked_keys] = past_mask[:, kv_offset : kv_offset + masked_keys].bool()
                visible = visible & keys_ok[:, None, :]
            masks[kind] = additive_mask(visible, self.dtype)[:, None]
        if len(masks) == 1:
            return next(iter(masks.values()))
        if self.model_type not in MIXED_MASK_MODELS:
            raise NotImplementedError(f"Tree verification for {self.model_type} with mixed attention types.")
        return masks

    # ---------------------------------------------------------------------------------------- passes
    def _forward(self, input_ids, position_ids, cache, attention_mask, logits_to_keep: int = 0):
        packed = self.packed() if self.packed is not None and input_ids.numel() > 1 else nullcontext()
        with grouped_attention(self.config), packed:  # no copy of the cached keys per query head (`.grouped`)
            return self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **{self._cache_keyword: cache},
            )

    def forward(self, input_ids, position_ids, cache, attention_mask=None, logits_to_keep: int = 0) -> torch.Tensor:
        """All layers: logits `[batch, positions, vocab]` (the last `logits_to_keep` positions if > 0)."""
        return self._logits(
            self._forward(input_ids, position_ids, cache, attention_mask, logits_to_keep), logits_to_keep
        )

    @staticmethod
    def _logits(output, logits_to_keep: int) -> torch.Tensor:
        """The output's logits, of the last `logits_to_keep` positions if > 0: some forwards (TrOCR's) take no
        `logits_to_keep` and return every position's."""
        return output.logits[:, -logits_to_keep:] if logits_to_keep > 0 else output.logits

    def forward_with_hidden(self, input_ids, position_ids, cache, attention_mask=None, logits_to_keep: int = 0):
        """All layers: (logits, last hidden state after the final norm `[batch, positions, H]`)."""
        logits, hidden = self.forward_capturing(
            input_ids, position_ids, cache, attention_mask, (FINAL,), logits_to_keep
        )
        return logits, hidden[FINAL]

    def forward_capturing(self, input_ids, position_ids, cache, attention_mask=None, layers=(), logits_to_keep=0):
        """All layers: (logits, {layer: hidden [batch, positions, H]}) for decoder layer indices (that
        layer's output) and `FINAL` (after the final norm) in `layers`."""
        with self._capture(layers) as captured:
            logits = self._logits(
                self._forward(input_ids, position_ids, cache, attention_mask, logits_to_keep), logits_to_keep
            )
        return logits, captured

    @contextmanager
    def _capture(self, layers):
        """Collects the outputs of the decoder layers and/or the final norm named in `layers` while inside."""
        captured: dict = {}

        def keep(name):
            def hook(module, args, output):
                captured[name] = output[0] if isinstance(output, tuple) else output

            return hook

        handles = []
        try:
            for name in layers:
                module = self.final_norm if name == FINAL else self.layers[name]
                handles.append(module.register_forward_hook(keep(name)))
            yield captured
        finally:
            for handle in handles:
                handle.remove()

    def run_lower(self, input_ids, position_ids, cache, exit_layer: int, attention_mask=None) -> torch.Tensor:
        """Layers 0..exit_layer-1 only: the hidden state after layer `exit_layer` (before any norm)."""

        def stop(module, args, output):
            self._layer_returns_tuple = isinstance(output, tuple)
            raise _StopAfterLayer(output[0] if isinstance(output, tuple) else output)

        handle = self.layers[exit_layer - 1].register_forward_hook(stop)
        view = self._cache_view(cache, range(exit_layer))
        try:
            self._forward(input_ids, position_ids, view, attention_mask, logits_to_keep=1)
        except _StopAfterLayer as stopped:
            return stopped.hidden
        finally:
            handle.remove()
        raise RuntimeError(f"layer {exit_layer - 1} of {self.model_type} never ran; cannot exit early there")

    def run_upper(self, hidden, input_ids, position_ids, cache, exit_layer: int, attention_mask=None, layers=()):
        """Layers exit_layer..L-1 on `hidden` (the states after layer `exit_layer`): (logits for every position,
        {layer: hidden} for `layers` as in `forward_capturing`; only layers from exit_layer on, or `FINAL`)."""
        lower = [name for name in layers if name != FINAL and name < exit_layer]
        if lower:
            raise ValueError(f"layers {lower} ran in the draft, before exit layer {exit_layer}: not captured here")
        view = self._cache_view(cache, range(exit_layer, self.num_layers))
        with self._skip_lower_layers(exit_layer, hidden), self._capture(layers) as captured:
            return self._forward(input_ids, position_ids, view, attention_mask).logits, captured

    @contextmanager
    def _skip_lower_layers(self, exit_layer: int, hidden: torch.Tensor):
        """Layers 0..exit_layer-1 become stand-ins: the first returns `hidden`, the others pass it on."""
        wrap = (lambda h: (h,)) if self._layer_returns_tuple else (lambda h: h)

        def first(*args, **kwargs):
            return wrap(hidden)

        def passthrough(hidden_states, *args, **kwargs):
            return wrap(hidden_states[0] if isinstance(hidden_states, tuple) else hidden_states)

        saved = []
        try:
            for index in range(exit_layer):
                layer = self.layers[index]
                # keep any forward an accelerate dispatch hook installed on the instance, to restore it
                saved.append((layer, layer.__dict__.get("forward")))
                layer.forward = first if index == 0 else passthrough
            yield
        finally:
            for layer, previous in saved:
                if previous is None:
                    del layer.forward
                else:
                    layer.forward = previous

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """What the decoder stack feeds its first layer for these tokens at these positions (`hidden_states[0]`
        of a forward with output_hidden_states): the token embedding, times the family's embedding multiplier,
        plus its learned position embedding where it has one."""
        states = self.model.get_input_embeddings()(input_ids)
        if self.family.multiply_embeddings_by:
            states = states * getattr(self.config, self.family.multiply_embeddings_by)
        if self.family.position_table:
            states = states + getattr(self.stack, self.family.position_table)(position_ids)
        return states

    def one_layer_config(self) -> dict:
        """The target's config with one decoder layer of full attention, as a dict (`OneLayerModel` builds it)."""
        config = copy.deepcopy(self.config)
        config.num_hidden_layers = 1
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = ["full_attention"]
        return config.to_dict()

    def head_logits(self, hidden: torch.Tensor, vocab: DraftVocabulary | None = None, lora=None) -> torch.Tensor:
        """The model's own final norm and LM head (with its logit scaling and soft-capping) on `hidden`."""
        return self.lm_logits(self.final_norm(hidden), vocab=vocab, lora=lora)

    def lm_logits(
        self, normed: torch.Tensor, lm_head: nn.Module | None = None, vocab: DraftVocabulary | None = None, lora=None
    ) -> torch.Tensor:
        """The LM head (the model's own unless another is given), the model's logit scaling and soft-capping; with a
        draft `vocab`, only that vocabulary's rows of the model's LM head, every other token at -inf; with a draft
        `lora` (`selfspec.heads.lora.DraftLoRA`, drafts only), its low-rank update added before the capping."""
        if lora is not None and lm_head is not None:
            raise ValueError("A draft LoRA adapts the model's own LM head, not a head's own.")
        if vocab is not None and lm_head is None:
            logits = vocab.project(normed)
            if lora is not None:
                logits = logits + lora.delta(normed, vocab.rows)
            return vocab.spread(self._finish(logits))
        if vocab is not None:
            raise ValueError("A reduced draft vocabulary applies to the model's own LM head, not to a head's own.")
        logits = (lm_head or self.lm_head)(normed)
        return self._finish(logits + lora.delta(normed) if lora is not None else logits)

    def _finish(self, logits: torch.Tensor) -> torch.Tensor:
        """What the causal LM does to its LM head's output, as it does it: scaling, then soft-capping."""
        if self.logit_divisor is not None:
            logits = logits / self.logit_divisor
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap

    def draft_vocabulary(self, token_ids=None, quant: str | None = None, context: bool = False) -> DraftVocabulary:
        """The LM head as drafts read it (see `DraftVocabulary`): these token ids' rows (None: all), in the
        model's dtype or, with quant="int8", quantised per row; with `context`, each call's own tokens join them.
        `token_ids` may be a JSON file's path."""
        return DraftVocabulary.from_lm_head(self.lm_head, self.hidden_size, token_ids, quant, context)
