"""EAGLE heads: one decoder layer that drafts autoregressively on the target's features.

At sequence index i the head reads the target's feature f_i (the normed last hidden state, EAGLE-1; or the
outputs of several decoder layers fused by a linear map, as EAGLE-3 does) and the input state of the token
x_{i+1} (`ModelAdapter.embed`), joined by `fc`: fc([e(x_{i+1}); f_i]). One decoder layer of the target's own
class (`OneLayerModel`: its attention, MLP, norms and position encoding, with a KV cache of its own) turns that
into o_i, its guess at the next feature; the head's norm and the target's LM head (or a draft vocabulary's rows
of it) give q for x_{i+2}. To draft further it feeds o_i back in place of the feature: fc([e(x_{i+2}); o_i]) at
index i+1, and so on. The drafter is `selfspec.drafters.eagle.EagleDrafter`.

Training unrolls that loop ("training-time test", EAGLE-3): step 0 reads the target's features at every index;
step j reads step j-1's outputs, one index back, and attends to the true entries up to its anchor i-j and to its
own chain's entries after it, so the head learns on the inputs it sees while drafting. Step j's loss is weighted
0.8^j. `unrolled_mask` builds that attention pattern.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache

from ..adapter import FINAL, ModelAdapter, ModelFingerprint, OneLayerModel, additive_mask
from ..engine.adaptive import expected_tokens
from .base import Costs, Draft, DraftHeads, DraftSetting, HeadsMismatchError, on_target

STEP_WEIGHT = 0.8  # the loss of unrolled step j is weighted STEP_WEIGHT ** j
# the dynamic tree shapes `selfspec tune` measures: budgets of nodes verified per pass, and how wide and deep
TUNED_TREES = tuple(
    {"nodes": n, "top_k": k, "depth": d} for n, k, d in ((4, 2, 3), (6, 2, 4), (8, 3, 4), (12, 3, 5), (16, 4, 6))
)


def unrolled_mask(length: int, step: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Float mask [1, 1, length, (step + 1) length] for unrolled step `step` over entries 0..length-1, whose keys
    are every earlier step's entries, step by step: the query at index i (anchor i - step) sees step 0's entries
    up to i - step and, of step k = 1..step, the entry at i - step + k (its own chain)."""
    query = torch.arange(length, device=device)[:, None]
    key = torch.arange(length, device=device)[None, :]
    blocks = [key <= query - step] + [key == query - step + k for k in range(1, step + 1)]
    return additive_mask(torch.cat(blocks, dim=1), dtype)[None, None]


