"""The families added after the first eight (`NEW_ARCHITECTURES`): every promise, one family at a time.

The first eight families run through each parametrised test module; the later ones get this one module
instead, so the suite stays fast: per family it checks the draft's logits path against the model's own,
greedy output against `model.generate` (exit layers 1-3, gamma 1-8, generation past the sliding window),
a left-padded batch, Medusa chain and tree, the reduced and int8 draft heads, and heads trained by
training/train_heads.py. Then: Llama's rope scalings, one sampling spot check, and the refusals.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from test_batch import assert_rows_exact
from test_medusa import TREE, FutureOracle, medusa_heads
from test_sampling_exactness import ROWS, VOCAB, chi_square_pvalue, exact_law, sampled_counts
from test_train_heads import VOCAB as WORD_IDS
from test_train_heads import WORDS, build_tokenizer, sentence, summary, train_in_process, write_config
from tiny_models import NEW_ARCHITECTURES, SLIDING_WINDOW, random_prompt, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

from selfspec import SUPPORTED_ARCHITECTURES, SelfSpeculative, UnsupportedModelError
from selfspec.adapter import ModelAdapter
from selfspec.cli.main import main
from selfspec.families import SUPPORT_RULE

NEW_TOKENS = 30  # well past the sliding window
assert NEW_TOKENS > 3 * SLIDING_WINDOW
# (exit_layer, num_draft_tokens, prompt_length): every exit layer, gammas from 1 to 8
GREEDY_GRID = [(1, 1, 5), (2, 4, 17), (3, 8, 1), (2, 6, 9), (1, 3, 12)]


@pytest.fixture(scope="module", params=NEW_ARCHITECTURES)
def model(request):
    return tiny_model(request.param)


def generate_pair(model, spec, prompt, **kwargs):
    """(model.generate's output, spec.generate's output) for the same greedy call."""
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    return model.generate(prompt, **kwargs), spec.generate(prompt, **kwargs)


def test_draft_path_reproduces_the_models_logits(model):
    """The final norm, LM head, logit scaling and soft-capping the drafts apply give the model's own logits,
    and lower then upper layers (the draft, then the verify pass on its KV) give those of the full pass."""
    adapter = ModelAdapter(model)
    prompt = random_prompt(11, seed=1)
    positions = torch.arange(11)[None]
    last = adapter.num_layers - 1
    logits, captured = adapter.forward_capturing(prompt, positions, adapter.new_cache(), layers=(last,))
    torch.testing.assert_close(adapter.head_logits(captured[last]), logits)
    for exit_layer in range(1, adapter.num_layers):
        cache = adapter.new_cache()
        hidden = adapter.run_lower(prompt, positions, cache, exit_layer)
        upper, _ = adapter.run_upper(hidden, prompt, positions, cache, exit_layer)
        torch.testing.assert_close(upper, logits)


def test_greedy_matches_generate(model):
    for exit_layer, gamma, prompt_length in GREEDY_GRID:
        prompt = random_prompt(prompt_length, seed=prompt_length + gamma)
        spec = SelfSpeculative(model, exit_layer=exit_layer, num_draft_tokens=gamma)
        expected, actual = generate_pair(model, spec, prompt)
        assert torch.equal(actual, expected), (model.config.model_type, exit_layer, gamma, prompt_length)
        assert spec.stats.new_tokens == NEW_TOKENS and spec.stats.proposed > 0


def test_left_padded_batch_matches_generate(model):
    spec = SelfSpeculative(model, exit_layer=2, num_draft_tokens=3)
    stats = assert_rows_exact(model, spec, [4, 13, 1], seed=2)
    assert stats.new_tokens == stats.accepted + stats.row_passes


def test_medusa_chain_and_tree_match_generate(model):
    heads = medusa_heads(model, num_heads=4)
    prompt = random_prompt(9, seed=5)
    expected, chain = generate_pair(model, SelfSpeculative(model, heads=heads, num_draft_tokens=3), prompt)
    assert torch.equal(chain, expected), model.config.model_type
    oracle = FutureOracle(expected[0, prompt.shape[1] :].tolist(), model.config.vocab_size)
    spec = SelfSpeculative(model, heads=heads, tree=TREE, adaptive=False)
    spec.heads.logits = oracle.logits  # drafts that follow the reference, so deep paths and siblings happen
    assert torch.equal(spec.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, streamer=oracle), expected)
    assert spec.stats.accepted_per_position[2] > 0 and spec.stats.accepted < spec.stats.proposed


def test_reduced_and_int8_draft_heads_match_generate(model):
    subset = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(0))[:40]
    prompt = random_prompt(6, seed=4)
    tree = [[0], [1], [0, 0], [0, 0, 0]]
    options = [
        {"exit_layer": 2, "num_draft_tokens": 3, "draft_vocab": subset},
        {"exit_layer": 1, "num_draft_tokens": 4, "draft_quant": "int8"},
        {"heads": medusa_heads(model), "tree": tree, "draft_vocab": subset, "draft_quant": "int8"},
    ]
    expected = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    for option in options:
        spec = SelfSpeculative(model, **option)
        assert torch.equal(spec.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False), expected), option
        assert spec.stats.proposed > 0


@pytest.fixture(scope="module")
def training_data(tmp_path_factory) -> Path:
    """A small train.jsonl and held-out folder in test_train_heads' synthetic language."""
    data = tmp_path_factory.mktemp("family_data")
    rng = random.Random(0)
    successors = {word: rng.sample(WORDS, 3) for word in WORDS}
    (data / "heldout").mkdir()
    rows = (json.dumps({"text": sentence(rng, successors)}) for _ in range(64))
    (data / "train.jsonl").write_text("".join(row + "\n" for row in rows))
    for index in range(2):
        (data / "heldout" / f"file{index}.txt").write_text(sentence(rng, successors))
    return data


