"""Pretrain the bundled demo target: a small Llama code model trained on the Python standard library.

    accelerate launch --config_file configs/accelerate/cpu.yaml training/pretrain_demo_target.py \
        --config configs/pretrain_demo_target.yaml [--resume] [--export_only] [--train.lr 3e-4 ...]

Also runs with plain `python`. Windows of the packed training stream are drawn from a generator
seeded by (seed, step, micro-batch, process), so the batch order is a function of the step and a
resumed run continues exactly. Checkpoints (`accelerator.save_state` plus the config) are written
to a temporary folder and renamed, so a run killed at any moment resumes from the last complete
one. At the end the model is exported in float16 with its tokenizer to `export_dir`.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from selfspec import frequent_tokens
from selfspec.training.config import check_optimizer_settings, save_config

from common import (
    Progress,
    apply_optimizer_config,
    argument_parser,
    checkpoint_to_resume,
    launch_command,
    make_optimizer,
    make_schedule,
    parse_config,
    resolve_mixed_precision,
    restore_checkpoint,
    save_checkpoint,
)
from stdlib_corpus import END_OF_TEXT, DataConfig, prepare_corpus


@dataclass
class ModelConfig:
    num_hidden_layers: int = 12  # decoder layers (deep enough to exit early at many depths)
    hidden_size: int = 256  # residual stream width
    intermediate_size: int = 688  # SwiGLU width, about 8/3 of hidden_size
    num_attention_heads: int = 4  # head_dim = hidden_size / num_attention_heads = 64
    num_key_value_heads: int = 4  # equal to num_attention_heads: no grouped-query attention
    max_position_embeddings: int = 1024  # longest context the exported model declares
    rope_theta: float = 10000.0  # rotary embedding base
    rms_norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_word_embeddings: bool = True  # LM head shares the input embedding matrix
    initializer_range: float = 0.02  # std of the normal weight initialisation

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("model.hidden_size must be divisible by model.num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("model.num_attention_heads must be divisible by model.num_key_value_heads")


@dataclass
class TrainConfig:
    seed: int = 0  # model initialisation and the order of training windows
    max_steps: int = 12000  # optimizer steps (about 6 CPU-hours); the cosine schedule ends here
    batch_size: int = 16  # windows per micro-batch per process
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step
    seq_len: int = 256  # tokens per training and evaluation window
    lr: float = 1e-3  # peak learning rate, reached after warmup
    min_lr_ratio: float = 0.1  # cosine decay floor as a fraction of lr
    warmup_steps: int = 200  # linear warmup from 0
    weight_decay: float = 0.1  # AdamW decay, applied to matrices only (not norms)
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    grad_clip: float = 1.0  # max global gradient norm (0 disables clipping)
    mixed_precision: str = "auto"  # auto | bf16 | fp16 | no; auto = bf16 where the CPU or GPU has it
    num_threads: int = 2  # torch.set_num_threads; 1 on a busy CPU (2 threads with one core taken crawl)
    eval_every: int = 200  # steps between held-out evaluations
    eval_windows: int = 128  # fixed held-out windows, evenly spaced over the held-out stream
    checkpoint_every: int = 200  # steps between checkpoints (one is always written at the end)
    keep_checkpoints: int = 2  # most recent checkpoints kept on disk

    def __post_init__(self):
        if self.mixed_precision not in ("auto", "bf16", "fp16", "no"):
            raise ValueError(f"train.mixed_precision must be auto, bf16, fp16 or no, got {self.mixed_precision!r}")
        for name in (
            "max_steps",
            "batch_size",
            "gradient_accumulation_steps",
            "seq_len",
            "num_threads",
            "eval_every",
            "eval_windows",
            "checkpoint_every",
            "keep_checkpoints",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be at least 1, got {getattr(self, name)}")
        check_optimizer_settings("train", self)  # the heads trainer's ranges, for the same optimizer and schedule


@dataclass
class Config:
    output_dir: str = "runs/demo_target"  # run directory: corpus cache, checkpoints, metrics.jsonl
    export_dir: str = "heads/demo-target"  # where the float16 model and tokenizer are exported
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def build_model(config: ModelConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    eot = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    llama = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=config.initializer_range,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
    )
    return LlamaForCausalLM(llama)


def training_batch(stream: np.ndarray, config: TrainConfig, step: int, micro: int, process: int) -> torch.Tensor:
    """`[batch_size, seq_len]` random contiguous windows; a pure function of (seed, step, micro, process)."""
    rng = np.random.default_rng([config.seed, step, micro, process])
    starts = rng.integers(0, len(stream) - config.seq_len + 1, size=config.batch_size)
    return torch.from_numpy(np.stack([stream[s : s + config.seq_len] for s in starts]).astype(np.int64))


def heldout_windows(stream: np.ndarray, config: TrainConfig) -> torch.Tensor:
    """`[eval_windows, seq_len]` windows evenly spaced over the held-out stream (they may overlap)."""
    starts = np.linspace(0, len(stream) - config.seq_len, config.eval_windows).astype(np.int64)
    return torch.from_numpy(np.stack([stream[s : s + config.seq_len] for s in starts]).astype(np.int64))


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, windows: torch.Tensor, batch_size: int, accelerator: Accelerator) -> float:
    """Mean next-token loss over all windows, shared out between processes."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # [loss sum, token count]
    for batch in windows[accelerator.process_index :: accelerator.num_processes].split(batch_size):
        batch = batch.to(accelerator.device)
        predicted = batch.numel() - batch.shape[0]  # the first token of each window is not predicted
        totals += torch.stack(
            [
                model(input_ids=batch, labels=batch).loss.double() * predicted,
                torch.tensor(predicted, dtype=torch.float64, device=accelerator.device),
            ]
        )
    model.train()
    totals = accelerator.reduce(totals, reduction="sum")
    return (totals[0] / totals[1]).item()


