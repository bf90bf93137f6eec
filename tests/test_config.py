"""selfspec/training/config.py: YAML <-> dataclass configs with dotted overrides, and the shipped configs."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import yaml

from selfspec.heads import default_exit_layers
from selfspec.training.config import (
    TrainHeadsConfig,
    config_differences,
    load_config,
    parse_overrides,
    save_config,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SHIPPED = sorted(path.name for path in CONFIGS.glob("train_heads_*.yaml"))  # every shipped heads config


# numbers the optimizer or schedule would take silently (a negative floor: gradient ascent at the end), or that
# AdamW refuses only after the target and data are loaded; "nan" and "inf" parse as floats
OPTIMIZER_VALUES = [
    (["--train.lr", "nan"], "train.lr must be positive and finite, got nan"),
    (["--train.lr", "inf"], "train.lr must be positive and finite, got inf"),
    (["--train.lr", "-1"], "train.lr must be positive and finite, got -1"),
    (["--train.min_lr_ratio", "-0.5"], r"train.min_lr_ratio must be in \[0, 1\], got -0.5"),
    (["--train.min_lr_ratio", "2"], r"train.min_lr_ratio must be in \[0, 1\], got 2.0"),
    (["--train.warmup_steps", "-5"], "train.warmup_steps must be at least 0, got -5"),
    (["--train.weight_decay", "-0.1"], "train.weight_decay must be 0 or more, finite, got -0.1"),
    (["--train.beta1", "1.5"], r"train.beta1 must be in \[0, 1\), got 1.5"),
    (["--train.beta2", "1"], r"train.beta2 must be in \[0, 1\), got 1.0"),
    (["--train.grad_clip", "-1"], r"train.grad_clip must be 0 \(no clipping\) or more, finite, got -1.0"),
    (["--train.grad_clip", "nan"], r"train.grad_clip must be 0 \(no clipping\) or more, finite, got nan"),
]


def flat_keys(values: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in values.items():
        keys |= flat_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}"}
    return keys


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_map_one_to_one_and_round_trip(name, tmp_path):
    config = load_config(TrainHeadsConfig, CONFIGS / name)
    written = yaml.safe_load((CONFIGS / name).read_text())
    assert flat_keys(written) == flat_keys(dataclasses.asdict(TrainHeadsConfig()))  # every key, no other
    save_config(config, tmp_path / "again.yaml")
    assert load_config(TrainHeadsConfig, tmp_path / "again.yaml") == config


def test_demo_config_targets_the_demo_model():
    config = load_config(TrainHeadsConfig, CONFIGS / "train_heads_demo.yaml")
    assert config.target.name_or_path == "heads/demo-target" and config.heads.exit_layers == [2, 3, 4, 6, 8]


def test_wandb_logs_only_when_asked():
    """The default and the demo configs log to no tracker (`--report_to wandb` asks for W&B: the overrides above)."""
    assert TrainHeadsConfig().logging.report_to == "none"
    for name in ("train_heads_demo.yaml", "train_heads_demo_eagle.yaml", "train_heads_demo_medusa.yaml"):
        assert load_config(TrainHeadsConfig, CONFIGS / name).logging.report_to == "none", name


def test_example_and_default_runs_write_under_runs():
    """Not into heads/: a run of a shipped config leaves the bundled heads alone."""
    for config in [load_config(TrainHeadsConfig, CONFIGS / name) for name in SHIPPED] + [TrainHeadsConfig()]:
        assert Path(config.output_dir).parts[0] == "runs" and Path(config.heads_dir).parts[0] == "runs"


def test_overrides_by_dotted_key(tmp_path):
    config = load_config(
        TrainHeadsConfig,
        CONFIGS / "train_heads_demo.yaml",
        [
            "--train.lr",
            "3e-4",
            "--heads.exit_layers",
            "[1, 5]",
            "--logging.report_to=wandb",
            "--target.device_map",
            "auto",
        ],
    )
    assert config.train.lr == 3e-4 and isinstance(config.train.lr, float)
    assert config.heads.exit_layers == [1, 5] and config.logging.report_to == "wandb"
    assert config.target.device_map == "auto"
    assert config_differences(config, load_config(TrainHeadsConfig, CONFIGS / "train_heads_demo.yaml")) == [
        "heads.exit_layers",
        "logging.report_to",
        "target.device_map",
        "train.lr",
    ]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--train.lrr", "1"], "unknown config key 'train.lrr'"),
        (["--nope.lr", "1"], "unknown config key 'nope'"),
        (["--train.max_steps", "ten"], "config key 'train.max_steps' expects int, got 'ten'"),
        (["--train.max_steps", "1.5"], "config key 'train.max_steps' expects int"),
        (["--logging.log_every", "true"], "config key 'logging.log_every' expects int, got True"),
        (["--heads.exit_layers", "[1, x]"], r"config key 'heads.exit_layers\[1\]' expects int, got 'x'"),
        (["--heads.exit_layers", "3"], "config key 'heads.exit_layers' expects list"),
        (["--train", "1"], "config key 'train' must be a mapping"),
        (["--heads.kind", "hydra"], "heads.kind must be one of exit, medusa, eagle; got 'hydra'"),
        (["--train.batch_size", "0"], "train.batch_size must be at least 1, got 0"),
        (["--data.heldout_fraction", "1.5"], r"data.heldout_fraction must be in \(0, 1\), got 1.5"),
        (["--data.source", "' '"], "data.source must give file globs or hub:<data set name>"),
        (["--data.source", "hub:"], "config key 'data.source' expects str, got {'hub': None}"),
        (["--target.dtype", "int8"], "target.dtype must be one of"),
        (["--train.save_dtype", "int8"], "train.save_dtype must be one of float32, bfloat16, float16; got 'int8'"),
        (["--heads.exit_layers", "[]"], "heads.exit_layers must list at least one depth"),
        (["--train.copy_rows", "-1"], "train.copy_rows must be at least 0, got -1"),
        (["--train.copy_segment", "0"], "train.copy_segment must be at least 2, got 0"),
        (["--train.copy_repeats", "1"], "train.copy_repeats must be at least 2, got 1"),
        (["--train.teacher_temperature", "0"], "train.teacher_temperature must be positive and finite, got 0"),
        *OPTIMIZER_VALUES,
        (["--train.teacher_temperature", "inf"], "train.teacher_temperature must be positive and finite, got inf"),
        (["--lora.alpha", "0"], "lora.alpha must be positive and finite"),
        # 0 was taken as unset (`or` the default) where the heads are built and where their gamma is read
        (["--heads.intermediate_size", "0"], "heads.intermediate_size must be at least 1, got 0"),
        (["--heads.num_draft_tokens", "0"], "heads.num_draft_tokens must be at least 1, got 0"),
        (["--heads.num_draft_tokens", "-2"], "heads.num_draft_tokens must be at least 1, got -2"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(TrainHeadsConfig, None, overrides)


@pytest.mark.parametrize(("overrides", "message"), OPTIMIZER_VALUES)
def test_the_demo_targets_pretraining_refuses_the_same_optimizer_values(overrides, message):
    """training/pretrain_demo_target.py trains with the same optimizer and schedule (training/common.py); its own
    train config took these values silently."""
    sys.path.insert(0, str(CONFIGS.parent / "training"))
    try:
        from pretrain_demo_target import Config
    finally:
        sys.path.remove(str(CONFIGS.parent / "training"))
    with pytest.raises(ValueError, match=message):
        load_config(Config, CONFIGS / "pretrain_demo_target.yaml", overrides)


def test_unknown_key_in_a_yaml_file_names_it(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  max_step: 10\n")
    with pytest.raises(ValueError, match="unknown config key 'train.max_step'"):
        load_config(TrainHeadsConfig, path)
    path.write_text("- a list\n")
    with pytest.raises(ValueError, match="expected a mapping at the top level"):
        load_config(TrainHeadsConfig, path)


def test_parse_overrides_needs_dashed_keys_and_values():
    assert parse_overrides(["--a.b", "1", "--c=x y"]) == [("a.b", 1), ("c", "x y")]
    with pytest.raises(ValueError, match="missing value for --a"):
        parse_overrides(["--a"])
    with pytest.raises(ValueError, match="expected a --dotted.key"):
        parse_overrides(["a", "1"])


def test_default_exit_layers_spread_over_the_depth():
    assert default_exit_layers(12) == [2, 3, 4, 6, 8]
    assert default_exit_layers(16) == [3, 4, 5, 8, 11]
    assert default_exit_layers(2) == [1]


def test_accelerate_configs():
    for name, kind, processes in [("cpu", "NO", 1), ("one_gpu", "NO", 1), ("multi_gpu", "MULTI_GPU", 2)]:
        config = yaml.safe_load((CONFIGS / "accelerate" / f"{name}.yaml").read_text())
        assert (config["distributed_type"], config["num_processes"]) == (kind, processes)
