"""Bad input to the `selfspec` commands and the training script: an error that names the option, the path or the
value, before any work where it can be known then; never a deep traceback, a silent substitute or a lost folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from selfspec.cli import commands, demo
from selfspec.cli.main import main
from selfspec.targets import as_dtype, load_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["bench", "--num_prompts", "0"], "--num_prompts: must be 1 or more, got 0"),
        (["bench", "--repeats", "0"], "--repeats: must be 1 or more"),
        (["bench", "--max_new_tokens", "0"], "--max_new_tokens: must be 1 or more"),
        (["bench", "--limit_per_category", "0"], "--limit_per_category: must be 1 or more"),
        (["bench", "--num_threads", "-1"], "--num_threads: must be 0 or more"),
        (["bench", "--temperature", "0"], "--temperature: must be above 0"),
        (["bench", "--batch_sizes", "1,x"], "--batch_sizes: expected a whole number, got 'x'"),
        (["bench", "--batch_sizes", "1,2,"], "--batch_sizes: expected comma-separated numbers"),
        (["bench", "--batch_sizes", "4,0"], "--batch_sizes: must be 1 or more, got 0"),
        (["bench", "--assistant_exit_layers", "3,x"], "--assistant_exit_layers: expected a whole number"),
        (["bench", "--untrained_exit_layer", "0"], "--untrained_exit_layer: must be 1 or more"),
        (["bench", "--chains", "0,3"], "--chains: must be 1 or more, got 0"),
        (["bench", "--chains", "1,x"], "--chains: expected a whole number, got 'x'"),
        (["bench", "--merged_trees", "3-3"], "such as 2-2-1/6, comma-separated; got '3-3'"),
        (["bench", "--merged_trees", "a-b-c/6"], "--merged_trees: expected NODES-TOP_K-DEPTH/LOOKUP_TOKENS"),
        (["bench", "--merged_trees", "2-2-1/3,2-0-1/3"], "--merged_trees: every number of '2-0-1/3' must be 1 or more"),
        (["bench", "--merged_trees", ","], "comma-separated; got ','"),
        (["demo", "--num_prompts", "-1"], "--num_prompts: must be 1 or more"),
        (["tune", "--max_gamma", "0"], "--max_gamma: must be 1 or more"),
        (["tune", "--timing_repeats", "0"], "--timing_repeats: must be 1 or more"),
        (["tune", "--batch_sizes", "0"], "--batch_sizes: must be 1 or more"),
        (["profile", "--exit_layers", "a"], "--exit_layers: expected a whole number"),
        (["profile", "--max_rows", "0"], "--max_rows: must be 1 or more"),
        (["profile", "--timing_context", "0"], "--timing_context: must be 1 or more"),  # no context to time after
        # a repeated value would run, or report, the same contender twice under one name (profile: drop it)
        (["bench", "--chains", "2,3,2"], "--chains: 2 is given twice in '2,3,2'"),
        (["bench", "--assistant_exit_layers", "3,3"], "--assistant_exit_layers: 3 is given twice"),
        (["bench", "--batch_sizes", "1,4,4"], "--batch_sizes: 4 is given twice"),
        (["profile", "--exit_layers", "6,3,6"], "--exit_layers: 6 is given twice"),
        (["bench", "--merged_trees", "2-2-1/3, 2-2-1/3"], "--merged_trees: '2-2-1/3' is given twice"),
    ],
)
def test_numbers_out_of_range_are_refused_by_the_parser(argv, problem, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2 and problem in capsys.readouterr().err


@pytest.fixture
def no_loading(monkeypatch):
    """The commands' loading of the target fails the test: the checks under test come before it."""

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the bad input was refused")

    for module in (commands, demo):
        monkeypatch.setattr(module, "load_target", refuse)


@pytest.mark.parametrize("command", ["bench", "demo", "profile"])
def test_an_output_that_is_a_file_stops_the_command_before_its_run(command, tmp_path, no_loading):
    (tmp_path / "taken").write_text("x")
    for output in (tmp_path / "taken", tmp_path / "taken" / "below"):
        with pytest.raises(SystemExit, match=f"--output {output}: {tmp_path / 'taken'} is a file"):
            main([command, "--output", str(output)])
    assert (tmp_path / "taken").read_text() == "x"