# Export ------------------------------------------------------------------------------------------


def export(accelerator: Accelerator, model, tokenizer, config: Config, progress: Progress, corpus) -> None:
    """Float16 safetensors model, tokenizer, generation config, training_summary.json, the loss curve and a
    draft vocabulary in export_dir."""
    state = accelerator.get_state_dict(model)
    if not accelerator.is_main_process:
        return
    export_dir = Path(config.export_dir)
    export_dir.mkdir(parents=True, exist_ok=True)
    fresh = build_model(config.model, tokenizer)
    fresh.load_state_dict(state)
    fresh.to(torch.float16)
    eot = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    fresh.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    fresh.save_pretrained(export_dir)
    tokenizer.save_pretrained(export_dir)
    summary = {
        "steps": progress.step,
        "finished": progress.step >= config.train.max_steps,
        "tokens_seen": progress.tokens_seen,
        "heldout_loss": progress.heldout_loss,
        "wall_time_s": round(progress.elapsed_s, 1),
        "command": progress.commands[0] if progress.commands else None,
        "commands": progress.commands,
        "parameters": sum(p.numel() for p in fresh.parameters()),
        "corpus": {
            key: corpus.manifest[key]
            for key in ("python", "train_files", "heldout_files", "train_tokens", "heldout_tokens", "skipped")
        },
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "config": asdict(config),
    }
    (export_dir / "training_summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    write_draft_vocab(corpus.train, export_dir / "draft_vocab.json", eot)
    metrics = Path(config.output_dir) / "metrics.jsonl"
    if metrics.exists():
        shutil.copyfile(metrics, export_dir / "pretrain_metrics.jsonl")
        plot_losses(export_dir / "pretrain_metrics.jsonl", export_dir / "pretrain_loss.png")
    accelerator.print(f"exported step {progress.step} to {export_dir}")


DRAFT_VOCAB_SIZE = 2048  # covers 88% of the training tokens (and 89% of the held-out ones) of the shipped target


def write_draft_vocab(train: np.ndarray, path: Path, eos: int, count: int = DRAFT_VOCAB_SIZE) -> None:
    """The `count` most frequent training tokens (and EOS), a JSON list for SelfSpeculative(draft_vocab=...)."""
    ids = frequent_tokens(torch.from_numpy(np.asarray(train, dtype=np.int64)), count, always=[eos])
    path.write_text(json.dumps(ids.tolist()) + "\n", encoding="utf-8")


def plot_losses(metrics: Path, path: Path) -> None:
    """PNG: training and held-out loss against tokens seen, from a metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    records = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()]
    tokens = [r["tokens_seen"] / 1e6 for r in records]
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot(tokens, [r["train_loss"] for r in records], label="training (mean since last evaluation)")
    axes.plot(tokens, [r["heldout_loss"] for r in records], label="held-out files")
    axes.set_xlabel("tokens seen (millions)")
    axes.set_ylabel("next-token loss (nats)")
    axes.set_ylim(1.0, 5.0)
    axes.grid(alpha=0.3)
    axes.legend()
    axes.set_title("demo target pretraining")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# Training ----------------------------------------------------------------------------------------


def train(accelerator: Accelerator, model, optimizer, scheduler, corpus, config: Config, progress: Progress) -> None:
    tc = config.train
    run_dir = Path(config.output_dir)
    eval_inputs = heldout_windows(corpus.heldout, tc)
    tokens_per_step = tc.batch_size * tc.seq_len * tc.gradient_accumulation_steps * accelerator.num_processes
    interactive = sys.stderr.isatty()
    bar = tqdm(
        total=tc.max_steps,
        initial=progress.step,
        disable=not accelerator.is_main_process,
        mininterval=1 if interactive else 60,
        dynamic_ncols=True,
        desc="pretrain",
    )
    recent_losses: list[float] = []
    last_saved = progress.step
    started = time.perf_counter()
    model.train()
    while progress.step < tc.max_steps:
        loss_sum = 0.0
        for micro in range(tc.gradient_accumulation_steps):
            batch = training_batch(corpus.train, tc, progress.step, micro, accelerator.process_index)
            batch = batch.to(accelerator.device)
            last_micro = micro == tc.gradient_accumulation_steps - 1
            with nullcontext() if last_micro else accelerator.no_sync(model):  # sync gradients once per step
                loss = model(input_ids=batch, labels=batch).loss / tc.gradient_accumulation_steps
                accelerator.backward(loss)
            loss_sum += loss.item()
        if tc.grad_clip > 0:
            accelerator.clip_grad_norm_(model.parameters(), tc.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        progress.step += 1
        progress.tokens_seen += tokens_per_step
        now = time.perf_counter()
        progress.elapsed_s += now - started
        started = now
        recent_losses.append(loss_sum)
        bar.update(1)
        bar.set_postfix(loss=f"{loss_sum:.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}", refresh=False)

        if progress.step % tc.eval_every == 0 or progress.step == tc.max_steps:
            progress.heldout_loss = heldout_loss(model, eval_inputs, tc.batch_size, accelerator)
            record = {
                "step": progress.step,
                "heldout_loss": round(progress.heldout_loss, 5),
                "train_loss": round(sum(recent_losses) / len(recent_losses), 5),
                "lr": scheduler.get_last_lr()[0],
                "tokens_seen": progress.tokens_seen,
                "elapsed_s": round(progress.elapsed_s, 1),
            }
            recent_losses.clear()
            if accelerator.is_main_process:
                bar.write(json.dumps(record))
                with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
                    f.write(json.dumps(record) + "\n")
            started = time.perf_counter()  # evaluation time is not training time
        if progress.step % tc.checkpoint_every == 0 or progress.step == tc.max_steps:
            save_checkpoint(accelerator, config, progress.step)
            last_saved = progress.step
            started = time.perf_counter()
    bar.close()
    if last_saved != progress.step:
        save_checkpoint(accelerator, config, progress.step)


def parse_args(argv: list[str] | None = None):
    """(flags, config) of this script; see `common.parse_config`."""
    parser = argument_parser(__doc__, "YAML config (keys as in the Config dataclasses)")
    parser.add_argument("--export_only", action="store_true", help="export the last checkpoint and exit")
    return parse_config(parser, Config, argv)


def main(argv: list[str] | None = None) -> None:
    args, config = parse_args(argv)
    tc = config.train
    # accelerate warns at every checkpoint that the tied lm_head.weight is not stored twice: expected.
    logging.getLogger("accelerate.utils.other").setLevel(logging.ERROR)
    torch.set_num_threads(tc.num_threads)
    accelerator = Accelerator(
        mixed_precision=resolve_mixed_precision(tc.mixed_precision), step_scheduler_with_optimizer=False
    )  # the schedule is per optimizer step
    run_dir = Path(config.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with accelerator.main_process_first():
        corpus = prepare_corpus(config.data, run_dir / "data", log=accelerator.print)

    set_seed(tc.seed)
    model = build_model(config.model, corpus.tokenizer)
    optimizer = make_optimizer(model, tc)
    scheduler = make_schedule(optimizer, tc)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    if args.export_only:
        checkpoint = checkpoint_to_resume(run_dir, resume=True, say=accelerator.print)
        if checkpoint is None:
            raise FileNotFoundError(f"no checkpoint in {run_dir / 'checkpoints'} to export")
        restore_checkpoint(accelerator, config, checkpoint, progress)
        export(accelerator, model, corpus.tokenizer, config, progress, corpus)
        return
    checkpoint = checkpoint_to_resume(run_dir, args.resume, say=accelerator.print)
    if checkpoint is not None:
        restore_checkpoint(accelerator, config, checkpoint, progress)
        apply_optimizer_config(optimizer, scheduler, tc)
    progress.commands.append(launch_command())

    parameters = sum(p.numel() for p in model.parameters())
    accelerator.print(
        f"model: {parameters / 1e6:.2f}M parameters, vocab {len(corpus.tokenizer)}, "
        f"mixed precision {accelerator.mixed_precision}, {torch.get_num_threads()} threads, "
        f"device {accelerator.device}"
    )
    if accelerator.is_main_process:
        save_config(config, run_dir / "config.yaml")
    train(accelerator, model, optimizer, scheduler, corpus, config, progress)
    export(accelerator, model, corpus.tokenizer, config, progress, corpus)


if __name__ == "__main__":
    main()
