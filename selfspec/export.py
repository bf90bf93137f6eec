"""Export for serving engines: an EAGLE head (`selfspec.heads.EagleHeads`) as a draft checkpoint that vLLM and
SGLang load, and one imported back; the target itself as a Hugging Face folder they load.

Serving engines run EAGLE drafts with kernels and schedulers selfspec does not have; what they need is our head's
weights under their names, in their layout, with a config their loaders read as we mean it. Both engines load
unprefixed safetensors names and a Llama config. The mapping is defined for Llama targets only:
- format "eagle" (EAGLE-1; our layout "eagle" on the target's last hidden state): fc [h, 2h] with a zero bias
  (SGLang always has one, vLLM ignores it), layer 0 without an input norm, no final norm and no LM head (both
  engines share the target's). The engines disagree on the architecture's name, so `engine` is required.
- format "eagle3" (our layout "eagle3" on decoder layer outputs): fc = our `fuse`, layer 0 with q/k/v reading
  [input_layernorm(embedding); hidden_norm(hidden)], the final norm, the LM head's rows for the draft vocabulary
  and, when that is smaller than the target's, d2t (draft id -> target id offsets). Our layer k ("output of
  decoder layer k") is aux id k + 1 in vLLM and k in SGLang: with EAGLE's default layers [1, L/2-1, L-4] the ids
  are left out (both engines default to them); other layers need `engine`, and the file works in that one only.
- format "speculators" (vLLM only): the eagle3 tensors with the config of vLLM's `speculators` format
  (vllm/transformers_utils/configs/speculators): the Llama layer config nested in `transformer_layer_config`, the
  draft tokens per step, and the verifier (the target's folder or hub name), so that `vllm serve FOLDER` finds the
  target and the speculative settings in the draft's folder alone.
The engines' loaders (read in vLLM 0.32-0.33 and SGLang 0.5.23) leave missing tensors uninitialised silently, so
the export refuses what it cannot write exactly (other families, draft LoRAs, logit scaling, biases), and
`load_export` rebuilds our head from a folder to check that it drafts identically.

`export_target` writes the target (a model loaded from a GGUF file included, dequantized) as the folder the engines
load: safetensors weights, config, generation config and tokenizer with its chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from .adapter import ModelAdapter, UnsupportedModelError
from .heads import CONFIG_NAME, WEIGHTS_NAME, EagleHeads, HeadsMismatchError, check_fingerprint
from .heads.base import CARD_NAME, staged_folder, write_folder

FORMATS = ("eagle", "eagle3", "speculators")
ENGINES = ("vllm", "sglang")
ARCHITECTURES = {
    ("eagle", "vllm"): "EagleLlamaForCausalLM",
    ("eagle", "sglang"): "LlamaForCausalLMEagle",
    ("eagle3", None): "LlamaForCausalLMEagle3",
}
LAYOUTS = {"eagle": "eagle", "eagle3": "eagle3", "speculators": "eagle3"}  # format -> the head layout it holds
AUX_ID_OFFSET = {"vllm": 1, "sglang": 0}  # engine aux id = our feature layer (a decoder layer's output) + offset
COPIED_FIELDS = (  # Llama config fields the engines' draft layer reads, as the target has them (the MLP's: the head's)
    "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "rms_norm_eps", "max_position_embeddings", "rope_parameters",
)  # fmt: skip
SIZES = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")  # what a head and its target share
DEFAULT_SPECULATIVE_TOKENS = 3  # draft tokens per step in the serving commands, for a head without a tuned gamma


def default_feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's fused layers for a target of `num_layers` layers (what both engines use when no ids are given)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def _slots(heads: EagleHeads, format: str) -> dict[str, torch.nn.Parameter]:
    """The checkpoint name of each of the head's parameters (eagle3's fc only when the head has a `fuse`)."""
    layer = heads.body.base.layers[0]
    names = {"layers.0.post_attention_layernorm.weight": layer.post_attention_layernorm.weight}
    for part in ("self_attn", "mlp"):
        names |= {f"layers.0.{part}.{name}": p for name, p in getattr(layer, part).named_parameters()}
    if format == "eagle":
        return {"fc.weight": heads.fc.weight, **names}
    joined = heads.body.joined
    names |= {
        "layers.0.input_layernorm.weight": joined.embed_norm.weight,
        "layers.0.hidden_norm.weight": joined.hidden_norm.weight,
        "norm.weight": heads.body.norm.weight,
    }
    return {"fc.weight": heads.fuse.weight, **names} if heads.fuse is not None else names


def _check_target(adapter: ModelAdapter) -> None:
    config = adapter.config
    if adapter.model_type != "llama":
        raise UnsupportedModelError(
            f"Export to vLLM/SGLang EAGLE checkpoints is defined for Llama targets only; a mapping for "
            f"{adapter.model_type} is not defined."
        )
    if adapter.softcap is not None or getattr(config, "logit_scale", 1.0) not in (None, 1.0):
        raise UnsupportedModelError(
            "The target soft-caps or scales its logits (final_logit_softcapping / logit_scale): the engines' "
            "EAGLE drafts would not reproduce them."
        )
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise UnsupportedModelError("The target has attention_bias / mlp_bias: SGLang's EAGLE-3 layer has no slot.")


def _feature_layers(heads: EagleHeads, format: str) -> list[int] | None:
    """The head's fused layers after checking that they fit `format`."""
    layers, layout = heads.feature_layers, LAYOUTS[format]
    if heads.layout != layout:
        raise ValueError(f"format {format!r} needs an EAGLE head of layout {layout!r}; this one is {heads.layout!r}.")
    if format == "eagle" and layers is not None:
        raise ValueError(f"format 'eagle' reads the target's last hidden state; this head fuses layers {layers}.")
    if layout == "eagle3" and layers is None:
        raise ValueError(f"format {format!r} fuses decoder layer outputs; this head has no feature_layers.")
    if layers is not None and layers != sorted(set(layers)):
        raise ValueError(f"feature_layers={layers} must be strictly ascending: the engines fuse them in that order.")
    return layers


