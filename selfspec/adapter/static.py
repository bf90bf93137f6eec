"""`CompiledAdapter`: the target's full passes compiled with `torch.compile`, over a pre-allocated static cache.

A small model decoding in eager mode spends most of a step in Python and in launching kernels, so verifying
gamma + 1 positions costs what the launches cost rather than what the hardware needs. Compiled, a pass is a few
fused kernels (inductor's C++ backend on a CPU; Triton, and CUDA graphs with `mode="reduce-overhead"`, on a GPU).

- The cache is transformers' `StaticCache`: allocated once, written in place. Rolling back a rejected draft
  moves each layer's write pointer back (`crop`); the entries past it are stale but never seen: a query at
  sequence index i attends to keys at indices <= i, and the indices between the committed length and i are
  written by the same pass. The cache is kept between calls and reset; a call that needs more room gets one at
  least twice as large, so that a growing conversation changes its size rarely. One cache per adapter: calls
  on one `SelfSpeculative` must not overlap (from several threads).
- Two graphs: one position (a plain step; a cache of a new size recompiles it once, after which its length is
  a dynamic dimension too) and 2..n positions with the width as a dynamic dimension (a verify pass), so gamma
  may change every iteration without a recompilation. A call's prefill runs eagerly.
- Drafters' hidden states come from `output_hidden_states` (entry k + 1 is decoder layer k's output, the last
  is the final norm's output), so no hook is added or removed around compiled code. The last decoder layer's
  output before the final norm is therefore not available.

Limits: one prompt at a time, chains (no tree masks), no sliding-window attention layers (a static sliding
layer cannot roll back), no dynamic rope scaling (its update branches on a tensor), drafters that do not run the
target's layers themselves (not the exit-head drafter).
"""

from __future__ import annotations

import types
import weakref

import torch
from transformers import CompileConfig, StaticCache

from .core import FINAL, ModelAdapter, UnsupportedModelError
from .probes import rope_settings

ROOM = 256  # static caches are sized in multiples of this, so that nearby lengths share one cache and one graph


def _full_pass(model, keyword: str, input_ids, position_ids, cache, hidden: bool, logits_to_keep: int = 0):
    """(logits, every hidden state if `hidden`, else None) of one pass; `keyword`: the forward's name for the cache
    argument."""
    out = model(
        input_ids=input_ids,
        position_ids=position_ids,
        use_cache=True,
        output_hidden_states=hidden,
        logits_to_keep=logits_to_keep,
        **{keyword: cache},
    )
    return out.logits, out.hidden_states


_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {options: (one position, many)}


def _compiled_passes(model, options: dict):
    """The two compiled pass functions of `model` (shared by every adapter of it with these options): copies of
    `_full_pass` with code objects of their own. torch.compile keeps its graphs, and its limit of recompilations (a
    hard error with whole graphs), per code object, so the two graphs and other models' never count against each
    other."""
    key = repr(sorted(options.items()))
    per_model = _GRAPHS.setdefault(model, {})
    if key not in per_model:
        code, defaults = _full_pass.__code__, _full_pass.__defaults__
        one, many = (types.FunctionType(code.replace(), _full_pass.__globals__, name, defaults)
                     for name in ("one_position", "many_positions"))  # fmt: skip
        # one position: static until a second cache size is seen, then the cache length is dynamic (automatic)
        per_model[key] = (torch.compile(one, dynamic=None, fullgraph=True, **options),
                          torch.compile(many, dynamic=True, fullgraph=True, **options))  # fmt: skip
    return per_model[key]


def compiled_generate_options() -> dict:
    """Keyword arguments that make `model.generate` run compiled as `compile=True` does (transformers' static cache,
    torch.compile with inductor and whole graphs), on any device: the baseline a compiled selfspec is measured by."""
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True  # transformers compiles only on accelerators unless this is set
    return {"cache_implementation": "static", "compile_config": config}


