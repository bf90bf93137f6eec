"""Dataclass configs that map one-to-one onto YAML files, with dotted command-line overrides; and the
config of `training/train_heads.py` (every default in one place, each with a one-line comment).

A config is a tree of dataclasses whose leaves are int, float, str, bool or list[int] (optionally
`| None`). `load_config(Config, "file.yaml", ["--train.lr", "3e-4"])` starts from the dataclass
defaults, applies the YAML file, then the overrides, and builds the dataclasses (so `__post_init__`
checks run on the final values). An unknown key or a value of the wrong type raises `ValueError`
naming the dotted key.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from ..adapter import LAYOUTS
from ..heads import KINDS
from ..heads.lora import check_target
from .distill import LOSSES

ConfigT = TypeVar("ConfigT")


def load_config(cls: type[ConfigT], path: str | Path | None = None, overrides: list[str] = ()) -> ConfigT:
    """Defaults of `cls`, updated by the YAML file at `path`, then by `--dotted.key value` overrides."""
    values = dataclasses.asdict(cls())
    if path is not None:
        with open(path, encoding="utf-8") as f:
            from_file = yaml.safe_load(f) or {}
        if not isinstance(from_file, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
        _merge(cls, values, from_file, prefix="")
    for key, value in parse_overrides(overrides):
        _set_dotted(cls, values, key, value)
    return _build(cls, values)


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """`["--a.b", "1", "--c=x"]` -> `[("a.b", 1), ("c", "x")]`, values parsed with `yaml.safe_load`."""
    pairs = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ValueError(f"expected a --dotted.key, got {arg!r}")
        if "=" in arg:
            key, text = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ValueError(f"missing value for {arg}")
            key, text = arg[2:], args[i + 1]
            i += 2
        pairs.append((key, yaml.safe_load(text)))
    return pairs


def save_config(config: Any, path: str | Path) -> None:
    """Write a config as YAML that `load_config` reads back to an equal config."""
    Path(path).write_text(yaml.safe_dump(dataclasses.asdict(config), sort_keys=False), encoding="utf-8")


def config_differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two configs of the same class."""
    a_values = a if isinstance(a, dict) else dataclasses.asdict(a)
    b_values = b if isinstance(b, dict) else dataclasses.asdict(b)
    keys = []
    for key in a_values.keys() | b_values.keys():
        x, y = a_values.get(key), b_values.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            keys += config_differences(x, y, prefix=f"{prefix}{key}.")
        elif x != y:
            keys.append(f"{prefix}{key}")
    return sorted(keys)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {field.name: hints[field.name] for field in dataclasses.fields(cls)}


def _merge(cls: type, values: dict, update: dict, prefix: str) -> None:
    types_ = _field_types(cls)
    for key, value in update.items():
        dotted = f"{prefix}{key}"
        if key not in types_:
            raise ValueError(f"unknown config key {dotted!r}")
        if dataclasses.is_dataclass(types_[key]):
            if not isinstance(value, dict):
                raise ValueError(f"config key {dotted!r} must be a mapping, got {value!r}")
            _merge(types_[key], values[key], value, prefix=f"{dotted}.")
        else:
            values[key] = _check_type(dotted, types_[key], value)