def _config(adapter: ModelAdapter, heads: EagleHeads, format: str, engine: str | None, aux_ids, draft_size) -> dict:
    target = adapter.config
    rope = dict(target.rope_parameters)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope.get("rope_type") != "default" else None
    config = {
        "architectures": [ARCHITECTURES[format, engine if format == "eagle" else None]],
        "model_type": "llama",
        **{field: getattr(target, field) for field in COPIED_FIELDS},
        "intermediate_size": heads.layer_config["intermediate_size"],  # the head's MLP may be wider than the target's
        "rope_theta": rope["rope_theta"],  # the older spelling, for engines on transformers 4
        "rope_scaling": scaling,
        "vocab_size": adapter.vocab_size,
        "num_hidden_layers": 1,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": str(adapter.dtype).removeprefix("torch."),
        # for load_export: the convention the aux ids follow, the head's gamma and target
        "selfspec": {
            "format": format,
            "engine": engine,
            "num_draft_tokens": heads.num_draft_tokens,
            "target": adapter.fingerprint().to_dict(),
        },
    }
    if format == "eagle3":
        config["draft_vocab_size"] = draft_size
        if aux_ids is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids}
    return config


def _card(adapter: ModelAdapter, heads: EagleHeads, format: str, engine: str | None, aux_ids, path: Path) -> str:
    target = adapter.fingerprint().name_or_path or "TARGET"
    gamma = heads.num_draft_tokens or DEFAULT_SPECULATIVE_TOKENS
    ids = f"aux ids {aux_ids} in {engine}'s convention" if aux_ids else "EAGLE's default layers (no ids written)"
    serve = {
        "vllm": f"vllm serve {target} --speculative-config "
        f'\'{{"method": "{format}", "model": "{path}", "num_speculative_tokens": {gamma}}}\'',
        "sglang": f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {format.upper()} "
        f"--speculative-draft-model-path {path} --speculative-num-steps {gamma} --speculative-eagle-topk 1 "
        f"--speculative-num-draft-tokens {gamma + 1}",
    }
    commands = [serve[name] for name in ENGINES if engine in (None, name)]
    features = f"decoder layers {heads.feature_layers}, {ids}" if format == "eagle3" else "the last hidden state"
    lines = [f"# {format} draft for {target}", "", f"Exported by `selfspec export` from an EAGLE head on {features}."]
    lines += [f"For {engine or 'vLLM and SGLang'}. Serve it with (the flags their documentation gives; selfspec "
              "does not run the engines):", "", *(f"    {c}" for c in commands), ""]  # fmt: skip
    return "\n".join(lines)


def _speculators_config(config: dict, verifier: dict, gamma: int) -> dict:
    """vLLM's `speculators` format around the eagle3 draft `config` that `_config` wrote (the fields vLLM 0.32 reads,
    named as the speculators library names them)."""
    outside = ("architectures", "draft_vocab_size", "selfspec")  # fields of the speculators config itself
    layer = {key: value for key, value in config.items() if key not in outside}
    ids = config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    return {
        "architectures": ["Eagle3Speculator"],  # the speculators library's name; vLLM takes its class from model_type
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,  # with eagle_config's ids, from which vLLM's draft sizes its fc
        "draft_vocab_size": config["draft_vocab_size"],
        # our layer's residual is the fused feature itself, before hidden_norm; vLLM reads a missing field as True
        "norm_before_residual": False,
        **({"eagle_aux_hidden_state_layer_ids": ids} if ids else {}),  # the runner's aux layers (vLLM's ids)
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": gamma}],
            "verifier": verifier,
        },
        "selfspec": {**config["selfspec"], "format": "speculators"},
    }