class CompiledAdapter(ModelAdapter):
    """A `ModelAdapter` whose full passes over its static cache run compiled.

    Args:
        model: the causal LM (as for `ModelAdapter`).
        options: keyword arguments for `torch.compile` (default: inductor, `fullgraph=True`); e.g.
            `{"mode": "reduce-overhead"}` for CUDA graphs on a GPU.
    """

    def __init__(self, model, options: dict | None = None):
        super().__init__(model)
        options = dict(options or {})
        for fixed in ("dynamic", "fullgraph"):
            if fixed in options:
                raise ValueError(
                    f"compile option {fixed!r} is set by selfspec (one static graph for one position, one dynamic "
                    "graph for verify passes, whole graphs only); pass backend or mode."
                )
        sliding = [layer for layer in StaticCache(config=self.config, max_cache_len=1).layers if layer.is_sliding]
        if sliding:
            raise UnsupportedModelError(
                f"compile=True uses a static cache, and {self.model_type} has sliding-window attention layers, whose "
                "static form cannot roll back a rejected draft; use compile=False for this model."
            )
        if any("dynamic" in str(settings.get("rope_type")) for settings in rope_settings(self.config)):
            raise UnsupportedModelError(
                f"compile=True compiles whole graphs, and {self.model_type}'s dynamic rope scaling decides in Python, "
                "from a tensor, whether to recompute its frequencies (torch.compile cannot trace that branch); use "
                "compile=False for this model."
            )
        self._one, self._many = _compiled_passes(self.model, options)
        self._cache: StaticCache | None = None
        self._eager_next = True  # the next pass is a prefill: run it eagerly

    def check_hidden_layers(self, layers) -> None:
        """The compiled pass returns decoder layers 0..L-2's outputs and the final norm's: refuse anything else."""
        for layer in layers:
            if layer != FINAL and not 0 <= layer < self.num_layers - 1:
                raise ValueError(
                    f"compile=True reads hidden states from output_hidden_states: decoder layers 0.."
                    f"{self.num_layers - 2} or {FINAL!r}, not {layer!r} (the last layer's output is only returned "
                    "after the final norm)."
                )

    def new_cache(self, capacity: int | None = None) -> StaticCache:
        """The static cache, reset, with room for `capacity` positions: a new one (a multiple of ROOM, at least twice
        the old size) when the old one is too small or no longer matches the model's dtype or device."""
        if capacity is None:
            raise ValueError("A static cache needs the number of positions it must hold (capacity).")
        old = self._cache.layers[0] if self._cache is not None else None
        keys = getattr(old, "keys", None)  # allocated by the first pass
        stale = keys is not None and (keys.dtype != self.dtype or keys.device != self.device)
        if old is None or old.max_cache_len < capacity or stale:
            size = max(-(-capacity // ROOM) * ROOM, 2 * old.max_cache_len if old is not None and not stale else 0)
            self._cache = StaticCache(config=self.config, max_cache_len=size)
        else:
            self._cache.reset()
        self._eager_next = True
        return self._cache

    @staticmethod
    def crop(cache, num_tokens: int) -> None:
        """Move every layer's write pointer back by `num_tokens` (nothing to do for 0: no window to trim)."""
        if num_tokens:
            ModelAdapter.crop(cache, num_tokens)

    def forward(self, input_ids, position_ids, cache, attention_mask=None, logits_to_keep: int = 0) -> torch.Tensor:
        return self.forward_capturing(input_ids, position_ids, cache, attention_mask, (), logits_to_keep)[0]

    def forward_capturing(self, input_ids, position_ids, cache, attention_mask=None, layers=(), logits_to_keep=0):
        """As `ModelAdapter.forward_capturing`; over the static cache, compiled (the prefill eagerly)."""
        if cache is not self._cache:
            return super().forward_capturing(input_ids, position_ids, cache, attention_mask, layers, logits_to_keep)
        if attention_mask is not None:
            raise NotImplementedError("compile=True verifies one unpadded prompt's chain: no attention mask.")
        hidden = bool(layers)  # the n-gram drafter and the plain loop read none: the graphs then return none
        if self._eager_next:  # the prefill (its length varies); also installs transformers' capture hooks
            self._eager_next = False
            logits, states = _full_pass(self.model, self._cache_keyword, input_ids, position_ids, cache, hidden,
                                        logits_to_keep)  # fmt: skip
        else:
            run = self._one if input_ids.shape[1] == 1 else self._many
            # standard strides: slices of the sequences have strides that change every step, and strides are guarded
            input_ids, position_ids = (
                value.clone(memory_format=torch.contiguous_format) for value in (input_ids, position_ids)
            )
            logits, states = run(self.model, self._cache_keyword, input_ids, position_ids, cache, hidden)
            if logits_to_keep:
                logits = logits[:, -logits_to_keep:]
        hidden = {layer: states[-1] if layer == FINAL else states[layer + 1] for layer in layers}
        if logits.device.type == "cuda":  # CUDA graphs reuse their output memory on the next replay
            logits, hidden = logits.clone(), {layer: value.clone() for layer, value in hidden.items()}
        return logits, hidden