def test_bench_refuses_options_its_runs_would_ignore(no_loading):
    for extra, problem in [
        (["--batch_sizes", "1", "--chains", "1,2"], "--chains is an option of the Spec-Bench runs"),
        (["--batch_sizes", "1", "--workload", "repeated"], "--batch_sizes and --workload repeated are separate"),
        (["--assistant_exit_layers", "2", "--no_transformers"], "--assistant_exit_layers sets transformers'"),
        (["--batch_sizes", "1", "--temperature", "0.7"], "--temperature .* --batch_sizes measures greedy decoding"),
        (["--workload", "repeated", "--temperature", "0.7"], "--workload repeated measures greedy decoding"),
        (["--no_sampling", "--temperature", "0.7"], "which --no_sampling leaves out"),
        (["--workload", "repeated", "--chains", "1,2"], "--chains is an option of the Spec-Bench runs; --workload rep"),
        (["--workload", "repeated", "--prompts", "p.json"], "--prompts is an option of the Spec-Bench runs"),
        (["--workload", "repeated", "--no_transformers"], "--no_transformers is an option of the Spec-Bench runs"),
        (["--batch_sizes", "1", "--no_transformers"], "--no_transformers is an option of the Spec-Bench runs"),
        (["--workload", "repeated", "--limit_per_category", "2"], "--limit_per_category is an option of the Spec-"),
        (["--workload", "repeated", "--compile"], "--compile is an option of the Spec-Bench runs"),
        (["--warmup", "2"], "--warmup sets the untimed calls of --workload repeated"),
        (["--no_sampling", "--seed", "0"], "--seed seeds the sampled contenders, which --no_sampling leaves out"),
        (["--batch_sizes", "1", "--seed", "1"], "--seed seeds .* --batch_sizes measures greedy decoding"),
        (["--workload", "repeated", "--seed", "1"], "--seed seeds .* --workload repeated measures greedy decoding"),
        (["--warmup", "0", "--batch_sizes", "1"], "--warmup sets the untimed calls of --workload repeated"),
    ]:
        with pytest.raises(SystemExit, match=problem):
            main(["bench", *extra])


def test_profile_refuses_a_project_without_wandb_before_loading(monkeypatch, tmp_path):
    from selfspec.cli import main as cli

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the bad input was refused")

    monkeypatch.setattr(cli, "load_cli_model", refuse)
    with pytest.raises(SystemExit, match="--project names the W&B project of --report_to wandb"):
        main(["profile", "--project", "mine", "--output", str(tmp_path)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU takes --device cuda")
def test_a_device_this_torch_cannot_use_is_named():
    with pytest.raises(SystemExit, match="--device cuda: this torch .* sees no CUDA GPU"):
        main(["bench", "--device", "cuda"])
    with pytest.raises(SystemExit, match="--device 'gpu' is not a torch device"):
        main(["bench", "--device", "gpu"])


def test_export_keeps_an_existing_folder_unless_told_to_replace_it(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("x")
    for output, what in [(tmp_path / "out", "is a folder with files in it"), (tmp_path / "file", "is a file")]:
        with pytest.raises(SystemExit, match=f"--output {output} {what}; .* pass --overwrite"):
            main(["export", "--format", "hf", "--model", "demo", "--output", str(output)])
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine" and (tmp_path / "file").read_text() == "x"
    (tmp_path / "empty").mkdir()  # an empty folder is no one's work
    assert main(["export", "--format", "hf", "--model", "demo", "--output", str(tmp_path / "empty")]) == 0
    assert main(["export", "--format", "hf", "--model", "demo", "--output", str(tmp_path / "out"), "--overwrite"]) == 0
    assert (tmp_path / "out" / "config.json").exists() and not (tmp_path / "out" / "notes.txt").exists()


def test_library_errors_end_the_command_with_their_message(tmp_path, monkeypatch, capsys):
    """A wrong path or value the library refuses ends the command with the message, not a traceback; the
    traceback is there on request."""
    missing = tmp_path / "no-heads"
    with pytest.raises(SystemExit, match=f"selfspec bench: No heads folder at {missing}") as stopped:
        main(["bench", "--heads", str(missing), "--num_prompts", "1"])
    assert "(FileNotFoundError at " in str(stopped.value.code)  # where it was raised, should it be a bug
    assert "SELFSPEC_TRACEBACK=1 shows the traceback" in str(stopped.value.code)
    monkeypatch.setenv("SELFSPEC_TRACEBACK", "0")
    with pytest.raises(SystemExit, match="No heads folder"):
        main(["bench", "--heads", str(missing), "--num_prompts", "1"])
    monkeypatch.setenv("SELFSPEC_TRACEBACK", "1")
    with pytest.raises(FileNotFoundError, match="No heads folder"):
        main(["bench", "--heads", str(missing), "--num_prompts", "1"])


def test_folders_that_hold_no_model_are_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json: it is not a model folder"):
        load_model(tmp_path / "empty")
    (tmp_path / "adapter").mkdir()  # a PEFT adapter's folder has a config of its own, which is not refused here
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(Exception) as raised:
        load_model(tmp_path / "adapter")
    assert "not a model folder" not in str(raised.value)
    heads = ROOT / "heads" / "demo-target" / "exit-heads"
    with pytest.raises(ValueError, match=r"is a selfspec heads folder \(exit heads\), not a model"):
        load_model(heads)
    with pytest.raises(OSError, match="nor a model folder under the current folder"):
        load_model("no-such-folder/below")
    with pytest.raises(ValueError, match="'int8' is not a floating-point torch dtype"):
        as_dtype("int8")


def train_heads_args(argv: list[str]):
    sys.path.insert(0, str(ROOT / "training"))
    try:
        import train_heads

        return train_heads.parse_args(argv)
    finally:
        sys.path.remove(str(ROOT / "training"))


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["--overwrit", "--train.max_steps", "2"], r"unknown option --overwrit \(did you mean --overwrite\?\)"),
        (["--resum"], r"unknown option --resum \(did you mean --resume\?\)"),
        (["--train.resume"], r"unknown option --train.resume \(did you mean --resume\?\)"),
        (["--train.max_step", "3"], r"unknown option --train.max_step \(did you mean --train.max_steps\?\)"),
        (["--train.max_steps"], "--train.max_steps needs a value"),
        (["--train.max_steps", "--data.seq_len", "64"], "--train.max_steps needs a value"),
        (["--train.max_steps=3", "--data.seq_lenn", "64"], r"unknown option --data.seq_lenn \(did you mean"),
        (["--data.seq_lenn=64"], r"unknown option --data.seq_lenn \(did you mean --data.seq_len\?\)"),
        (["--train.max_steps", "3", "4"], "unexpected argument '4'"),
    ],
)
def test_training_flags_that_are_no_flag_nor_config_key_are_named(argv, problem):
    with pytest.raises(SystemExit, match=problem):
        train_heads_args(["--config", str(ROOT / "configs" / "train_heads_demo.yaml"), *argv])