def _speculators_card(target: str, verifier: str, gamma: int, path: Path) -> str:
    lines = [f"# EAGLE-3 draft for {target}, in vLLM's speculators format", ""]
    lines += [f"Exported by `selfspec export --format speculators`. The verifier (the target vLLM serves) is "
              f"`{verifier}`; {gamma} draft tokens per step. Serve both with:", "", f"    vllm serve {path}",
              ""]  # fmt: skip
    return "\n".join(lines)


def _verifier(verifier: str | Path, adapter: ModelAdapter) -> dict:
    """The speculators config's verifier: an existing folder by its absolute path, once its config.json shows this
    target's sizes; anything else as given (a hub name)."""
    path = Path(verifier).expanduser()
    if not path.exists():
        if str(verifier).startswith(("/", ".", "~")):
            raise ValueError(f"verifier {str(verifier)!r}: no such folder (write it with export_target first).")
        return {"name_or_path": str(verifier), "architectures": [type(adapter.model).__name__]}
    if not (path / CONFIG_NAME).is_file():
        raise ValueError(f"verifier {str(verifier)!r} has no {CONFIG_NAME}: pass the target's folder (export_target).")
    config, mine = json.loads((path / CONFIG_NAME).read_text()), adapter.fingerprint().to_dict()
    theirs = {key: config.get(key) for key in SIZES}
    if any(mine[key] != value for key, value in theirs.items()):
        raise HeadsMismatchError(f"verifier {str(verifier)!r} holds a model of {theirs}, not the head's target {mine}.")
    return {
        "name_or_path": str(path.resolve()),
        "architectures": config.get("architectures") or [type(adapter.model).__name__],
    }


def export_eagle(
    heads: EagleHeads,
    model,
    path,
    format: str = "eagle3",
    engine: str | None = None,
    draft_vocab=None,
    verifier: str | Path | None = None,
):
    """Write `heads` (an EAGLE head trained for `model`) to the folder `path` as a vLLM/SGLang EAGLE draft checkpoint:
    config.json, model.safetensors (in the target's dtype) and README.md, atomically.

    format: "eagle" (EAGLE-1, layout "eagle", no feature layers), "eagle3" (layout "eagle3", feature layers
    ascending) or "speculators" (the eagle3 checkpoint in vLLM's speculators format, naming `verifier`).
    engine: "vllm" or "sglang", required for "eagle" (the architecture names differ) and for "eagle3" heads whose
    feature layers are not EAGLE's default [1, L/2-1, L-4]: their aux ids are written in that engine's convention
    (vLLM: our layer + 1, SGLang: our layer) and select other layers in the other engine; "speculators" is vLLM's.
    draft_vocab (eagle3, speculators): token ids (or a JSON file of them) the draft's LM head keeps; None: all.
    verifier (speculators only): the target's folder (`export_target`; checked against `model` and written as an
    absolute path) or hub name, which `vllm serve path` loads as the target.
    Raises UnsupportedModelError for targets other than plain Llama, ValueError for heads that do not fit."""
    adapter = ModelAdapter(model)
    _check_target(adapter)
    if not isinstance(heads, EagleHeads):
        raise ValueError(f"Only EAGLE heads export to serving engines; these are {heads.description()}.")
    if format not in FORMATS or engine not in (None, *ENGINES):
        raise ValueError(
            f"format={format!r}, engine={engine!r}: expected a format of {FORMATS}, an engine of {ENGINES}"
        )
    speculators = format == "speculators"
    if speculators and engine not in (None, "vllm"):
        raise ValueError(f"format 'speculators' is vLLM's; engine={engine!r} does not read it (use format 'eagle3').")
    if speculators != (verifier is not None):
        raise ValueError("format 'speculators' needs verifier= (the target vLLM serves); other formats take none.")
    mine, theirs = heads.fingerprint.to_dict(), adapter.fingerprint().to_dict()
    if any(mine[key] != theirs[key] for key in SIZES):
        raise HeadsMismatchError(f"The head was trained for {heads.fingerprint}, not {adapter.fingerprint()}.")
    if heads.draft_lora is not None:
        raise ValueError("The head has a draft LoRA on the LM head: the engines' EAGLE drafts have no slot for it.")
    layers = _feature_layers(heads, format)
    format, engine = (LAYOUTS[format], "vllm") if speculators else (format, engine)  # an eagle3 checkpoint for vLLM
    default = layers == default_feature_layers(adapter.num_layers)
    if engine is None and format == "eagle":
        raise ValueError("format 'eagle' needs engine='vllm' or 'sglang': they name the architecture differently.")
    if engine is None and layers is not None and not default:
        raise ValueError(
            f"feature_layers={layers} are not EAGLE's default {default_feature_layers(adapter.num_layers)}: pass "
            "engine='vllm' or 'sglang', whose aux layer ids count differently (vLLM: ours + 1, SGLang: ours)."
        )
    if format == "eagle" and draft_vocab is not None:
        raise ValueError("format 'eagle' drafts through the target's whole LM head: it takes no draft_vocab.")
    aux_ids = None if layers is None or default else [k + AUX_ID_OFFSET[engine] for k in layers]
    tensors = _tensors(heads, adapter, format, draft_vocab)
    draft_size = len(tensors["lm_head.weight"]) if format == "eagle3" else None
    config = _config(adapter, heads, format, engine, aux_ids, draft_size)
    card = _card(adapter, heads, format, engine, aux_ids, Path(path))
    if speculators:
        target, gamma = _verifier(verifier, adapter), heads.num_draft_tokens or DEFAULT_SPECULATIVE_TOKENS
        config = _speculators_config(config, target, gamma)
        name = adapter.fingerprint().name_or_path or "the target"
        card = _speculators_card(name, target["name_or_path"], gamma, Path(path))
    write_folder(Path(path), config, tensors, card, {"format": "pt"})