def _set_dotted(cls: type, values: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    update: dict = {leaf: value}
    for parent in reversed(parents):
        update = {parent: update}
    _merge(cls, values, update, prefix="")


def _check_type(key: str, expected: Any, value: Any) -> Any:
    allowed = typing.get_args(expected) if isinstance(expected, types.UnionType) else (expected,)
    if value is None and type(None) in allowed:
        return None
    for kind in allowed:
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is float and isinstance(value, str):
            try:  # YAML 1.1 reads "3e-4" (no dot) as a string
                return float(value)
            except ValueError:
                pass
        if kind is str and isinstance(value, str):
            return value
        if typing.get_origin(kind) is list and isinstance(value, list):
            (item,) = typing.get_args(kind)
            return [_check_type(f"{key}[{index}]", item, entry) for index, entry in enumerate(value)]
    names = " | ".join(
        str(kind) if typing.get_origin(kind) else getattr(kind, "__name__", str(kind)) for kind in allowed
    )
    raise ValueError(f"config key {key!r} expects {names}, got {value!r}")


def _build(cls: type[ConfigT], values: dict) -> ConfigT:
    types_ = _field_types(cls)
    kwargs = {
        key: _build(types_[key], value) if dataclasses.is_dataclass(types_[key]) else value
        for key, value in values.items()
    }
    return cls(**kwargs)


def _at_least(section: str, config: Any, minimum: int, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(config, name) < minimum:
            raise ValueError(f"{section}.{name} must be at least {minimum}, got {getattr(config, name)}")


def _require(key: str, value: Any, holds: bool, expected: str) -> None:
    """`holds`: a comparison that NaN fails too (`0 < x < math.inf`), so "nan" and "inf" are named like any value."""
    if not holds:
        raise ValueError(f"{key} must be {expected}, got {value}")


def check_optimizer_settings(section: str, config: Any) -> None:
    """The keys of a train config that AdamW, the schedule and clipping read (training/common.py: `lr`,
    `min_lr_ratio`, `warmup_steps`, `weight_decay`, `beta1`, `beta2`, `grad_clip`), each in its range: ValueError
    naming `section.key` where one is not (a negative lr or floor trains by gradient ascent; AdamW's own check of the
    betas comes only after the model and data are loaded)."""
    _at_least(section, config, 0, ("warmup_steps",))
    _require(f"{section}.lr", config.lr, 0 < config.lr < math.inf, "positive and finite")
    _require(f"{section}.min_lr_ratio", config.min_lr_ratio, 0 <= config.min_lr_ratio <= 1, "in [0, 1]")
    decay = config.weight_decay
    _require(f"{section}.weight_decay", decay, 0 <= decay < math.inf, "0 or more, finite")
    for name in ("beta1", "beta2"):
        _require(f"{section}.{name}", getattr(config, name), 0 <= getattr(config, name) < 1, "in [0, 1)")
    clip = config.grad_clip
    _require(f"{section}.grad_clip", clip, 0 <= clip < math.inf, "0 (no clipping) or more, finite")


def _one_of(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{key} must be one of {', '.join(map(str, choices))}; got {value!r}")


# The config of training/train_heads.py --------------------------------------------------------------


@dataclass
class TargetConfig:
    name_or_path: str = "heads/demo-target"  # the frozen target: a known target's name (targets.py), folder or hub name
    adapter_path: str | None = None  # a peft (LoRA) adapter folder applied on the target; it stays frozen too
    dtype: str = "auto"  # weights as loaded: auto (as saved) | float32 | bfloat16 | float16
    device_map: str | None = None  # "auto" spreads a target too large for one device over the GPUs (1 process)
    attn_implementation: str | None = None  # eager | sdpa | ...; None lets transformers choose

    def __post_init__(self):
        _one_of("target.dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        if not self.name_or_path:
            raise ValueError("target.name_or_path must name a known target, a model folder or a hub model")


@dataclass
class DataConfig:
    source: str = "{stdlib}/**/*.py"  # comma-separated file globs ({stdlib}: Python's standard library) or hub:<name>
    exclude: str | None = None  # comma-separated globs of files to leave out (e.g. {stdlib}/site-packages/**)
    hub_config: str | None = None  # the hub data set's configuration name
    hub_split: str = "train"  # the hub data set's split to read
    text_field: str = "text"  # jsonl / parquet / hub column holding plain text
    messages_field: str = "messages"  # column of chat messages, rendered with the tokenizer's chat template
    heldout_files: str | None = None  # globs of held-out files; None holds out heldout_fraction of documents
    heldout_fraction: float = 0.02  # share of documents held out when heldout_files is None
    seed: int = 0  # seeds the held-out split by fraction
    seq_len: int = 256  # tokens per packed row (documents joined by the EOS token, then cut)
    max_documents: int | None = None  # read at most this many training documents (None: all)
    bad_rows: str = "stop"  # a json/jsonl/parquet row without usable text: stop (naming file and row) or skip it
    loss_on: str = "answers"  # chat rows: learn the assistant turns only (answers) or every token (all)

    def __post_init__(self):
        _one_of("data.bad_rows", self.bad_rows, ("stop", "skip"))
        _one_of("data.loss_on", self.loss_on, ("answers", "all"))
        if not self.source.strip() or self.source.strip() == "hub:":
            raise ValueError("data.source must give file globs or hub:<data set name>")
        if self.heldout_files is None and not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"data.heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        _at_least("data", self, 2, ("seq_len",))
        if self.max_documents is not None:
            _at_least("data", self, 1, ("max_documents",))


@dataclass
class HeadsConfig:
    kind: str = "exit"  # exit: one head per exit depth; medusa: heads on the last hidden state; eagle: EAGLE head
    exit_layers: list[int] | None = None  # exit depths (1..L-1); None: about L/6, L/4, L/3, L/2, 2L/3
    # MLP width: exit heads' (None: 2 x hidden_size); an EAGLE head's layer's (None: the target's; wider than
    # heads.init_from's: its weights, the new units silent at first, `EagleHeads.widened_from`)
    intermediate_size: int | None = None
    num_heads: int = 4  # Medusa heads (head i predicts the token i+2 positions ahead)
    num_layers: int = 1  # residual blocks per Medusa head
    own_lm_head: bool = False  # Medusa heads with their own LM head (a copy of the target's) instead of the shared one
    feature_layers: list[int] | None = None  # eagle: decoder layers whose outputs it fuses; None: the last hidden state
    unroll: int = 3  # eagle: training steps per position, the head fed its own outputs (loss weight 0.8^step)
    layout: str = "eagle"  # eagle: fc([token; feature]) into one decoder layer (EAGLE-1); eagle3: EAGLE-3's layer
    num_draft_tokens: int | None = None  # gamma recorded in the heads config; None: selfspec's default
    init_from: str | None = None  # a heads folder of the same shape whose weights training starts from

    def __post_init__(self):
        _one_of("heads.kind", self.kind, tuple(KINDS))
        _at_least("heads", self, 1, ("num_heads", "num_layers", "unroll"))
        _one_of("heads.layout", self.layout, LAYOUTS)
        if self.exit_layers is not None and not self.exit_layers:
            raise ValueError("heads.exit_layers must list at least one depth (or be null for the default spread)")
        for name in ("intermediate_size", "num_draft_tokens"):  # 0 read as "unset" downstream: the default silently
            if getattr(self, name) is not None:
                _at_least("heads", self, 1, (name,))


@dataclass
class DraftLoraConfig:
    r: int = 0  # rank of a draft-only LoRA on the shared LM head, trained with the heads (0: none)
    alpha: float = 32.0  # peft's lora_alpha: the update is scaled by alpha / r (alpha / sqrt(r) with rslora)
    dropout: float = 0.0  # peft's lora_dropout on the LM head's input, while training
    rslora: bool = False  # peft's use_rslora
    init: str = "default"  # peft's init_lora_weights: default (A Kaiming-uniform, B zero) | gaussian
    target: str = "lm_head"  # the adapted module: the shared LM head only (the verify pass never uses the adapter)
    baseline_heads: str | None = None  # heads trained with this config but no adapter: the card compares alpha

    def __post_init__(self):
        _one_of("lora.init", self.init, ("default", "gaussian"))
        if self.r < 0:
            raise ValueError(f"lora.r must be 0 (no adapter) or a positive rank, got {self.r}")
        _require("lora.alpha", self.alpha, 0 < self.alpha < math.inf, "positive and finite (0 silences the adapter)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        check_target(self.target)


@dataclass
class TrainConfig:
    seed: int = 0  # heads initialisation and the order of training rows
    max_steps: int = 2000  # optimizer steps; the cosine schedule ends here
    batch_size: int = 16  # rows per optimizer micro-step summed over all processes (divisible by their count)
    gradient_accumulation_steps: int = 1  # micro-steps per optimizer step
    lr: float = 1e-3  # peak learning rate, reached after warmup
    min_lr_ratio: float = 0.1  # cosine decay floor as a fraction of lr
    warmup_steps: int = 50  # linear warmup from 0
    weight_decay: float = 0.0  # AdamW decay of the heads' matrices (the heads start as the identity)
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    grad_clip: float = 1.0  # max global gradient norm (0 disables clipping)
    loss: str = "kl"  # kl: KL(p || q); soft_ce: -sum p log q (same gradient, offset by the entropy of p); tv:
    # 0.9 TV(p, q) + 0.1 KL(p || q), TV = 1 - alpha (what acceptance pays for)
    teacher_temperature: float = 1.0  # p = softmax(target logits / T) in the loss; T < 1 sharpens it toward the
    # target's argmax (what greedy verification accepts); evaluations measure against the target at T = 1
    recompute_logits: bool = False  # recompute each draft's logits in backward: less memory for large vocabularies
    draft_vocab: str | None = None  # token-id JSON: q and the target's p both over these tokens (EAGLE-3's reduced
    # vocabulary; drafts then use the same draft_vocab); None: the whole vocabulary
    mixed_precision: str = "auto"  # auto | bf16 | fp16 | no; auto = bf16 where the CPU or GPU has it
    num_threads: int | None = None  # torch.set_num_threads (1 on a busy CPU); None keeps torch's choice
    checkpoint_every: int = 200  # steps between checkpoints (one is always written at the end)
    keep_checkpoints: int = 2  # most recent checkpoints kept on disk
    save_dtype: str = "float32"  # the weights written to heads_dir: float32 | bfloat16 | float16 (half the folder);
    # training and its checkpoints stay in float32
    feature_cache: str | None = None  # a folder: the target's hidden states per training row, stored at a row's
    # first visit and read back at later ones (epochs after the first skip the target's forward); None: no cache
    copy_rows: int = 0  # synthetic copy rows learned at every step beside the data's rows (per process): random
    # tokens of the draft vocabulary, a segment repeated, that teach the heads to copy (data.py's `copy_rows`); 0: none
    copy_segment: int = 48  # the longest copied segment; each row draws its length from a quarter of it up to it
    copy_repeats: int = 3  # a copy row holds copy_segment x copy_repeats tokens (shorter segments repeat more often)

    def __post_init__(self):
        _one_of("train.loss", self.loss, LOSSES)
        _one_of("train.save_dtype", self.save_dtype, ("float32", "bfloat16", "float16"))
        _one_of("train.mixed_precision", self.mixed_precision, ("auto", "bf16", "fp16", "no"))
        names = ("max_steps", "batch_size", "gradient_accumulation_steps", "checkpoint_every", "keep_checkpoints")
        _at_least("train", self, 1, names)
        _at_least("train", self, 0, ("copy_rows",))
        _at_least("train", self, 2, ("copy_segment",))
        _at_least("train", self, 2, ("copy_repeats",))
        if self.num_threads is not None:
            _at_least("train", self, 1, ("num_threads",))
        check_optimizer_settings("train", self)
        temperature = self.teacher_temperature
        _require("train.teacher_temperature", temperature, 0 < temperature < math.inf, "positive and finite")


@dataclass
class EvalConfig:
    every: int = 200  # steps between held-out evaluations (one always runs before training and at the end)
    max_rows: int = 64  # held-out rows per evaluation (the first ones, always the same)
    batch_size: int = 8  # rows per evaluation forward, per process
    timing_context: int = 64  # tokens in the cache while timing one-token steps to measure c
    timing_repeats: int = 20  # timed repetitions per measurement (the median is used)
    max_gamma: int = 8  # the predicted speedup is maximised over gamma = 1..max_gamma
    measure_v: bool = False  # also measure v(gamma) = verify(gamma+1 positions) / one step; else v = 1
    # also score the first N positions of each answer alone (eval/first_top1, eval/first_chain): a benchmark that
    # generates N new tokens drafts there, while the whole answers' figure leans on the repetitive tails of long
    # ones; 0: not
    answer_tokens: int = 128
    # write the heads and their card to heads_dir at every evaluation, not only at the end: a run that a session's
    # end stops leaves its last evaluated heads to try and commit (a later --resume carries on)
    save_heads: bool = True

    def __post_init__(self):
        _at_least("eval", self, 1, ("every", "max_rows", "batch_size", "timing_context", "timing_repeats", "max_gamma"))
        _at_least("eval", self, 0, ("answer_tokens",))


@dataclass
class LoggingConfig:
    report_to: str = "none"  # none | wandb: a W&B run only when asked (--report_to wandb on the command line)
    project: str = "selfspec-heads"  # tracker project
    run_name: str | None = None  # tracker run name; None: the heads folder's name
    wandb_mode: str = "auto"  # auto: online with credentials and a reachable server, else offline | online | offline
    log_every: int = 10  # steps between training-loss logs

    def __post_init__(self):
        _one_of("logging.report_to", self.report_to, ("wandb", "none"))
        _one_of("logging.wandb_mode", self.wandb_mode, ("auto", "online", "offline"))
        _at_least("logging", self, 1, ("log_every",))


@dataclass
class TrainHeadsConfig:
    output_dir: str = "runs/heads-demo"  # run folder: checkpoints, metrics.jsonl, plot, tracker files
    heads_dir: str = "runs/heads-demo/heads"  # the trained heads folder (replacing an existing one: --overwrite)
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    heads: HeadsConfig = field(default_factory=HeadsConfig)
    lora: DraftLoraConfig = field(default_factory=DraftLoraConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
