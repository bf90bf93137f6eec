"""What the training scripts share: argument parsing, the `Progress` record, optimizer and schedule,
checkpoints and the launch checks.

The scripts import it as a sibling module (`from common import ...`): Python puts a script's own folder
first on `sys.path`, so this works for `python training/<script>.py` and `accelerate launch
training/<script>.py` from any working directory, and for torchrun's worker processes.

A train config here is any dataclass with the fields these functions read: `lr`, `beta1`, `beta2`,
`weight_decay`, `warmup_steps`, `min_lr_ratio`, `max_steps` (optimizer and schedule) and a run config
with `output_dir` and `train.keep_checkpoints` (checkpoints).
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import pickle
import re
import shlex
import shutil
import sys
import typing
import warnings
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import TypeVar

import torch
from accelerate import Accelerator
from safetensors import SafetensorError

from selfspec.hardware import native_bf16
from selfspec.training.config import config_differences, load_config, save_config

ConfigT = TypeVar("ConfigT")

# Arguments ---------------------------------------------------------------------------------------


def argument_parser(doc: str, config_help: str) -> argparse.ArgumentParser:
    """`--config FILE` and `--resume`; a script adds its own flags, and `parse_config` reads every
    `--section.key value` left over as a config override. `doc`: the script's docstring (its first paragraph
    is the description)."""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        allow_abbrev=False,
        epilog="Any config value can be overridden with --section.key value.",
    )
    parser.add_argument("--config", help=config_help)
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint if there is one")
    return parser


def parse_config(
    parser: argparse.ArgumentParser,
    config_type: type[ConfigT],
    argv: list[str] | None = None,
    shorthands: dict[str, str] | None = None,
) -> tuple[argparse.Namespace, ConfigT]:
    """(the script's flags, its config): the defaults of `config_type`, then the `--config` file, then the
    overrides. `shorthands` map a flag to the dotted key it sets (`{"report_to": "logging.report_to"}`)."""
    args, overrides = parser.parse_known_args(argv)
    check_overrides(parser, config_type, overrides)
    for flag, key in (shorthands or {}).items():
        if getattr(args, flag) is not None:
            overrides += [f"--{key}", getattr(args, flag)]
    return args, load_config(config_type, args.config, overrides)


def check_overrides(parser: argparse.ArgumentParser, config_type: type, overrides: list[str]) -> None:
    """What argparse left for the config: `--section.key value` pairs (or `--section.key=value`). A misspelled flag
    lands here too, and would take the next argument as its value: SystemExit naming it, with the closest flag
    or config key."""
    keys, open_keys = dotted_keys(config_type)
    keys, open_keys = [f"--{key}" for key in keys], [f"--{key}." for key in open_keys]
    flags = [option for action in parser._actions for option in action.option_strings]
    index = 0
    while index < len(overrides):
        arg = overrides[index]
        key = arg.split("=", 1)[0]
        if not arg.startswith("--"):
            raise SystemExit(f"{parser.prog}: unexpected argument {arg!r}; config keys are overridden with "
                             "--section.key VALUE")  # fmt: skip
        if key not in keys and not key.startswith(tuple(open_keys)):
            flag = "--" + key.rsplit(".", 1)[-1].lstrip("-")  # --train.resume: the --resume flag under a section
            close = [flag] if flag in flags else difflib.get_close_matches(key, flags + keys, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise SystemExit(f"{parser.prog}: unknown option {key}{hint}; config keys are overridden with "
                             "--section.key VALUE")  # fmt: skip
        if "=" in arg:
            index += 1
            continue
        if index + 1 >= len(overrides) or overrides[index + 1].startswith("--"):
            raise SystemExit(f"{parser.prog}: {arg} needs a value (--section.key VALUE)")
        index += 2


def dotted_keys(config_type: type, prefix: str = "") -> tuple[list[str], list[str]]:
    """(every key of a config dataclass, dotted ("train.lr"), its sections included; the keys that hold a mapping,
    under which any key may follow)."""
    keys, open_keys = [], []
    hints = typing.get_type_hints(config_type)
    for item in fields(config_type):
        key, kind = prefix + item.name, hints[item.name]
        keys.append(key)
        if is_dataclass(kind):
            more, more_open = dotted_keys(kind, key + ".")
            keys, open_keys = keys + more, open_keys + more_open
        elif any(dict in (typing.get_origin(option), option) for option in (kind, *typing.get_args(kind))):
            open_keys.append(key)
    return keys, open_keys


# Progress ----------------------------------------------------------------------------------------


@dataclass
class Progress:
    """Training state besides the model, optimizer and scheduler; saved in every checkpoint."""

    step: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0  # training wall time summed over all sessions
    heldout_loss: float | None = None  # pretraining: the most recent held-out loss
    untrained: dict | None = None  # heads: held-out figures of the untrained heads, measured once
    trained: dict | None = None  # heads: the most recent held-out figures
    tracker_run_id: str | None = None  # heads: the W&B run that a resumed session continues
    rows_digest: str | None = None  # heads: the training rows' digest (`check_same_rows`)
    commands: list[str] = field(default_factory=list)  # the command of every session

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.__init__(**state)


def check_same_rows(progress: Progress, digest: str, checkpoint: Path | None, changed: list[str], say) -> None:
    """A resumed run trains on the rows it started with: `digest` (of the training rows, in order) against the one
    its `checkpoint` recorded. Where they differ, a run whose config's data section changed (`changed`: the keys
    `restore_checkpoint` found changed) says so and goes on; one whose config did not (the data files were re-made
    or edited since) is refused. Records `digest`."""
    started, progress.rows_digest = progress.rows_digest, digest
    if checkpoint is None or started is None or started == digest:
        return
    changed = [key for key in changed if key.startswith("data.")]
    if changed:
        say(f"the training rows differ from those the run started with ({', '.join(changed)} changed): it goes on "
            f"with the new rows from step {progress.step}")  # fmt: skip
        return
    raise ValueError(
        f"--resume: the training rows differ from those the run in {checkpoint.parent.parent} started with, and the "
        "config's data section did not change: the data files were made again or edited since. Resume with the same "
        "files, or start a new run in another output_dir"
    )


# Optimizer and schedule --------------------------------------------------------------------------


def make_optimizer(model: torch.nn.Module, config) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, with weight decay on matrices only (not norms or biases)."""
    matrices = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    others = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": config.weight_decay}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2))


