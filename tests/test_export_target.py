"""`selfspec export --format hf` (`selfspec.export.export_target`): the target as the Hugging Face folder serving
engines load. On the bundled demo target and on a tiny Llama read from a quantised GGUF file (dequantised, as
SmolLM2 is): weights, generation config and tokenizer (chat template included) load back as they were, in the dtype
asked for; the refusals; the command's checks of which options each format takes."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file
from test_families import write_llama_gguf
from tiny_models import random_prompt, tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from selfspec.cli.main import main
from selfspec.export import export_target
from selfspec.targets import load_model

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def demo():
    return load_model("demo", dtype="float32")


def assert_same_weights(model, again) -> None:
    mine, theirs = model.state_dict(), again.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[name], theirs[name]) for name in mine)


def test_the_folder_loads_back_as_the_target(demo, tmp_path):
    model, tokenizer = demo
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = TEMPLATE
    export_target(model, tokenizer, tmp_path / "out")
    files = {path.name for path in (tmp_path / "out").iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "README.md"} <= files
    assert not any(name.startswith(".") for name in files) and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert again.dtype == torch.float32 and type(again) is type(model)
    assert_same_weights(model, again)
    assert again.generation_config.to_diff_dict() == model.generation_config.to_diff_dict()
    prompt = random_prompt(8, vocab_size=model.config.vocab_size)
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    assert torch.equal(again.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12), expected)
    reread = AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "def add(a, b):\n    return a + b  # état"
    assert reread(text).input_ids == tokenizer(text).input_ids
    messages = [{"role": "user", "content": "hi"}]
    assert reread.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(
        messages, tokenize=False
    )
    assert "vllm serve" in (tmp_path / "out/README.md").read_text()


def test_the_command_writes_the_dtype_asked_for(tmp_path):
    assert (
        main(["export", "--format", "hf", "--model", "demo", "--dtype", "bfloat16", "--output", str(tmp_path / "out")])
        == 0
    )
    assert json.loads((tmp_path / "out/config.json").read_text())["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(tmp_path / "out/model.safetensors").values())


def test_a_gguf_target_is_written_dense(tmp_path):
    """A model read from a quantised GGUF file (as SmolLM2 is) writes its dequantised weights; loaded with its quantizer
    kept (transformers' default), it is refused, since transformers would not save it."""
    pytest.importorskip("gguf")
    write_llama_gguf(tiny_model("llama"), tmp_path / "tiny.gguf", "Q8_0")
    dense = transformers.GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", quantization_config=dense).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    export_target(model, tokenizer, tmp_path / "out")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert_same_weights(model, again)
    assert "quantization_config" not in json.loads((tmp_path / "out/config.json").read_text())
    packed = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    with pytest.raises(ValueError, match="loaded quantized .*GgufConfig"):
        export_target(packed, tokenizer, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_refusals(demo, tmp_path):
    model, tokenizer = demo
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        export_target(model, None, tmp_path / "out")
    with pytest.raises(ValueError, match="writes a transformers model; this is a Sequential"):
        export_target(torch.nn.Sequential(model), tokenizer, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "options,message",
    [
        (["--format", "hf", "--heads", "h"], "--format hf takes no --heads"),
        (["--format", "hf", "--engine", "vllm", "--draft_vocab", "v"], "takes no --engine and takes no --draft_vocab"),
        (["--format", "eagle3"], "--format eagle3 needs --heads"),
        (["--format", "eagle3", "--heads", "h", "--verifier", "t"], "--format eagle3 takes no --verifier"),
        (["--format", "speculators", "--heads", "h"], "--format speculators needs --verifier"),
        (["--format", "speculators", "--heads", "h", "--verifier", "t", "--engine", "sglang"], "takes no --engine"),
        (["--format", "eagle", "--heads", "h", "--draft_vocab", "v"], "--format eagle takes no --draft_vocab"),
    ],
)
def test_the_command_checks_the_options_of_each_format(options, message, tmp_path):
    with pytest.raises(SystemExit, match=message):  # before loading anything
        main(["export", "--model", "no-such-model", *options, "--output", str(tmp_path / "out")])