def needed_outputs(taught: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Per unrolled step j, the entries [batch, L] whose outputs something reads, given `taught` [batch, L]: the
    entries whose teacher a loss reads (entry i's is at i + 1, at every step). Step j's output at i is read by its
    own loss, or as the input of step j + 1's entry i + 1, which must then be right: for its own output, or as
    the key of a later step's query on its chain (query i + 1 + m of step j + 1 + m, needed by the same rule).
    So step j needs what it teaches and, shifted one back, all that step j + 1 needs."""
    needed = [taught]
    for _ in range(steps - 1):
        later = needed[0]
        needed.insert(0, taught | torch.cat([later[:, 1:], torch.zeros_like(later[:, :1])], dim=1))
    return needed


class EagleHeads(DraftHeads):
    """An EAGLE head for one target: `fuse` (several feature layers -> hidden size, only with
    `feature_layers`), `fc` (token state and feature -> hidden size), one decoder layer and its norm (`body`),
    then the target's LM head (shared) or a draft vocabulary's rows of it."""

    kind = "eagle"
    setting_names = ("layer_config", "feature_layers", "unroll", "layout", "num_draft_tokens")

    def __init__(
        self,
        fingerprint: ModelFingerprint,
        layer_config: dict,
        feature_layers: list[int] | None = None,
        unroll: int = 3,
        layout: str = "eagle",
        num_draft_tokens: int | None = None,
        position_cost: float | None = None,
        draft_lora: dict | None = None,
    ):
        super().__init__(fingerprint, num_draft_tokens, position_cost, draft_lora)
        hidden = fingerprint.hidden_size
        if (
            layer_config.get("hidden_size", hidden) != hidden
            or layer_config.get("model_type") != fingerprint.model_type
        ):
            raise HeadsMismatchError(
                f"EAGLE head's layer config ({layer_config.get('model_type')}, hidden size "
                f"{layer_config.get('hidden_size')}) is not of its target ({fingerprint.model_type}, {hidden})."
            )
        if feature_layers is not None:
            bad = [k for k in feature_layers if not 0 <= k < fingerprint.num_hidden_layers - 1]
            if bad or not feature_layers:
                raise ValueError(
                    f"feature_layers={feature_layers} must list decoder layers 0..{fingerprint.num_hidden_layers - 2} "
                    "(the last layer's output reaches the LM head normed: leave feature_layers null to read it)."
                )
        if unroll < 1:
            raise ValueError(f"unroll={unroll} must be at least 1 (training steps per position).")
        self.layer_config, self.layout = layer_config, layout
        self.feature_layers = list(feature_layers) if feature_layers is not None else None
        self.unroll = unroll
        width = len(self.features)
        self.fuse = nn.Linear(width * hidden, hidden, bias=False) if width > 1 else None
        self.fc = nn.Linear(2 * hidden, hidden, bias=False) if layout == "eagle" else None
        self.body = OneLayerModel(layer_config, layout)

    @property
    def features(self) -> tuple[int | str, ...]:
        """The target hidden states the head reads, in `fuse`'s order (`Drafter.hidden_layers`)."""
        return tuple(self.feature_layers) if self.feature_layers is not None else (FINAL,)

    # ------------------------------------------------------------------------------------ drafting
    def fused(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [..., width * H] (the layers of `features`, joined) -> [..., H]."""
        features = self._as_input(features)
        return self.fuse(features) if self.fuse is not None else features

    def step(self, hidden, states, position_ids, attention_mask, cache: DynamicCache) -> torch.Tensor:
        """One pass of the head over n entries: features or fed-back outputs `hidden` [batch, n, H] and the next
        tokens' input `states` [batch, n, H] -> outputs o [batch, n, H] (the cache gains the n entries). Layout
        eagle: the layer reads fc([states; hidden]); eagle3: it reads hidden, its attention both (normed)."""
        states = self._as_input(states)
        if self.fc is not None:
            return self.body(self.fc(torch.cat([states, hidden], dim=-1)), position_ids, attention_mask, cache)
        return self.body(hidden, position_ids, attention_mask, cache, token_states=states)

    def logits(self, outputs: torch.Tensor, adapter: ModelAdapter, vocab=None) -> torch.Tensor:
        """Draft logits [..., V] from outputs o [..., H]: the head's norm (eagle3), then the target's LM head."""
        return adapter.lm_logits(on_target(self.body.norm(outputs), adapter), None, vocab, self.draft_lora)

    # ------------------------------------------------------------------------------------ training
    @classmethod
    def from_config(cls, config, adapter: ModelAdapter) -> EagleHeads:
        layer_config = adapter.one_layer_config()
        if config.intermediate_size is not None:  # a wider (or narrower) MLP than the target's layers have
            if "intermediate_size" not in layer_config:
                raise ValueError(
                    f"heads.intermediate_size sets an EAGLE head's MLP width through its layer config's "
                    f"intermediate_size, which a {layer_config.get('model_type')} config does not have: leave it null."
                )
            layer_config["intermediate_size"] = config.intermediate_size
        heads = cls(
            adapter.fingerprint(), layer_config, config.feature_layers, config.unroll, config.layout,
            config.num_draft_tokens,
        )  # fmt: skip
        if heads.layout == "eagle3":
            with torch.no_grad():  # the head's output norm starts as the target's final norm
                for mine, theirs in zip(heads.body.norm.parameters(), adapter.final_norm.parameters(), strict=True):
                    mine.copy_(theirs)
        return heads

    def start_from(self, start: EagleHeads) -> None:
        """As every kind does, or from a head with a narrower MLP (`widened_from`: heads.intermediate_size grew)."""
        if start.layer_config.get("intermediate_size") != self.layer_config.get("intermediate_size"):
            self.widened_from(start)
        else:
            super().start_from(start)

    def widened_from(self, start: EagleHeads) -> None:
        """Take the weights of `start`, a head like this one but for a narrower MLP, so that this one drafts exactly
        as `start` does: each grown weight keeps `start`'s values in its leading block; the new MLP units' inputs
        (rows of the gate and up projections) keep this head's fresh initialisation and their outputs (columns of
        the down projection) start at zero, so they add nothing until training moves them."""
        mine, theirs = self.state_dict(), self.start_state(start)
        narrow, wide = start.layer_config.get("intermediate_size"), self.layer_config.get("intermediate_size")
        if narrow is None or wide is None or narrow > wide:
            raise HeadsMismatchError(f"widened_from: a head can only grow its MLP (from {narrow} to {wide} units).")
        fits = mine.keys() == theirs.keys() and all(
            tensor.dim() == theirs[name].dim()
            and all(a == b or (a, b) == (wide, narrow) for a, b in zip(tensor.shape, theirs[name].shape, strict=True))
            for name, tensor in mine.items()
        )
        if not fits:
            raise HeadsMismatchError("widened_from: the two EAGLE heads differ in more than their MLP width.")
        with torch.no_grad():
            for name, tensor in mine.items():
                old = theirs[name]
                if tensor.dim() == 2 and tensor.shape[1] > old.shape[1]:  # new input columns: new units' outputs
                    tensor[:, old.shape[1] :] = 0
                tensor[tuple(slice(0, size) for size in old.shape)] = old

    def draft_names(self) -> list[str]:
        return [f"eagle_{j}" for j in range(self.unroll)]

    def hidden_entries(self) -> tuple[int, ...]:
        # the token states (entry 0) and the features: decoder layer k's output is entry k + 1
        last = self.fingerprint.num_hidden_layers
        return (0, *sorted({last if k == FINAL else k + 1 for k in self.features}))

    def _target_features(self, hidden_states) -> torch.Tensor:
        """[batch, T, width * H] from a forward's `hidden_states` (decoder layer k's output is entry k + 1)."""
        return torch.cat([hidden_states[-1] if k == FINAL else hidden_states[k + 1] for k in self.features], dim=-1)

    def distillation_drafts(self, adapter: ModelAdapter, hidden_states, vocab=None, learn=None) -> list[Draft]:
        # entry i joins f_i with the state of token i+1 (`hidden_states[0]`, what layer 0 got for it) and predicts
        # token i+2: its teacher is the target's distribution at i+1. Step j's entry i is anchored at i - j.
        features = self._target_features(hidden_states)[:, :-1]
        states = hidden_states[0][:, 1:]
        batch, length = features.shape[:2]
        positions = torch.arange(length, device=features.device)[None].expand(batch, -1)
        cache, hidden, drafts = DynamicCache(), self.fused(features), []
        weight = next(self.parameters())
        steps = min(self.unroll, length)
        needed = needed_outputs(learn[:, 1:].bool(), steps) if learn is not None else [None] * steps
        with self.body.unrolled():  # each step's keys: a causal prefix and one entry per earlier step
            for j in range(steps):
                mask = unrolled_mask(length, j, weight.dtype, weight.device).expand(batch, -1, -1, -1)
                with self.body.only_queries(needed[j]):
                    outputs = self.step(hidden, states, positions, mask, cache)
                drafts.append(Draft(f"eagle_{j}", outputs[:, j:], j + 1, self._head(adapter, vocab), STEP_WEIGHT**j))
                hidden = torch.cat([torch.zeros_like(outputs[:, :1]), outputs[:, :-1]], dim=1)  # fed back, one on
        return drafts

    def _head(self, adapter: ModelAdapter, vocab):
        return lambda outputs: self.logits(outputs, adapter, vocab)

    def untrained_copy(self) -> EagleHeads:
        fresh = EagleHeads(self.fingerprint, self.layer_config, self.feature_layers, self.unroll, self.layout)
        return self._alike(fresh)

    def cost_timers(self, adapter: ModelAdapter, ids, positions, hidden, vocab) -> dict:
        # one draft token: one entry through fc, the layer, the norm and the LM head (the features' values do not
        # change the time, and attending to a one-layer cache of the context's length costs little beside it)
        features = hidden.new_zeros(1, 1, len(self.features) * hidden.shape[-1])
        states = adapter.embed(ids, positions)

        def draft_token(_):
            outputs = self.step(self.fused(features), states, positions, None, DynamicCache())
            return self.logits(outputs, adapter, vocab)

        return {"eagle": (draft_token, self.draft_names())}

    def speedups(self, alphas: dict[str, float], costs: Costs, max_gamma: int) -> dict[str, dict]:
        # a chain of gamma drafts, one head step each: E = 1 + a_0 + a_0 a_1 + ..., cost v(gamma) + gamma c; row j
        # is the chain up to draft j
        names, table = self.draft_names(), {}
        for gamma, name in enumerate(names, start=1):
            c = costs.c(name)
            tokens = expected_tokens([alphas[n] for n in names[:gamma]])
            table[name] = {"c": c, "gamma": gamma, "speedup": tokens / (costs.v(gamma) + gamma * c)}
        return table

    def draft_settings(self, num_layers: int, max_gamma: int) -> list[DraftSetting]:
        return [DraftSetting("eagle", "eagle chain", {}, max_gamma, "eagle_0", 1, 1.0, dynamic_trees=TUNED_TREES)]

    def set_defaults(self, options: dict) -> None:
        """Nothing beyond gamma (`num_draft_tokens`) to record: the head's default is a chain. A dynamic tree
        is asked for per call (`tree=`): trees draft one prompt at a time, alone and uncompiled."""

    def description(self) -> str:
        fed = f"decoder layers {self.feature_layers}" if self.feature_layers else "last hidden state"
        return f"an EAGLE head (one decoder layer on the target's {fed})"