def learning_rate_factor(step: int, config) -> float:
    """Linear warmup to 1, then cosine decay to `min_lr_ratio` at `max_steps`."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_schedule(optimizer: torch.optim.Optimizer, config) -> torch.optim.lr_scheduler.LambdaLR:
    """`learning_rate_factor` per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: learning_rate_factor(step, config))


def apply_optimizer_config(optimizer: torch.optim.Optimizer, scheduler, config) -> None:
    """Put the config's `lr`, `beta1`, `beta2` and `weight_decay` into an optimizer and schedule that a checkpoint
    restored: `load_state` brings back the values of the session that wrote it (its param groups and the schedule's
    base_lrs), so a resumed run with `--train.lr` (the advice after a non-finite loss) would train with the old ones.
    The step count, Adam's moments and the schedule's position stay as restored."""
    inner = getattr(scheduler, "scheduler", scheduler)  # accelerate's AcceleratedScheduler wraps the LambdaLR
    decays = (config.weight_decay, 0.0)  # make_optimizer's groups: the matrices, then the rest
    lr = config.lr * learning_rate_factor(inner.last_epoch, config)
    for group, decay in zip(optimizer.param_groups, decays, strict=True):
        group.update(initial_lr=config.lr, lr=lr, betas=(config.beta1, config.beta2), weight_decay=decay)
    inner.base_lrs = [config.lr] * len(optimizer.param_groups)
    inner._last_lr = [lr] * len(optimizer.param_groups)


