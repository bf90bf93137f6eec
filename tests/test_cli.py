"""The `selfspec` commands' defaults: the bundled demo target without --model (profile with its held-out
files), one torch thread unless told otherwise, help that shows the defaults and says what --output holds,
and the extra to install named when a command's package is missing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from selfspec.cli import main as cli
from selfspec.cli.main import build_parser, bundled_heldout, main
from selfspec.cli.parsers import BUNDLED, BUNDLED_CONFIG
from selfspec.training.config import TrainHeadsConfig, load_config

ROOT = Path(__file__).resolve().parents[1]


def help_text(command: str, capsys) -> str:
    """`selfspec COMMAND --help`, with argparse's line wrapping undone."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    "command, output",
    [
        ("demo", "--output OUTPUT folder for alpha_by_depth.png (default: runs/demo)"),
        ("bench", "--output OUTPUT folder for bench.json, bench.md and bench.png"),
        ("profile", "--output OUTPUT folder for alpha_by_depth.png (default: runs/profile)"),
        ("tune", None),  # tune writes into the heads folders
    ],
)
def test_help_shows_defaults_and_what_output_holds(command, output, capsys):
    text = help_text(command, capsys)
    assert "--num_threads NUM_THREADS torch CPU threads; 0: torch's default" in text and "(default: 1)" in text
    assert "(default: None)" not in text and "(default: False)" not in text
    if output is None:
        assert "--output" not in text
    else:
        assert output in text


@pytest.mark.parametrize("command", ["demo", "bench", "tune", "profile"])
def test_commands_default_to_one_thread(command):
    assert build_parser().parse_args([command]).num_threads == 1
    assert build_parser().parse_args([command, "--num_threads", "0"]).num_threads == 0