HEAD_KINDS = {"exit": {"heads.exit_layers": [2]}, "medusa": {"heads.kind": "medusa", "heads.num_heads": 2}}


def test_heads_train_save_load_and_generate_exactly(model, training_data, tmp_path, monkeypatch):
    """training/train_heads.py, a few steps per head kind on the family's tiny model (its tokenizer's ids are
    a subset of the model's vocabulary): the saved heads load and generate what the model generates."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    model.save_pretrained(tmp_path / "target")
    build_tokenizer().save_pretrained(tmp_path / "target")
    world = {"root": tmp_path, "target": tmp_path / "target", "data": training_data}
    prompt = torch.tensor([[WORD_IDS["w3"], WORD_IDS["w7"]]])
    for kind, overrides in HEAD_KINDS.items():
        steps = {"train.max_steps": 3, "eval.every": 3, "eval.max_rows": 2, "data.seq_len": 16}
        train_in_process(write_config(world, kind, **overrides, **steps))
        assert summary(world, kind)["steps"] == 3
        spec = SelfSpeculative(model, heads=tmp_path / kind / "heads")
        expected, actual = generate_pair(model, spec, prompt, eos_token_id=None)
        assert torch.equal(actual, expected), (model.config.model_type, kind)


# Hugging Face Llama parameter names -> llama.cpp GGUF tensor names ({i}: the layer)
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_rows(weight, heads: int):
    """q/k projection rows in llama.cpp's order (its rope pairs adjacent dimensions); loading undoes it."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def write_llama_gguf(model, path: Path, quant: str) -> None:
    """`model` (a tiny Llama) as a GGUF file, its matrices in float32 or quantised to Q8_0."""
    import gguf

    config, writer = model.config, gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_token_scores([0.0] * config.vocab_size)
    writer.add_token_types([1] * config.vocab_size)
    for name, tensor in model.state_dict().items():
        layer, _, part = name.removeprefix("model.layers.").rpartition(".weight")[0].partition(".")
        gguf_name = GGUF_NAMES.get(name) or f"blk.{layer}.{GGUF_NAMES[part]}.weight"
        array = tensor.numpy()
        if gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in gguf_name else config.num_key_value_heads
            array = llama_cpp_rows(array, heads)
        if quant == "Q8_0" and array.ndim == 2:
            packed = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, packed, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