# Checkpoints -------------------------------------------------------------------------------------

CHECKPOINT_NAME = re.compile(r"step_(\d{6,})")


def complete_checkpoints(directory: Path) -> list[Path]:
    """Finished checkpoints, oldest first (unfinished ones are temporary folders with another name)."""
    if not directory.is_dir():
        return []
    found = [path for path in directory.iterdir() if CHECKPOINT_NAME.fullmatch(path.name)]
    return sorted(found, key=lambda path: int(CHECKPOINT_NAME.fullmatch(path.name).group(1)))


# what `save_checkpoint` writes: accelerate's `save_state` (one model, optimizer and scheduler, the registered
# `Progress`) and the config; the random states are left out, as `load_state` goes on without them
CHECKPOINT_PARTS = {
    "config.yaml": ("config.yaml",),
    "model.safetensors": ("model*.safetensors", "pytorch_model*.bin"),
    "optimizer.bin": ("optimizer*.bin",),
    "scheduler.bin": ("scheduler*.bin",),
    "custom_checkpoint_0.pkl": ("custom_checkpoint_*.pkl",),
}


def missing_parts(checkpoint: Path) -> list[str]:
    """The parts of a checkpoint (`CHECKPOINT_PARTS`) that `checkpoint` lacks: deleted, or copied in part."""
    return [
        part
        for part, patterns in CHECKPOINT_PARTS.items()
        if not any(any(checkpoint.glob(pattern)) for pattern in patterns)
    ]


def checkpoint_to_resume(run_dir: Path, resume: bool, say=None) -> Path | None:
    """The last checkpoint in `run_dir` that has every part, when `resume`; `say` (a print) tells of each later one
    skipped for a missing part, which stays on disk until the run writes that step again. A run folder that has
    checkpoints is refused without --resume (a new run would mix with the old one), and one whose checkpoints all
    lack a part with --resume (starting over would drop the run's progress)."""
    checkpoints = complete_checkpoints(run_dir / "checkpoints")
    if checkpoints and not resume:
        raise FileExistsError(f"{run_dir} already has checkpoints: pass --resume or choose another output_dir")
    skipped = []
    for checkpoint in reversed(checkpoints):
        missing = missing_parts(checkpoint)
        if not missing:
            if skipped and say is not None:
                say(f"--resume: {'; '.join(skipped)}: resuming from {checkpoint}, the last checkpoint that has "
                    "every part")  # fmt: skip
            return checkpoint
        skipped.append(f"{checkpoint} lacks {', '.join(missing)}")
    if skipped:
        raise FileNotFoundError(
            f"--resume: no checkpoint in {run_dir / 'checkpoints'} has every part ({'; '.join(skipped)}): put the "
            "missing files back, or start a new run in another output_dir"
        )
    return None


