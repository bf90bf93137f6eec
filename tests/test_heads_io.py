"""Heads folders and exports written and read back: a head for a bfloat16 target is built in one dtype, saving keeps
what else a folder holds and never replaces a model, the current folder is refused by name, and an export passed
where heads go is named as one."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import tiny_model
from transformers import AutoModelForCausalLM

from selfspec.adapter import ModelAdapter
from selfspec.export import export_eagle, load_export
from selfspec.heads import EagleHeads, ExitHeads, HeadsMismatchError, load_heads
from selfspec.training.config import HeadsConfig


def test_eagle_heads_for_a_bfloat16_target_are_built_in_one_dtype(tmp_path):
    """A target loaded in bfloat16 has config.dtype bfloat16; the head's layer config copies it, and the layer was
    built in it beside float32 fc, fuse and widened projections (eagle3 refused, eagle failing in training)."""
    tiny_model("llama", num_layers=8).save_pretrained(tmp_path / "target")
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target", dtype=torch.bfloat16)
    adapter = ModelAdapter(target)
    assert target.config.dtype == torch.bfloat16
    for layout, layers in (("eagle3", [1, 3, 4]), ("eagle", None)):
        heads = EagleHeads.from_config(HeadsConfig(kind="eagle", layout=layout, feature_layers=layers), adapter)
        assert {p.dtype for p in heads.parameters()} == {torch.float32}
        with torch.no_grad():
            states = target(torch.randint(3, 96, (1, 10)), output_hidden_states=True).hidden_states
        heads.distillation_drafts(adapter, states)  # a training step's forward runs
        heads.save_pretrained(tmp_path / layout)
        assert load_heads(tmp_path / layout, adapter).feature_layers == heads.feature_layers
    eagle3 = load_heads(tmp_path / "eagle3", adapter)
    export_eagle(eagle3, target, tmp_path / "export")
    back, _ = load_export(tmp_path / "export", target)
    assert back.feature_layers == eagle3.feature_layers


def test_saving_heads_keeps_other_files_and_refuses_a_model_folder(tmp_path):
    model = tiny_model("llama", num_layers=4)
    adapter = ModelAdapter(model)
    heads = ExitHeads(adapter.fingerprint(), [2])
    heads.save_pretrained(tmp_path / "heads")
    (tmp_path / "heads/draft_vocab.json").write_text("[1, 2, 3]")
    (tmp_path / "heads/eval").mkdir()
    (tmp_path / "heads/eval/alpha.csv").write_text("depth,alpha\n")
    ExitHeads(adapter.fingerprint(), [1, 3]).save_pretrained(tmp_path / "heads")  # replaces the heads ...
    assert load_heads(tmp_path / "heads", adapter).exit_layers == [1, 3]
    assert json.loads((tmp_path / "heads/draft_vocab.json").read_text()) == [1, 2, 3]  # ... not the rest
    assert (tmp_path / "heads/eval/alpha.csv").read_text() == "depth,alpha\n"
    model.save_pretrained(tmp_path / "model")
    with pytest.raises(FileExistsError, match="not a heads folder"):
        heads.save_pretrained(tmp_path / "model")
    assert json.loads((tmp_path / "model/config.json").read_text())["model_type"] == "llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads", "model"]  # no staging folders left


def test_the_current_folder_is_refused_by_name(tmp_path, monkeypatch):
    heads = ExitHeads(ModelAdapter(tiny_model("llama", num_layers=4)).fingerprint(), [2])
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    for path in (".", "./", "sub/.."):
        with pytest.raises(ValueError, match="current folder"):
            heads.save_pretrained(path)
    assert list((tmp_path / "here").iterdir()) == []  # nothing left behind
    (tmp_path / "link").symlink_to(tmp_path)  # the current folder named through a symlinked parent
    with pytest.raises(ValueError, match="current folder"):
        heads.save_pretrained(tmp_path / "link" / "here")
    assert (tmp_path / "here").is_dir() and list((tmp_path / "here").iterdir()) == []
    heads.save_pretrained("sub")  # a folder inside it is fine
    written = sorted(p.name for p in (tmp_path / "here/sub").iterdir())
    assert written == ["README.md", "config.json", "model.safetensors"]


def test_an_export_given_as_heads_is_named(tmp_path):
    model = tiny_model("llama", num_layers=8)
    adapter = ModelAdapter(model)
    heads = EagleHeads.from_config(HeadsConfig(kind="eagle", layout="eagle3", feature_layers=[1, 3, 4]), adapter)
    export_eagle(heads, model, tmp_path / "eagle3")
    export_eagle(heads, model, tmp_path / "spec", "speculators", verifier="org/target")
    for name, format in (("eagle3", "eagle3"), ("spec", "speculators")):
        with pytest.raises(HeadsMismatchError, match=f"draft checkpoint .*{format} format.*load_export"):
            load_heads(tmp_path / name, adapter)
    ExitHeads(adapter.fingerprint(), [2]).save_pretrained(tmp_path / "exit")
    (tmp_path / "exit/config.json").write_text("[1, 2]")
    with pytest.raises(HeadsMismatchError, match="not a JSON object"):
        load_heads(tmp_path / "exit", adapter)
