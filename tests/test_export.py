"""Export of EAGLE heads for vLLM and SGLang (selfspec/export.py): every tensor name and shape and every config
field the engines' loaders need (vLLM 0.32-0.33, SGLang 0.5.23), none they choke on, vLLM's speculators format, the
refusals, and the round trip (a re-imported head drafts exactly as the exported one did). tests/test_vllm.py runs
the exports in vLLM itself, where a Python with vLLM is at hand."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import random_prompt, tiny_model
from transformers import DynamicCache

from selfspec import SelfSpeculative, frequent_tokens
from selfspec.adapter import ModelAdapter, UnsupportedModelError
from selfspec.cli.main import main
from selfspec.export import DEFAULT_SPECULATIVE_TOKENS, LAYOUTS, export_eagle, load_export
from selfspec.heads import EagleHeads, HeadsMismatchError
from selfspec.heads.lora import DraftLoRA
from selfspec.training.config import HeadsConfig

H, V, LAYERS = 32, 96, 8  # tiny_model's hidden size and vocabulary; EAGLE's default layers at 8: [1, 3, 4]
HEADS, KV_HEADS, HEAD_DIM, MLP = 4, 2, 8, 64


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_layers=LAYERS)


def eagle_head(model, layout="eagle3", feature_layers=(1, 3, 4), seed=0, mlp=None) -> EagleHeads:
    """A head with random weights everywhere (norms away from ones), so that a swapped or dropped tensor shows."""
    torch.manual_seed(seed)
    layers = list(feature_layers) if feature_layers is not None else None
    config = HeadsConfig(kind="eagle", layout=layout, feature_layers=layers, num_draft_tokens=3, intermediate_size=mlp)
    heads = EagleHeads.from_config(config, ModelAdapter(model))
    with torch.no_grad():
        for name, parameter in heads.named_parameters():
            parameter.copy_(torch.rand_like(parameter) + 0.5 if "norm" in name else torch.randn_like(parameter) / 4)
    return heads.eval()


def layer_shapes(q_in: int) -> dict[str, tuple[int, ...]]:
    return {
        "layers.0.self_attn.q_proj.weight": (HEADS * HEAD_DIM, q_in),
        "layers.0.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, q_in),
        "layers.0.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, q_in),
        "layers.0.self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
        "layers.0.mlp.gate_proj.weight": (MLP, H),
        "layers.0.mlp.up_proj.weight": (MLP, H),
        "layers.0.mlp.down_proj.weight": (H, MLP),
        "layers.0.post_attention_layernorm.weight": (H,),
    }


def written(path):
    return json.loads((path / "config.json").read_text()), load_file(path / "model.safetensors")


def check_common_config(config: dict, model) -> None:
    target = model.config
    for field in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert config[field] == getattr(target, field), field
    assert config["hidden_act"] == "silu" and config["rms_norm_eps"] == target.rms_norm_eps
    assert config["max_position_embeddings"] == 512 and config["vocab_size"] == V
    assert config["rope_theta"] == target.rope_parameters["rope_theta"] and config["rope_scaling"] is None
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    assert config["tie_word_embeddings"] is False and config["attention_bias"] is False and not config["mlp_bias"]
    assert "bias" not in config  # EAGLE's fc-bias flag turns on attention biases in both engines


@pytest.mark.parametrize(
    "engine,architecture", [("vllm", "EagleLlamaForCausalLM"), ("sglang", "LlamaForCausalLMEagle")]
)
def test_eagle1_checkpoint(model, tmp_path, engine, architecture):
    heads = eagle_head(model, "eagle", None)
    export_eagle(heads, model, tmp_path / "out", "eagle", engine)
    config, tensors = written(tmp_path / "out")
    expected = {"fc.weight": (H, 2 * H), "fc.bias": (H,), **layer_shapes(H)}
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected  # nothing else: vLLM rejects extras
    for absent in ("layers.0.input_layernorm.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight"):
        assert absent not in tensors
    assert torch.equal(tensors["fc.weight"], heads.fc.weight) and not tensors["fc.bias"].any()
    layer = heads.body.base.layers[0]
    assert torch.equal(tensors["layers.0.self_attn.q_proj.weight"], layer.self_attn.q_proj.weight)
    assert torch.equal(tensors["layers.0.post_attention_layernorm.weight"], layer.post_attention_layernorm.weight)
    assert config["architectures"] == [architecture] and "draft_vocab_size" not in config
    check_common_config(config, model)
    assert (
        f"--speculative-{'config' if engine == 'vllm' else 'algorithm EAGLE'}"
        in (tmp_path / "out/README.md").read_text()
    )


@pytest.mark.parametrize("vocab", [None, [2, 5, 7, 40, 95]])
def test_eagle3_checkpoint(model, tmp_path, vocab):
    heads = eagle_head(model)
    export_eagle(heads, model, tmp_path / "out", draft_vocab=vocab)
    config, tensors = written(tmp_path / "out")
    size = len(vocab) if vocab else V
    expected = {
        "fc.weight": (H, 3 * H),
        **layer_shapes(2 * H),
        "layers.0.input_layernorm.weight": (H,),
        "layers.0.hidden_norm.weight": (H,),
        "norm.weight": (H,),
        "lm_head.weight": (size, H),
        **({"d2t": (size,)} if vocab else {}),  # vLLM rejects a d2t when the vocabularies agree
    }
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected
    assert not any(name.startswith("model.") or "embed_tokens" in name for name in tensors)
    joined = heads.body.joined
    assert torch.equal(tensors["fc.weight"], heads.fuse.weight)
    assert torch.equal(tensors["layers.0.input_layernorm.weight"], joined.embed_norm.weight)  # on the embeddings
    assert torch.equal(tensors["layers.0.hidden_norm.weight"], joined.hidden_norm.weight)
    assert torch.equal(tensors["norm.weight"], heads.body.norm.weight)
    rows = model.lm_head.weight[vocab] if vocab else model.lm_head.weight
    assert torch.equal(tensors["lm_head.weight"], rows)
    if vocab:
        assert tensors["d2t"].dtype == torch.int64
        assert (tensors["d2t"] + torch.arange(size)).tolist() == vocab
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == size and "eagle_config" not in config  # default layers: no ids
    check_common_config(config, model)


@pytest.mark.parametrize("engine,ids", [("vllm", [1, 3, 6]), ("sglang", [0, 2, 5])])
def test_eagle3_ids_follow_the_engines_convention(model, tmp_path, engine, ids):
    heads = eagle_head(model, feature_layers=[0, 2, 5])
    with pytest.raises(ValueError, match="engine"):
        export_eagle(heads, model, tmp_path / "out")
    export_eagle(heads, model, tmp_path / "out", engine=engine)
    config, _ = written(tmp_path / "out")
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": ids}
    assert f"{ids} in {engine}'s convention" in (tmp_path / "out/README.md").read_text()


def target_folder(model, path):
    """The target saved as a Hugging Face folder (the verifier's sizes are read from its config.json)."""
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("vocab", [None, [2, 5, 7, 40, 95]])
def test_speculators_checkpoint(model, tmp_path, vocab):
    """vLLM's speculators format (vllm/transformers_utils/configs/speculators, read in 0.32): the eagle3 tensors, the
    layer config nested, the draft tokens per step and the verifier that `vllm serve FOLDER` loads as the target."""
    heads = eagle_head(model)
    export_eagle(heads, model, tmp_path / "eagle3", draft_vocab=vocab)
    verifier = target_folder(model, tmp_path / "target")
    export_eagle(heads, model, tmp_path / "out", "speculators", draft_vocab=vocab, verifier=verifier)
    config, tensors = written(tmp_path / "out")
    _, eagle3_tensors = written(tmp_path / "eagle3")
    assert tensors.keys() == eagle3_tensors.keys()
    assert all(torch.equal(tensors[name], eagle3_tensors[name]) for name in tensors)
    assert "model_type" not in config  # vLLM takes a config without one and with speculators_config as this format
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["draft_vocab_size"] == (len(vocab) if vocab else V)
    assert config["norm_before_residual"] is False  # our residual is the fused feature; vLLM defaults to True
    assert not any(key in config for key in ("norm_before_fc", "fc_norm", "norm_output", "target_hidden_size"))
    assert "eagle_aux_hidden_state_layer_ids" not in config  # default layers
    layer = config["transformer_layer_config"]
    check_common_config(layer, model)
    assert not {"architectures", "draft_vocab_size", "selfspec", "eagle_config"} & set(layer)
    assert config["speculators_config"] == {
        "algorithm": "eagle3",
        "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],  # the head's num_draft_tokens
        "verifier": {"name_or_path": str(verifier.resolve()), "architectures": ["LlamaForCausalLM"]},
    }
    assert f"vllm serve {tmp_path / 'out'}" in (tmp_path / "out/README.md").read_text()


def test_speculators_checkpoint_on_other_layers_and_a_hub_verifier(model, tmp_path):
    heads = eagle_head(model, feature_layers=[0, 2, 5])
    heads.num_draft_tokens = None  # no tuned gamma: the default number of draft tokens
    export_eagle(heads, model, tmp_path / "out", "speculators", verifier="org/target")
    config, _ = written(tmp_path / "out")
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]  # vLLM's ids: ours + 1
    # vLLM's draft model sizes its fc from the nested eagle_config
    assert config["transformer_layer_config"]["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}
    assert config["speculators_config"]["verifier"] == {
        "name_or_path": "org/target",
        "architectures": ["LlamaForCausalLM"],
    }
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == DEFAULT_SPECULATIVE_TOKENS


def test_speculators_refusals(model, tmp_path):
    out, heads = tmp_path / "out", eagle_head(model)
    with pytest.raises(ValueError, match="needs verifier"):
        export_eagle(heads, model, out, "speculators")
    with pytest.raises(ValueError, match="other formats take none"):
        export_eagle(heads, model, out, "eagle3", verifier="org/target")
    with pytest.raises(ValueError, match="is vLLM's"):
        export_eagle(heads, model, out, "speculators", "sglang", verifier="org/target")
    with pytest.raises(ValueError, match="layout 'eagle3'"):
        export_eagle(eagle_head(model, "eagle", None), model, out, "speculators", verifier="org/target")
    with pytest.raises(ValueError, match="no such folder"):
        export_eagle(heads, model, out, "speculators", verifier=tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        export_eagle(heads, model, out, "speculators", verifier=tmp_path / "empty")
    other = target_folder(tiny_model("llama", num_layers=6), tmp_path / "other")
    with pytest.raises(HeadsMismatchError, match="verifier .* holds a model of"):
        export_eagle(heads, model, out, "speculators", verifier=other)
    assert not out.exists()
    export_eagle(heads, model, out, "speculators", verifier="org/target")
    config = json.loads((out / "config.json").read_text())
    for flags in ({"norm_before_residual": True}, {"norm_before_fc": True}, {"speculators_model_type": "dflash"}):
        (out / "config.json").write_text(json.dumps({**config, **flags}))
        with pytest.raises(HeadsMismatchError, match="speculators checkpoint"):
            load_export(out, model)


ROUND_TRIPS = [  # format, feature layers, engine, draft vocabulary, the head's MLP width (None: the target's)
    ("eagle", None, "vllm", None, None),
    ("eagle3", (1, 3, 4), None, None, None),
    ("eagle3", (1, 3, 4), None, "frequent", None),
    ("eagle3", (0, 2, 5), "sglang", [3, 9, 17, 33, 50, 64, 80], None),
    ("eagle3", (2,), "vllm", None, None),  # one feature layer: fc is the identity
    ("speculators", (1, 3, 4), None, [3, 9, 17, 33, 50, 64, 80], None),
    ("speculators", (0, 2, 5), None, None, None),  # aux ids in vLLM's convention, which the format implies
    ("speculators", (1, 3, 4), None, None, 3 * MLP),  # a head wider than the target's layers
    ("eagle", None, "sglang", None, 2 * MLP),
]


@pytest.mark.parametrize("format,layers,engine,vocab,mlp", ROUND_TRIPS)
def test_a_reimported_head_drafts_identically(model, tmp_path, format, layers, engine, vocab, mlp):
    layout = LAYOUTS[format]
    heads = eagle_head(model, layout, layers, mlp=mlp)
    prompt = random_prompt(6)
    if vocab == "frequent":
        vocab = frequent_tokens(model.generate(prompt, max_new_tokens=24, do_sample=False), 40)
    verifier = "org/target" if format == "speculators" else None
    export_eagle(heads, model, tmp_path / "out", format, engine, vocab, verifier)
    again, ids = load_export(tmp_path / "out", model)
    assert again.features == heads.features and again.num_draft_tokens == 3
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    config = config.get("transformer_layer_config", config)  # the speculators format nests the layer's fields
    assert config["intermediate_size"] == again.layer_config["intermediate_size"] == (mlp or MLP)
    assert (ids is None) == (vocab is None) and (
        vocab is None or ids.tolist() == sorted(set(torch.as_tensor(vocab).tolist()))
    )
    runs = []  # sampled with one seed: the accept-reject draws read q, so equal runs need equal drafts
    for candidate, candidate_vocab in ((heads, vocab), (again, ids)):
        spec = SelfSpeculative(model, heads=candidate, draft_vocab=candidate_vocab, num_draft_tokens=3)
        torch.manual_seed(0)
        runs.append((spec.generate(prompt, max_new_tokens=24, do_sample=True), spec.stats.accepted))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1] > 0
    adapter, width = ModelAdapter(model), len(heads.features) * H  # the draft logits themselves, bit for bit
    features, states = torch.randn(1, 5, width), adapter.embed(prompt[:, 1:], torch.arange(1, 6)[None])
    logits = [
        h.logits(h.step(h.fused(features), states, torch.arange(5)[None], None, DynamicCache()), adapter, vocabulary)
        for h, vocabulary in ((heads, adapter.draft_vocabulary(vocab) if vocab is not None else None),
                              (again, adapter.draft_vocabulary(ids) if ids is not None else None))
    ]  # fmt: skip
    assert torch.equal(logits[0], logits[1])


def test_refusals(model, tmp_path):
    out = tmp_path / "out"
    eagle1, eagle3 = eagle_head(model, "eagle", None), eagle_head(model)
    with pytest.raises(ValueError, match="layout 'eagle3'"):
        export_eagle(eagle1, model, out, "eagle3")
    with pytest.raises(ValueError, match="layout 'eagle'"):
        export_eagle(eagle3, model, out, "eagle", "vllm")
    with pytest.raises(ValueError, match="needs engine"):
        export_eagle(eagle1, model, out, "eagle")
    with pytest.raises(ValueError, match="no draft_vocab"):
        export_eagle(eagle1, model, out, "eagle", "vllm", draft_vocab=[1, 2])
    with pytest.raises(ValueError, match="last hidden state"):
        export_eagle(eagle_head(model, "eagle", [1, 3]), model, out, "eagle", "vllm")
    with pytest.raises(ValueError, match="no feature_layers"):
        export_eagle(eagle_head(model, "eagle3", None), model, out)
    with pytest.raises(ValueError, match="ascending"):
        export_eagle(eagle_head(model, feature_layers=[3, 1, 4]), model, out, engine="vllm")
    eagle3.draft_lora = DraftLoRA.from_settings(H, V, {"r": 2, "lora_alpha": 4})
    with pytest.raises(ValueError, match="draft LoRA"):
        export_eagle(eagle3, model, out)
    with pytest.raises(HeadsMismatchError, match="trained for"):
        export_eagle(eagle_head(tiny_model("llama", num_layers=6), "eagle", None), model, out, "eagle", "vllm")
    qwen = tiny_model("qwen2", num_layers=6)
    with pytest.raises(UnsupportedModelError, match="qwen2 is not defined"):
        export_eagle(eagle_head(qwen, "eagle", None), qwen, out, "eagle", "vllm")
    for field, value in (("final_logit_softcapping", 30.0), ("logit_scale", 2.0), ("attention_bias", True)):
        target = tiny_model("llama", num_layers=LAYERS)
        setattr(target.config, field, value)
        with pytest.raises(UnsupportedModelError, match=field):
            export_eagle(eagle_head(model, "eagle", None), target, out, "eagle", "vllm")
    assert not out.exists()


def test_load_export_refuses_what_our_head_cannot_hold(model, tmp_path):
    out = tmp_path / "out"
    export_eagle(eagle_head(model), model, out, draft_vocab=[2, 5, 7])
    with pytest.raises(HeadsMismatchError, match="num_hidden_layers"):
        load_export(out, tiny_model("llama", num_layers=6))
    config, tensors = written(out)
    save_file({**tensors, "lm_head.weight": tensors["lm_head.weight"] * 2}, out / "model.safetensors")
    with pytest.raises(HeadsMismatchError, match="lm_head.weight is not the target's"):
        load_export(out, model)
    save_file({**tensors, "layers.0.self_attn.qkv_proj.weight": torch.zeros(2)}, out / "model.safetensors")
    with pytest.raises(HeadsMismatchError, match="unexpected"):
        load_export(out, model)
    (out / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(HeadsMismatchError, match="LlamaForCausalLM draft"):
        load_export(out, model)


def test_weights_are_in_the_targets_dtype(tmp_path):
    target = tiny_model("llama", num_layers=LAYERS).to(torch.bfloat16)
    export_eagle(eagle_head(target), target, tmp_path / "out", draft_vocab=[2, 5, 7])
    config, tensors = written(tmp_path / "out")
    assert config["torch_dtype"] == "bfloat16" and tensors["d2t"].dtype == torch.int64
    assert all(t.dtype == torch.bfloat16 for name, t in tensors.items() if name != "d2t")


def test_export_command_overwrites_atomically(model, tmp_path, monkeypatch):
    import selfspec.cli.main as cli
    import selfspec.heads

    heads = eagle_head(model)  # an eagle3 head's folder does not save yet (its joined norms are shared tensors)
    monkeypatch.setattr(cli, "load_cli_model", lambda name, dtype: (model, None))
    monkeypatch.setattr(selfspec.heads, "load_heads", lambda path, adapter: heads)
    command = ["export", "--model", "m", "--heads", "h", "--format", "eagle3", "--output", str(tmp_path / "out")]
    for vocab, replace in (([1, 2, 3], []), ([4, 5], ["--overwrite"])):  # the second replaces the first's folder
        (tmp_path / "vocab.json").write_text(json.dumps(vocab))
        assert main([*command, "--draft_vocab", str(tmp_path / "vocab.json"), *replace]) == 0
    assert load_file(tmp_path / "out/model.safetensors")["d2t"].tolist() == [4, 4]
    with pytest.raises(SystemExit, match="selfspec export: format 'eagle' needs an EAGLE head of layout 'eagle'"):
        main([*command[:5], "--format", "eagle", "--engine", "vllm", "--output", str(tmp_path / "eagle1")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "vocab.json"]  # no staging folders left