def save_checkpoint(accelerator: Accelerator, config, step: int) -> Path:
    """`save_state` into a temporary folder, renamed to step_<step> once every process has written its part
    (each writes its own random states), so a run killed at any moment leaves only complete checkpoints.
    `config` (either script's) has `output_dir` and `train.keep_checkpoints`; it is saved alongside."""
    directory = Path(config.output_dir) / "checkpoints"
    final = directory / f"step_{step:06d}"
    partial = directory / f"partial_step_{step:06d}"
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()  # every process writes its own random states into the folder
    if accelerator.is_main_process:
        save_config(config, partial / "config.yaml")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        for old in complete_checkpoints(directory)[: -config.train.keep_checkpoints]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def restore_checkpoint(accelerator: Accelerator, config, checkpoint: Path, progress: Progress) -> list[str]:
    """Load a checkpoint (the registered `progress` included), say which config values changed since, and drop
    what the interrupted session left after it: unfinished checkpoints and later metrics. Returns the changed keys."""
    changed = config_differences(load_config(type(config), checkpoint / "config.yaml"), config)
    try:
        accelerator.load_state(str(checkpoint))
    except (RuntimeError, ValueError, KeyError, EOFError, pickle.UnpicklingError, SafetensorError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        # a file cut short or changed since save_checkpoint wrote it whole (torch's zip reader, pickle, safetensors)
        if not isinstance(error, (RuntimeError, ValueError, KeyError)) or "PytorchStreamReader" in str(error):
            raise ValueError(
                f"--resume: a file in {checkpoint} cannot be read, damaged since it was written ({first}): put "
                "back a whole copy, or move that folder out of checkpoints/ to resume from the one before"
            ) from error
        if isinstance(error, RuntimeError) and "state_dict" not in str(error):
            raise  # out of memory and the like: not a config that changed
        raise ValueError(
            f"--resume: {checkpoint} does not fit what this config builds (config changed since: "
            f"{', '.join(changed) or 'nothing'}); a resumed run keeps the model, heads and LoRA it started with: "
            f"resume with those settings, or start a new run in another output_dir ({first})"
        ) from error
    accelerator.print(
        f"resumed from {checkpoint} at step {progress.step}"
        + (f"; config changed since: {', '.join(changed)}" if changed else "")
    )
    if accelerator.is_main_process:
        for stale in (Path(config.output_dir) / "checkpoints").glob("partial_step_*"):
            shutil.rmtree(stale)
        truncate_metrics(Path(config.output_dir) / "metrics.jsonl", progress.step)
    return changed


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metrics logged after `step` (and any half-written line) before re-running those steps."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            pass
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


# Launch ------------------------------------------------------------------------------------------


def resolve_mixed_precision(setting: str) -> str:
    """`auto`: bf16 where the GPU or CPU multiplies it natively (`selfspec.hardware`), fp16 on other GPUs, else no;
    any other setting as given, with a warning where bf16 is asked for on a CPU without native bf16 (its autocast
    there was 13-16x slower than float32 on an AVX2 machine)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    native, why = native_bf16(device)
    if setting == "auto":
        return "bf16" if native else ("fp16" if device == "cuda" else "no")
    if setting == "bf16" and device == "cpu" and not native:
        message = f"train.mixed_precision=bf16, and {why}: expect steps many times slower than float32"
        warnings.warn(message + " (train.mixed_precision=auto chooses for the machine)", stacklevel=2)
    return setting


def launch_command() -> str:
    """The command that started this process: the `accelerate launch` parent if there is one."""
    try:
        parent = [part.decode() for part in Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0") if part]
    except OSError:  # not Linux
        parent = []
    if "launch" in parent and any(Path(part).name == "accelerate" for part in parent):
        return shlex.join(["accelerate", *parent[parent.index("launch") :]])
    return shlex.join(["python", *sys.argv])


def check_process_count(accelerator: Accelerator) -> None:
    """Refuse to run with another process count than `accelerate launch --num_processes` asked for.

    accelerate 1.15 starts `--cpu --num_processes N` as one plain process (multi-process CPU runs go
    through mpirun, `--mpirun_hostfile`, only), with no warning."""
    words = shlex.split(launch_command())
    asked = next((w.split("=", 1)[1] for w in words if w.startswith("--num_processes=")), None)
    if "--num_processes" in words and words.index("--num_processes") + 1 < len(words):
        asked = words[words.index("--num_processes") + 1]
    if asked is not None and asked.isdigit() and int(asked) != accelerator.num_processes:
        raise SystemExit(
            f"accelerate launch asked for {asked} processes but started {accelerator.num_processes}. With --cpu, "
            "accelerate starts several processes only through mpirun (--mpirun_hostfile); on a machine without "
            f"GPUs use `accelerate launch --multi_gpu --num_processes {asked}` (gloo) or torchrun instead."
        )
