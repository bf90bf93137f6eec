"""The model families selfspec drives, where their parts live, and the rule that decides what is supported.

Data only: `adapter.py` is the one module that touches the modules named here.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORT_RULE = """\
A model family is supported when selfspec can drive its stock transformers layers exactly:
  1. Parts: the causal LM holds a decoder stack with a list of decoder layers and one final norm, and
     its LM head is `get_output_embeddings()`; each layer maps hidden states to hidden states, so the
     stack can stop after layer k (the draft) and resume at layer k (the verify pass reuses the KV).
     What happens inside a layer is free: post-norms, parallel attention/MLP, q/k norms, multipliers.
  2. State: every layer's only state is its attention KV cache, which `DynamicCache` holds per layer
     and crops per position. Recurrent or state-space layers (linear attention, convolutions, Mamba)
     cannot roll back rejected drafts: such hybrids are refused.
  3. Positions are independent: a layer computes each position from it and the past it attends to, so
     a verify pass over several positions computes what one-position steps do. Mixtures of experts
     routed per position qualify (Mixtral, Qwen3-MoE); capacity limits that drop tokens would not.
  4. Mask: full and sliding-window layers may mix only where the forward takes a {layer type: 4D mask}
     dict (tree verification passes one mask per type).
  5. Rope depends on the position alone (per layer type is fine, NoPE layers too; llama3 and yarn
     scaling are). Frequencies that depend on the pass are handled where the switch is known: longrope
     (verify passes never straddle it, and where generate recomputes its cache at the switch, Phi3's,
     selfspec does too); dynamic NTK changes only past max_position_embeddings, which selfspec never
     generates past.
  6. Logits: the causal LM may scale its LM head's output (Granite divides by logits_scaling, Cohere2
     multiplies by logit_scale) and soft-cap it (final_logit_softcapping); drafts apply the same.
A family joins the supported list only with a tiny config in tests/tiny_models.py that passes the
exactness tests: greedy against model.generate, padded batches, Medusa chain and tree, draft vocabularies."""


@dataclass(frozen=True)
class Family:
    """Where one family's parts live and what its logits need, as the adapter reads them."""

    stack: str  # decoder stack attribute on the causal LM
    layers: str  # decoder layer list attribute on the stack
    norm: str  # final norm attribute on the stack
    mixed_masks: bool = False  # forward takes a {layer type: 4D mask} dict (full and sliding layers mix)
    divide_logits_by: str | None = None  # config attribute the causal LM divides its LM head's output by
    multiply_logits_by: str | None = None  # config attribute the causal LM multiplies its LM head's output by
    # what the stack adds to the token embedding before layer 0 (an EAGLE head's token input reproduces it)
    multiply_embeddings_by: str | None = None  # config attribute the stack multiplies the token embeddings by
    position_table: str | None = None  # stack attribute of a learned position embedding added to them
    input_norm: str | None = "input_layernorm"  # decoder layer attribute of its pre-attention norm (None: none)


def _llama_like(**extra) -> Family:
    return Family("model", "layers", "norm", **extra)


SUPPORTED_ARCHITECTURES: dict[str, Family] = {
    "llama": _llama_like(),
    "qwen2": _llama_like(mixed_masks=True),
    "mistral": _llama_like(),
    "phi3": _llama_like(),
    "gemma": _llama_like(),
    "gemma2": _llama_like(mixed_masks=True),
    "gpt2": Family("transformer", "h", "ln_f", position_table="wpe", input_norm="ln_1"),
    "gpt_neox": Family("gpt_neox", "layers", "final_layer_norm"),
    "qwen3": _llama_like(mixed_masks=True),
    "olmo2": _llama_like(input_norm=None),  # norms after attention and MLP only
    "starcoder2": _llama_like(),
    "mixtral": _llama_like(),
    "qwen3_moe": _llama_like(),
    "ministral": _llama_like(mixed_masks=True),
    "smollm3": _llama_like(mixed_masks=True),
    "granite": _llama_like(divide_logits_by="logits_scaling", multiply_embeddings_by="embedding_multiplier"),
    "cohere2": _llama_like(mixed_masks=True, multiply_logits_by="logit_scale"),
    "gemma3_text": _llama_like(mixed_masks=True),
}

# families whose forward takes a {layer type: 4D mask} dict, needed when full and sliding layers mix
MIXED_MASK_MODELS = {name for name, family in SUPPORTED_ARCHITECTURES.items() if family.mixed_masks}

# families outside the list whose forward takes no position_ids but places tokens by the attention mask (ALiBi), so
# the left padding a batch gains does not move them: their padded batches are tested exact (tests/test_model_free.py)
MASK_POSITIONED_MODELS = {"bloom", "mpt"}

# known model types that break the rule, and which part of it
REFUSED_ARCHITECTURES: dict[str, str] = {
    "qwen3_next": "its linear-attention (Gated DeltaNet) layers keep a recurrent state (rule 2)",
    "lfm2": "its short-convolution layers keep a recurrent state (rule 2)",
    "mamba": "its state-space layers keep a recurrent state (rule 2)",
    "mamba2": "its state-space layers keep a recurrent state (rule 2)",
    "jamba": "its Mamba layers keep a recurrent state (rule 2)",
    "falcon_h1": "its Mamba layers keep a recurrent state (rule 2)",
    "recurrent_gemma": "its recurrent blocks keep a state (rule 2)",
    "rwkv": "its time-mixing layers keep a recurrent state (rule 2)",
    "prophetnet": "its decoder runs a pass over cached positions one token at a time and numbers a pass's tokens "
    "alike, so a pass over several drafts computes what one-token steps do not (rule 3)",
    "granitemoehybrid": "its Mamba layers keep a recurrent state (rule 2)",
    "gemma3": "it is the image-text wrapper, its layers under `.model.language_model` (rule 1); load the text "
    "model, Gemma3ForCausalLM (model type gemma3_text)",
}


def unsupported_message(model_type: str | None, class_name: str) -> str:
    """Why `model_type` is refused, naming it and pointing at the rule."""
    reason = REFUSED_ARCHITECTURES.get(model_type, "no tiny config of it has passed selfspec's exactness tests")
    return (
        f"Architecture {model_type!r} ({class_name}) is not supported: {reason}. Supported model types: "
        f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}. `selfspec architectures` prints the rule that decides "
        "(README, 'Supported families')."
    )