def test_training_overrides_parse_as_before():
    _, config = train_heads_args(["--train.max_steps=3", "--data.seq_len", "64", "--heads.exit_layers", "[1, 5]"])
    assert (config.train.max_steps, config.data.seq_len, config.heads.exit_layers) == (3, 64, [1, 5])


def test_a_heads_dir_below_a_file_is_refused_before_training(tmp_path):
    sys.path.insert(0, str(ROOT / "training"))
    try:
        import train_heads

        (tmp_path / "file").write_text("x")
        config = tmp_path / "c.yaml"
        config.write_text(json.dumps({"heads_dir": str(tmp_path / "file" / "h"), "output_dir": str(tmp_path / "r")}))
        with pytest.raises(SystemExit, match=f"heads_dir {tmp_path / 'file' / 'h'}: {tmp_path / 'file'} is a file"):
            train_heads.main(["--config", str(config)])
        assert not (tmp_path / "r").exists()
        config.write_text(json.dumps({"heads_dir": str(tmp_path / "file"), "output_dir": str(tmp_path / "r")}))
        with pytest.raises(SystemExit, match=f"heads_dir {tmp_path / 'file'} already exists .* pass --overwrite"):
            train_heads.main(["--config", str(config)])  # a file in its place is replaced as a folder would be
        assert (tmp_path / "file").read_text() == "x" and not (tmp_path / "r").exists()
    finally:
        sys.path.remove(str(ROOT / "training"))


def test_demo_and_tune_refuse_a_prompt_too_long_for_the_model_before_any_run(monkeypatch):
    import selfspec.measure.tune

    def refuse(*args, **kwargs):
        raise AssertionError("a run started before the prompt's length was refused")

    monkeypatch.setattr(demo, "run_bench", refuse)
    monkeypatch.setattr(selfspec.measure.tune, "tune", refuse)
    for command in (["demo", "--model", "demo"], ["tune", "--dry_run"]):  # the demo target has 1024 positions
        with pytest.raises(SystemExit, match=r"prompt 1 \(\d+ tokens\) plus --max_new_tokens 1100 exceeds .* 1024"):
            main([*command, "--num_prompts", "1", "--max_new_tokens", "1100"])