def test_a_gguf_loaded_model_wraps_like_the_same_model_from_safetensors(tmp_path, quant):
    """transformers' gguf_file= path (dequantised weights) gives the stock class: same fingerprint, so heads
    made for the safetensors model load on it, and its greedy output through selfspec equals its own."""
    model = tiny_model("llama")
    write_llama_gguf(model, tmp_path / "tiny.gguf", quant)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", attn_implementation="eager")
    loaded.eval()
    if quant == "F32":  # the same weights, bit for bit
        for name, tensor in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), name
    fingerprint = ModelAdapter(loaded).fingerprint().to_dict()
    assert {**fingerprint, "name_or_path": ""} == {**ModelAdapter(model).fingerprint().to_dict(), "name_or_path": ""}
    prompt = random_prompt(8, seed=6)
    for options in ({"exit_layer": 2, "num_draft_tokens": 4}, {"heads": medusa_heads(model), "tree": TREE}):
        spec = SelfSpeculative(loaded, **options)
        expected, actual = generate_pair(loaded, spec, prompt, eos_token_id=None)  # the file names an EOS id
        assert torch.equal(actual, expected), (quant, options)


ROPE_SCALINGS = {  # position-only rope scalings: a verify pass rotates each position as a plain step does
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"factor": 32.0, "original_max_position_embeddings": 16},  # 512 positions / 16
}


@pytest.mark.parametrize("rope_type", sorted(ROPE_SCALINGS))
def test_llama_with_scaled_rope_matches_generate(rope_type):
    rope = {"rope_type": rope_type, "rope_theta": 10000.0, **ROPE_SCALINGS[rope_type]}
    model = tiny_model("llama", rope_parameters=rope)
    prompt = random_prompt(10, seed=3)  # generation runs past original_max_position_embeddings
    expected, actual = generate_pair(model, SelfSpeculative(model, exit_layer=1, num_draft_tokens=5), prompt)
    assert torch.equal(actual, expected), rope_type


@pytest.mark.parametrize("arch", NEW_ARCHITECTURES)
def test_sampling_is_distributed_as_the_target(arch):
    """The sampling rule on each family (Granite's and Cohere2's logits are scaled): a 4-token vocabulary,
    the exact law of three tokens against early-exit samples (see test_sampling_exactness)."""
    model = tiny_model(arch, seed=3, vocab_size=VOCAB, num_layers=4, hidden=16, logit_scale=20.0)
    spec = SelfSpeculative(model, exit_layer=1, num_draft_tokens=2)
    law = exact_law(model, temperature=0.8)
    pvalue = chi_square_pvalue(sampled_counts(spec, rows=ROWS, temperature=0.8), law)
    assert pvalue > 1e-3, f"sampled law differs from the target's (chi-square p = {pvalue:.2e})"


def test_a_hybrid_state_space_model_is_refused_with_the_rule():
    config = AutoConfig.for_model(
        "lfm2", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention"],
    )  # fmt: skip
    with pytest.raises(UnsupportedModelError, match=r"'lfm2' .*recurrent state \(rule 2\).*selfspec architectures"):
        SelfSpeculative(AutoModelForCausalLM.from_config(config))


def test_architectures_command_prints_every_type_and_the_rule(capsys):
    assert main(["architectures"]) == 0
    printed = capsys.readouterr().out
    listed = printed.split("\n\n")[0].splitlines()[1:]
    assert [name.strip() for name in listed] == sorted(SUPPORTED_ARCHITECTURES)
    assert set(NEW_ARCHITECTURES) <= set(SUPPORTED_ARCHITECTURES)
    assert SUPPORT_RULE in printed and "qwen3_next:" in printed and "lfm2:" in printed