def test_profile_without_model_runs_on_the_bundled_target_and_its_heldout_files(monkeypatch, capsys, tmp_path):
    listed = load_config(TrainHeadsConfig, BUNDLED_CONFIG).data.heldout_files.split(",")
    files = bundled_heldout().split(",")
    assert 0 < len(files) <= len(listed) == 40 and all(Path(path).is_file() for path in files)
    monkeypatch.setattr(cli, "bundled_heldout", lambda: files[0])  # one file keeps the test fast
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    arguments = ["--max_rows", "2", "--seq_len", "32", "--timing_repeats", "2", "--max_gamma", "2"]
    arguments += ["--timing_context", "16"]  # 2 rows of 32 hold 64 tokens: the default 64 and its step do not fit
    assert main(["profile", *arguments, "--output", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert f"{BUNDLED}: 2 rows of 32 tokens from the demo target's held-out files" in printed
    assert "| trained alpha |" in re.sub(r" +", " ", printed) and "| exit_8 " in printed  # the bundled exit heads
    assert (tmp_path / "alpha_by_depth.png").read_bytes()[:4] == b"\x89PNG"


def test_profile_refuses_rows_longer_than_the_model_before_its_run(monkeypatch, tmp_path):
    import selfspec.measure.profile

    def refuse(*args, **kwargs):
        raise AssertionError("the profile ran on rows longer than the model's positions")

    monkeypatch.setattr(cli, "bundled_heldout", lambda: bundled_heldout().split(",")[0])
    monkeypatch.setattr(selfspec.measure.profile, "profile_heads", refuse)
    with pytest.raises(SystemExit, match="--seq_len 1025 exceeds the model's 1024 positions"):  # the demo target's
        main(["profile", "--seq_len", "1025", "--max_rows", "1", "--output", str(tmp_path)])


@pytest.mark.parametrize(
    "extra, problem",
    [
        (["--timing_context", "1024"], "--timing_context 1024 does not fit the model's 1024 positions: .* then one new "
         "token: 1025 positions; lower it to 1023 or less"),
        (["--timing_context", "1020", "--measure_v", "--max_gamma", "4"], "--timing_context 1020 does not fit the "
         r"model's 1024 positions: .* then --max_gamma 4 \+ 1 new positions \(--measure_v\): 1025 positions; "
         "lower it to 1019 or less"),
    ],
)  # fmt: skip
def test_profile_refuses_a_timing_context_beyond_the_model_before_its_run(extra, problem, monkeypatch, tmp_path):
    import selfspec.measure.profile

    def refuse(*args, **kwargs):
        raise AssertionError("the profile ran with timed passes beyond the model's positions")

    monkeypatch.setattr(cli, "bundled_heldout", lambda: bundled_heldout().split(",")[0])
    monkeypatch.setattr(selfspec.measure.profile, "profile_heads", refuse)
    with pytest.raises(SystemExit, match=problem):  # the demo target has 1024
        main(["profile", *extra, "--max_rows", "1", "--output", str(tmp_path)])
    cli.check_timing_positions(build_parser().parse_args(["profile", "--timing_context", "1023"]), 1024)  # fits


def test_profile_refuses_a_timing_context_its_rows_cannot_fill(monkeypatch, tmp_path):
    """c is timed after --timing_context tokens of the rows laid end to end: fewer would time a shorter context."""
    import selfspec.measure.profile

    def refuse(*args, **kwargs):
        raise AssertionError("the profile ran with a shorter timing context than asked")

    monkeypatch.setattr(cli, "bundled_heldout", lambda: bundled_heldout().split(",")[0])
    monkeypatch.setattr(selfspec.measure.profile, "profile_heads", refuse)
    problem = "--timing_context 100 needs 102 held-out tokens to time on; 2 row\\(s\\) of 32 hold 64: raise --max_rows"
    with pytest.raises(SystemExit, match=problem):
        main(["profile", "--timing_context", "100", "--max_rows", "2", "--seq_len", "32", "--output", str(tmp_path)])


def test_profile_with_model_needs_data():
    with pytest.raises(SystemExit, match="--model needs --data"):
        main(["profile", "--model", str(BUNDLED)])


def test_a_missing_extra_is_named(monkeypatch):
    def lean_install(args):
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    monkeypatch.setattr(cli, "run_demo", lean_install)
    message = "selfspec demo needs matplotlib, which is in selfspec's [demo] extra: pip install -e '.[demo]'"
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(["demo"])


def test_profile_names_a_missing_wandb_before_its_run(monkeypatch, tmp_path):
    import selfspec.measure.profile

    def refuse(*args, **kwargs):
        raise AssertionError("the profile ran before the missing wandb was named")

    monkeypatch.setitem(sys.modules, "wandb", None)  # an install without the [train] extra
    monkeypatch.setattr(selfspec.measure.profile, "profile_heads", refuse)
    message = "selfspec profile needs wandb, which is in selfspec's [train] extra"
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(["profile", "--report_to", "wandb", "--output", str(tmp_path)])


def test_the_demo_runs_on_its_own_extras(tmp_path):
    """README command 1 installs `.[demo,smollm2]` alone: the demo runs with the [train] extra's datasets, wandb and
    peft absent (a module-level import of training code broke it once)."""
    code = (
        "import sys; sys.modules.update(dict.fromkeys(['datasets', 'wandb', 'peft'])); "
        "from selfspec.cli.main import main; "
        f"sys.exit(main(['demo', '--model', 'demo', '--num_prompts', '1', '--max_new_tokens', '4', "
        f"'--output', {str(tmp_path)!r}]))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Greedy outputs identical to model.generate: yes" in result.stdout


def test_the_command_line_answers_help_without_loading_torch():
    """The parsers import neither torch nor transformers (`selfspec --help` answers at once); each subcommand's
    help line is its description too."""
    code = (
        "import sys; import selfspec.cli.main as cli; parser = cli.build_parser(); "
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
    help_text = subprocess.run([sys.executable, "-m", "selfspec.cli.main", "demo", "--help"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "answer a few chat prompts with smollm2-135m-instruct" in help_text.split("options:")[0]