def _tensors(heads: EagleHeads, adapter: ModelAdapter, format: str, draft_vocab) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, in the target's dtype (d2t int64)."""
    dtype = adapter.dtype
    tensors = {name: p.detach().to(dtype) for name, p in _slots(heads, format).items()}
    if format == "eagle":
        return {**tensors, "fc.bias": torch.zeros(adapter.hidden_size, dtype=dtype)}
    vocab = adapter.draft_vocabulary(draft_vocab)
    if heads.fuse is None:  # one feature layer: the engines' fc passes it on as it is
        tensors["fc.weight"] = torch.eye(adapter.hidden_size, dtype=dtype)
    tensors["lm_head.weight"] = vocab.weight.to(dtype)
    if vocab.rows is not None:
        tensors["d2t"] = vocab.ids.cpu() - torch.arange(len(vocab.ids))
    return tensors


def _draft_config(path: Path) -> dict:
    """A checkpoint's draft config; for the speculators format, its layer config with the fields beside it (and
    "engine" vllm: its aux ids are vLLM's), after checking its flags keep our head's layout."""
    config = json.loads((path / CONFIG_NAME).read_text())
    if "speculators_config" not in config:
        return config
    flags = {name: config.get(name) for name in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")}
    if (
        config.get("speculators_model_type") != "eagle3"
        or flags["norm_before_residual"] is not False
        or any(flags[name] for name in ("norm_before_fc", "fc_norm", "norm_output"))
    ):
        raise HeadsMismatchError(
            f"{path}: a speculators checkpoint of type {config.get('speculators_model_type')!r} with {flags}; our "
            "head is eagle3 with the residual before hidden_norm (norm_before_residual false) and no other norms."
        )
    layer = dict(config["transformer_layer_config"])
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    return {
        **layer,
        "architectures": [ARCHITECTURES["eagle3", None]],
        "draft_vocab_size": config.get("draft_vocab_size"),
        **({"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}} if ids else {}),
        "selfspec": {**config.get("selfspec", {}), "engine": "vllm"},
    }


def load_export(path, model) -> tuple[EagleHeads, torch.Tensor | None]:
    """(EAGLE head, draft vocabulary ids or None) from a folder `export_eagle` wrote for `model`: with
    `SelfSpeculative(model, heads=heads, draft_vocab=ids, draft_vocab_context=False)` it drafts as the exported head
    did (the default, True, joins each call's own tokens to the list, which the engines do not). Raises
    HeadsMismatchError for a folder that is not such an export, or whose tensors our head cannot hold."""
    path = Path(path)
    adapter = ModelAdapter(model)
    _check_target(adapter)
    config = _draft_config(path)
    tensors = load_file(path / WEIGHTS_NAME)
    architecture = (config.get("architectures") or [None])[0]
    format = next((f for (f, _), name in ARCHITECTURES.items() if name == architecture), None)
    sizes = (config.get("hidden_size"), config.get("vocab_size"), config.get("num_hidden_layers"))
    if format is None or sizes != (adapter.hidden_size, adapter.vocab_size, 1):
        raise HeadsMismatchError(
            f"{path} holds a {architecture} draft of hidden size, vocabulary and layers {sizes}; expected an EAGLE "
            f"Llama draft for this target: ({adapter.hidden_size}, {adapter.vocab_size}, 1)."
        )
    ours = config.get("selfspec", {})
    if "target" in ours:
        check_fingerprint(ours["target"], adapter, path)
    layers = None
    if format == "eagle3":
        aux_ids = config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
        engine = ours.get("engine")
        if aux_ids is not None and engine not in ENGINES:
            raise HeadsMismatchError(f"{path} lists aux layer ids {aux_ids} without saying for which engine.")
        offset = AUX_ID_OFFSET[engine] if aux_ids is not None else 0
        layers = [i - offset for i in aux_ids] if aux_ids is not None else default_feature_layers(adapter.num_layers)
    gamma = ours.get("num_draft_tokens")
    layer_config = adapter.one_layer_config()  # with the draft's own MLP width where its config gives one
    layer_config["intermediate_size"] = config.get("intermediate_size") or layer_config["intermediate_size"]
    heads = EagleHeads(adapter.fingerprint(), layer_config, layers, layout=format, num_draft_tokens=gamma)
    slots = _slots(heads, format)
    required = set(slots) | ({"fc.weight", "lm_head.weight"} if format == "eagle3" else set())
    optional = {"fc.bias"} if format == "eagle" else {"d2t"}
    missing, unknown = required - set(tensors), set(tensors) - required - optional
    if missing or unknown:
        raise HeadsMismatchError(f"{path}: tensors missing {sorted(missing)}, unexpected {sorted(unknown)}.")
    with torch.no_grad():
        for name, parameter in slots.items():
            if tensors[name].shape != parameter.shape:
                raise HeadsMismatchError(
                    f"{path}: {name} is {tuple(tensors[name].shape)}, not {tuple(parameter.shape)}"
                )
            parameter.copy_(tensors[name])
    if format == "eagle":
        if "fc.bias" in tensors and tensors["fc.bias"].any():
            raise HeadsMismatchError(f"{path}: fc.bias is not zero; selfspec's EAGLE-1 fc has no bias.")
        return heads, None
    fc = tensors["fc.weight"]
    if heads.fuse is None and not torch.equal(fc, torch.eye(adapter.hidden_size, dtype=fc.dtype)):
        raise HeadsMismatchError(f"{path}: one feature layer with an fc other than the identity.")
    head = tensors["lm_head.weight"]
    ids = tensors["d2t"] + torch.arange(len(tensors["d2t"])) if "d2t" in tensors else None
    weight = adapter.lm_head.weight.detach().cpu()
    if not torch.equal(head, (weight if ids is None else weight[ids]).to(head.dtype)):
        raise HeadsMismatchError(f"{path}: lm_head.weight is not the target's LM head (rows): selfspec shares it.")
    return heads, ids


def export_target(model, tokenizer, path) -> None:
    """Write `model` (a transformers causal LM; one loaded from a GGUF file with dense weights too, as
    `selfspec.load_model` loads it) and `tokenizer` to the folder `path` as the Hugging Face folder serving engines
    load: config.json, generation_config.json, model.safetensors in the model's dtype, the tokenizer's files (its chat
    template included) and README.md, atomically. Raises ValueError for what would not load back as this model: a
    wrapper such as a PEFT model, packed quantized weights, no tokenizer."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise ValueError(
            f"export_target writes a transformers model; this is a {type(model).__name__} (a PEFT model: "
            "merge_and_unload() it first)."
        )
    if getattr(model, "hf_quantizer", None) is not None:
        raise ValueError(
            f"The model was loaded quantized ({type(model.hf_quantizer).__name__}), which transformers does not save: "
            "load it with dense weights (a GGUF file: quantization_config=GgufConfig(dequantize=True), as "
            "selfspec.load_model loads it)."
        )
    if tokenizer is None:
        raise ValueError("export_target needs the model's tokenizer: the engines read it from the same folder.")
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    card = [f"# {name}", "", f"Written by `selfspec export --format hf` in {str(model.dtype).removeprefix('torch.')}."]
    card += [f"Serve it with `vllm serve {path}`, or name it as the verifier of an EAGLE-3 draft: `selfspec export "
             f"--format speculators --verifier {path}`.", ""]  # fmt: skip
    with staged_folder(Path(path)) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / CARD_NAME).write_text("\n".join(card))
