"""Train draft heads (exit heads or Medusa heads) on a frozen target by self-distillation.

    accelerate launch --config_file configs/accelerate/cpu.yaml --num_cpu_threads_per_process 1 \
        training/train_heads.py --config configs/train_heads_demo.yaml \
        [--resume] [--overwrite] [--report_to wandb] [--train.lr 3e-4 ...]

One forward of the frozen target per batch gives every hidden state and the target's logits; each draft
(exit depth or Medusa head) learns KL(p || q) against the target's own distribution (selfspec/training/distill.py).
The rows of a step are a pure function of (seed, step, micro-step) and each process takes its slice of
them, so a resumed run continues exactly and N processes train what one process trains with the same
total batch. Checkpoints (`accelerator.save_state`) are written to a temporary folder and renamed. The
heads are written with a model card to `heads_dir`, which must not exist yet unless `--overwrite` (or
`--resume` of the run that writes it) says to replace it; figures go to metrics.jsonl, the console and
alpha_by_depth.png in `output_dir`, and to W&B with `--report_to wandb` (offline without credentials).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from selfspec.adapter import ModelAdapter
from selfspec.heads import KINDS, DraftHeads, HeadsMismatchError, load_heads
from selfspec.heads.base import check_not_a_model, nearest_existing
from selfspec.heads.lora import DraftLoRA, peft_lora_config
from selfspec.measure.profile import (
    configure_wandb,
    evaluate,
    first_of_each_answer,
    format_table,
    heads_card,
    lora_comparison_table,
    measure,
    plot_alpha,
    report_rows,
    wandb_objects,
    with_first_tokens,
)
from selfspec.targets import load_model
from selfspec.training.config import TargetConfig, TrainHeadsConfig, load_config, save_config
from selfspec.training.data import copy_pool, copy_rows, load_rows, row_tensors
from selfspec.training.distill import DistillationObjective, state_digest, target_pass, target_states
from selfspec.training.feature_cache import FeatureCache, rows_digest_of

from common import (
    Progress,
    apply_optimizer_config,
    argument_parser,
    check_process_count,
    check_same_rows,
    checkpoint_to_resume,
    launch_command,
    make_optimizer,
    make_schedule,
    parse_config,
    resolve_mixed_precision,
    restore_checkpoint,
    save_checkpoint,
)

COPY_EVAL_ROWS = 8  # held-out copy rows scored at each evaluation (train.copy_rows)


def load_target(config: TargetConfig, device: torch.device):
    """(frozen target in eval mode, its tokenizer); a peft adapter is applied on top when configured.
    `name_or_path` may name a known target (selfspec.targets: demo, smollm2-135m-instruct)."""
    kwargs = {}
    if config.device_map is not None:
        kwargs["device_map"] = config.device_map
    if config.attn_implementation is not None:
        kwargs["attn_implementation"] = config.attn_implementation
    model, tokenizer = load_model(config.name_or_path, config.dtype, **kwargs)
    if config.adapter_path is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, config.adapter_path)
    model.requires_grad_(False)
    if config.device_map is None:
        model.to(device)
    return model.eval(), tokenizer


def build_heads(config: TrainHeadsConfig, adapter: ModelAdapter) -> DraftHeads:
    """Untrained heads of the configured kind (`selfspec.heads.KINDS`; the config checked the name), with the
    draft-only LoRA when `lora.r` asks for one."""
    heads = KINDS[config.heads.kind].from_config(config.heads, adapter)
    lc = config.lora
    if lc.r:  # peft builds the draft-only adapter on the LM head; its factors train with the heads
        heads.draft_lora = DraftLoRA.from_peft(
            adapter.lm_head, peft_lora_config(lc.r, lc.alpha, lc.dropout, lc.rslora, lc.init)
        )
    if config.heads.init_from is not None:  # start from trained heads of the same shape (fine-tuning)
        start = load_heads(config.heads.init_from, adapter)
        if type(start) is not type(heads):
            raise ValueError(f"heads.init_from {config.heads.init_from} holds {start.kind} heads; the config trains "
                             f"{heads.kind} heads")  # fmt: skip
        try:
            heads.start_from(start)  # its draft LoRA too, where both have one
        except (RuntimeError, HeadsMismatchError) as error:
            raise ValueError(
                f"heads.init_from {config.heads.init_from} does not fit the heads this config builds (compare its "
                f"config.json with the config's heads and lora sections): {error}"
            ) from error
    return heads


def load_baseline(config: TrainHeadsConfig, adapter: ModelAdapter, heads: DraftHeads) -> DraftHeads | None:
    """`lora.baseline_heads`, checked before training: heads of the same kind and drafts, with no adapter."""
    path = config.lora.baseline_heads
    if path is None:
        return None
    if not config.lora.r:
        raise ValueError("lora.baseline_heads is set but lora.r is 0: there is no adapter to compare with")
    baseline = load_heads(path, adapter)
    if type(baseline) is not type(heads) or baseline.draft_names() != heads.draft_names():
        drafts, expected = baseline.draft_names(), heads.draft_names()
        raise ValueError(f"lora.baseline_heads {path} has the drafts {drafts}; these heads have {expected}")
    if baseline.draft_lora is not None:
        raise ValueError(f"lora.baseline_heads {path} carries a draft LoRA itself; give heads trained without one")
    return baseline.to(adapter.device)


@lru_cache(maxsize=4)
def _epoch_order(num_rows: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def step_rows(num_rows: int, config: TrainHeadsConfig, step: int, micro: int, process: int, processes: int):
    """Row indices of one micro-step on one process: the global batch is a pure function of (seed, step,
    micro) (each epoch a fresh permutation), and process p takes the p-th equal slice of it."""
    tc = config.train
    start = (step * tc.gradient_accumulation_steps + micro) * tc.batch_size
    share = tc.batch_size // processes
    positions = range(start + process * share, start + (process + 1) * share)
    return [int(_epoch_order(num_rows, tc.seed, p // num_rows)[p % num_rows]) for p in positions]


def parse_args(argv: list[str] | None = None):
    """(flags, config) of this script; see `common.parse_config`."""
    parser = argument_parser(__doc__, "YAML config (keys as in selfspec/training/config.py TrainHeadsConfig)")
    parser.add_argument("--overwrite", action="store_true", help="replace heads_dir if it already holds heads")
    parser.add_argument("--report_to", help="shorthand for --logging.report_to (wandb | none)")
    return parse_config(parser, TrainHeadsConfig, argv, shorthands={"report_to": "logging.report_to"})


class Run:
    """One training session: the accelerator, target, heads, data and the loop."""

    def __init__(self, config: TrainHeadsConfig, resume: bool):
        self.config = config
        tc, lc = config.train, config.logging
        if tc.num_threads is not None:
            torch.set_num_threads(tc.num_threads)
        logging.getLogger("accelerate.utils.other").setLevel(logging.ERROR)
        if lc.report_to == "wandb":
            configure_wandb(lc.wandb_mode)
        self.out = Path(config.output_dir)
        self.accelerator = accelerator = Accelerator(
            log_with=None if lc.report_to == "none" else lc.report_to,
            project_dir=str(self.out),
            mixed_precision=resolve_mixed_precision(tc.mixed_precision),
            step_scheduler_with_optimizer=False,  # the schedule is per optimizer step
            # without a GPU, `--multi_gpu` processes would each run alone unless told to use the CPU (gloo)
            cpu=not torch.accelerator.is_available(),
        )
        check_process_count(accelerator)
        checkpoint = checkpoint_to_resume(self.out, resume, say=accelerator.print)  # before the target loads
        if tc.batch_size % accelerator.num_processes:
            raise ValueError(
                f"train.batch_size={tc.batch_size} must be divisible by {accelerator.num_processes} processes"
            )
        self.out.mkdir(parents=True, exist_ok=True)
        self.model, tokenizer = load_target(config.target, accelerator.device)
        self.adapter = ModelAdapter(self.model)
        self.target_digest = state_digest(self.model)
        with accelerator.main_process_first():
            self.rows = load_rows(config.data, tokenizer)
        facts = self.rows.summary
        accelerator.print(
            f"data: {facts['train_rows']} training rows of {facts['seq_len']} tokens "
            f"({facts['train_documents']} documents), {facts['heldout_rows']} held out"
        )
        set_seed(tc.seed)
        self.heads = build_heads(config, self.adapter).to(accelerator.device)
        self.baseline = load_baseline(config, self.adapter, self.heads)
        # with train.draft_vocab, q and p over its tokens (the vocabulary the heads will draft from)
        self.vocab = self.adapter.draft_vocabulary(tc.draft_vocab) if tc.draft_vocab else None
        objective = DistillationObjective(
            self.heads, self.adapter, tc.loss, tc.recompute_logits, self.vocab, tc.teacher_temperature
        )
        self.train_vocab = objective.vocab  # the target's logits over it only (None: the whole vocabulary)
        self.copy_pool = None  # train.copy_rows: their tokens, and a fixed set of them held out for evaluation
        if tc.copy_rows:
            vocab_size = self.model.get_output_embeddings().weight.shape[0]
            draft_ids = self.vocab.ids if self.vocab is not None else None
            self.copy_pool = copy_pool(vocab_size, tokenizer.all_special_ids, draft_ids)
            self.copy_eval = copy_rows(self.copy_pool, COPY_EVAL_ROWS, tc.copy_segment, tc.copy_repeats, -1)
        self.rows_digest = rows_digest_of(self.rows.train)  # in slices: the column whole is GBs on a large set
        self.cache = self.feature_cache() if tc.feature_cache else None
        optimizer = make_optimizer(objective, tc)
        scheduler = make_schedule(optimizer, tc)
        self.objective, self.optimizer, self.scheduler = accelerator.prepare(objective, optimizer, scheduler)
        self.progress = Progress()
        accelerator.register_for_checkpointing(self.progress)
        changed = []
        if checkpoint is not None:
            changed = restore_checkpoint(accelerator, config, checkpoint, self.progress)
            apply_optimizer_config(self.optimizer, self.scheduler, tc)  # --train.lr on resume takes effect
        check_same_rows(self.progress, self.rows_digest, checkpoint, changed, accelerator.print)
        self.progress.commands.append(launch_command())
        self.process = (accelerator.process_index, accelerator.num_processes)
        held = config.eval.max_rows
        self.eval_rows, self.eval_masks = row_tensors(self.rows.heldout, range(min(held, len(self.rows.heldout))))
        answer_tokens = config.eval.answer_tokens  # None where no held-out answer starts within a row (plain text)
        self.eval_first = first_of_each_answer(self.eval_masks, answer_tokens) if answer_tokens else None
        self.eval_first = self.eval_first if self.eval_first is not None and self.eval_first.any() else None
        if accelerator.is_main_process:
            save_config(config, self.out / "config.yaml")

    def feature_cache(self) -> FeatureCache:
        """train.feature_cache for these heads, target and training rows (made by each machine's main process first)."""
        acc, fingerprint = self.accelerator, self.adapter.fingerprint()
        # bfloat16 under bf16 autocast; else the model's own dtype (fp16 autocast keeps float32 sums that fp16 could
        # not hold)
        dtype = "bfloat16" if acc.mixed_precision == "bf16" else str(self.model.dtype).removeprefix("torch.")
        digests = {"target": self.target_digest, "rows": self.rows_digest}
        with acc.local_main_process_first():  # the folder is per machine (node-local disk)
            cache = FeatureCache(
                self.config.train.feature_cache, num_rows=len(self.rows.train), seq_len=self.config.data.seq_len,
                hidden_size=fingerprint.hidden_size, num_layers=fingerprint.num_hidden_layers,
                entries=self.heads.hidden_entries(), dtype=dtype, out_dtype=self.model.dtype, digests=digests,
            )  # fmt: skip
        acc.print(
            f"feature cache: {cache.filled_rows()} of {len(self.rows.train)} rows stored, entries {cache.entries}, "
            f"{cache.size_bytes / 2**30:.1f} GiB in {dtype} at {cache.directory}"
        )
        return cache

    def target_outputs(self, index: list[int], batch: torch.Tensor):
        """The target's hidden states and teacher logits for training rows `index` (ids `batch`): a forward, or
        the feature cache's stored states and the LM head over their last entry."""
        if self.cache is None:
            return target_pass(self.model, batch, self.adapter, self.train_vocab)
        hidden_states = self.cache.hidden_states(index, batch, lambda ids: target_states(self.model, ids))
        return hidden_states, self.adapter.lm_logits(hidden_states[-1], vocab=self.train_vocab)

    def evaluate(
        self, heads: DraftHeads, rows: torch.Tensor | None = None, masks: torch.Tensor | None = None, first=False
    ) -> dict:
        """Scores per draft on the held-out rows (or on `rows` with their `masks`, the same on every process);
        `first`: also on the held-out answers' first eval.answer_tokens tokens alone (first_top1, first_chain)."""
        acc = self.accelerator

        def reduce(totals):
            return acc.reduce(totals, reduction="sum")

        sets = {"heads": heads}
        if rows is None:
            shard = self.eval_rows[acc.process_index :: acc.num_processes]
            masks = {"heads": self.eval_masks[acc.process_index :: acc.num_processes]}
            if first and self.eval_first is not None:  # the same heads again: one target forward serves both
                sets["first"], masks["first"] = heads, self.eval_first[acc.process_index :: acc.num_processes]
        else:
            shard, reduce = rows, None
        training, _ = heads.training, heads.eval()  # no dropout while evaluating (lora.dropout)
        try:
            with acc.autocast():
                scores = evaluate(
                    self.model, self.adapter, sets, shard, self.config.eval.batch_size, reduce,
                    vocabs=dict.fromkeys(sets, self.vocab), masks=masks,
                )  # fmt: skip
        finally:
            heads.train(training)
        if "first" in scores:
            return with_first_tokens(scores["heads"], scores["first"], self.config.eval.answer_tokens)
        return scores["heads"]

    def report(self, costs, scores: dict | None = None) -> list[dict]:
        """Evaluate the heads on the held-out rows (or take their `scores`, already evaluated); log the figures to
        the tracker, metrics.jsonl and the plot."""
        acc, progress = self.accelerator, self.progress
        progress.trained = self.evaluate(self.heads, first=True) if scores is None else scores
        baseline = "start" if self.config.heads.init_from else "untrained"
        max_gamma = self.config.eval.max_gamma
        rows = report_rows(self.heads, progress.untrained, progress.trained, costs, max_gamma, baseline)
        if self.copy_pool is not None:  # how well the heads copy: top-1 on the held-out copy rows
            copied = self.evaluate(self.heads, *self.copy_eval)
            for row in rows:
                row["copy_top1"] = copied[row["draft"]]["top1"]
        record = {"step": progress.step, "tokens_seen": progress.tokens_seen}
        keys = ("alpha", "top1", "kl", "chain", "conditional", "untrained_alpha", "c", "speedup")
        for row in rows:
            for key in keys + ("first_top1", "first_chain", "copy_top1"):
                if key in row:  # c and the speedup are measured on the main process only
                    record[f"eval/{key}/{row['draft']}"] = round(row[key], 5)
        record["eval/alpha_mean"] = sum(row["alpha"] for row in rows) / len(rows)
        acc.log(record, step=progress.step)
        if acc.is_main_process:
            if self.config.logging.report_to == "wandb":
                acc.get_tracker("wandb", unwrap=True).log(wandb_objects(rows), step=progress.step)
            with open(self.out / "metrics.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            plot_alpha(
                rows, self.out / "alpha_by_depth.png", f"{self.config.target.name_or_path}, step {progress.step}"
            )
        return rows

    def finished_before(self) -> bool:
        """Whether a resumed run had already ended: its last checkpoint is at train.max_steps or later and heads_dir
        holds the heads of that step (the summary written after them says so). Ending it again would rewrite
        heads_dir and its card (what `selfspec tune` changed since included) and log the last evaluation twice."""
        summary_path = self.out / "training_summary.json"
        if self.progress.step < self.config.train.max_steps or not summary_path.exists():
            return False
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
        heads_dir = Path(self.config.heads_dir)
        return (
            summary.get("steps") == self.progress.step
            and Path(summary.get("heads_dir", "")).resolve() == heads_dir.resolve()
            and (heads_dir / "config.json").exists()
        )

    def train(self) -> None:
        config, acc, progress = self.config, self.accelerator, self.progress
        tc, lc = config.train, config.logging
        if self.finished_before():
            acc.print(
                f"the run ended at step {progress.step} and wrote {config.heads_dir}: nothing to do (raise "
                "train.max_steps to train on)"
            )
            return
        if lc.report_to == "wandb":  # a resumed session continues the same W&B run
            wandb = {"dir": os.environ.get("WANDB_DIR", str(self.out)), "resume": "allow"}
            wandb.update(name=lc.run_name or Path(config.heads_dir).name, id=progress.tracker_run_id)
            acc.init_trackers(lc.project, config=asdict(config), init_kwargs={"wandb": wandb})
            if acc.is_main_process:
                progress.tracker_run_id = acc.get_tracker("wandb", unwrap=True).id
        started_from = config.heads.init_from is not None  # its heads at step 0 are the baseline
        if progress.untrained is None:  # the baseline: fresh heads, or the heads.init_from start before any step
            # a start's figures are step 0's trained ones too: with the answers' first tokens for the record
            start = self.heads if started_from else self.heads.untrained_copy()
            progress.untrained = self.evaluate(start, first=started_from)
        costs = (
            measure(self.adapter, self.heads, self.eval_rows, config.eval, self.vocab) if acc.is_main_process else None
        )
        # a resumed run reports at its next evaluation
        rows = self.report(costs, progress.untrained if started_from else None) if progress.step == 0 else None
        if rows is not None:
            acc.print(format_table(rows))
        tokens_per_step = tc.batch_size * tc.gradient_accumulation_steps * config.data.seq_len
        interactive = sys.stderr.isatty()  # a log file gets a line every 30 s, not every refresh
        bar = tqdm(
            total=tc.max_steps,
            initial=progress.step,
            disable=not acc.is_main_process,
            mininterval=0.5 if interactive else 30,
            maxinterval=10 if interactive else 60,  # tqdm's monitor thread would refresh every 10 s
            desc="heads",
        )
        last_saved, started = progress.step, time.perf_counter()
        while progress.step < tc.max_steps:
            loss_sum = self.copy_step() if tc.copy_rows else torch.zeros((), device=acc.device)
            for micro in range(tc.gradient_accumulation_steps):
                index = step_rows(len(self.rows.train), config, progress.step, micro, *self.process)
                batch, mask = row_tensors(self.rows.train, index)  # [batch_size / processes, seq_len] each
                batch, mask = batch.to(acc.device), mask.to(acc.device)  # mask: the positions to learn
                with acc.autocast():
                    hidden_states, logits = self.target_outputs(index, batch)
                with acc.no_sync(self.objective) if micro < tc.gradient_accumulation_steps - 1 else nullcontext():
                    loss = self.objective(hidden_states, logits, mask).sum() / tc.gradient_accumulation_steps
                    acc.backward(loss)
                loss_sum += loss.detach()
            self.check_finite(loss_sum, last_saved)
            if tc.grad_clip > 0:
                acc.clip_grad_norm_(self.objective.parameters(), tc.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            progress.step += 1
            progress.tokens_seen += tokens_per_step
            now = time.perf_counter()
            progress.elapsed_s, seconds, started = progress.elapsed_s + now - started, now - started, now
            bar.update(1)
            if progress.step % lc.log_every == 0:
                loss_value = acc.reduce(loss_sum, reduction="mean").item()
                lr = self.scheduler.get_last_lr()[0]
                speed = tokens_per_step / seconds
                acc.log({"train/loss": loss_value, "train/lr": lr, "train/tokens_per_s": speed}, step=progress.step)
                alpha = sum(s["alpha"] for s in progress.trained.values()) / len(progress.trained)
                bar.set_postfix(loss=f"{loss_value:.4f}", alpha=f"{alpha:.3f}", refresh=False)
            if progress.step % config.eval.every == 0 or progress.step == tc.max_steps:
                rows = self.report(costs)
                if acc.is_main_process:
                    bar.write(format_table(rows))
                if config.eval.save_heads and progress.step < tc.max_steps:  # the last ones: `finish`
                    self.save_heads(rows)
                started = time.perf_counter()  # evaluation time is not training time
            if progress.step % tc.checkpoint_every == 0 or progress.step == tc.max_steps:
                save_checkpoint(acc, config, progress.step)
                last_saved, started = progress.step, time.perf_counter()
        bar.close()
        if last_saved != progress.step:
            save_checkpoint(acc, config, progress.step)
        self.finish(rows if rows is not None else self.report(costs))

    def copy_step(self) -> torch.Tensor:
        """Learn from this step's train.copy_rows copy rows (a pure function of seed, step and process), weighted
        as one micro-step; gradients accumulate unsynchronised until the data's last micro-step."""
        tc, acc = self.config.train, self.accelerator
        process, processes = self.process
        seed = tc.seed * 1_000_000_007 + self.progress.step * processes + process
        batch, mask = (
            t.to(acc.device) for t in copy_rows(self.copy_pool, tc.copy_rows, tc.copy_segment, tc.copy_repeats, seed)
        )
        with acc.autocast():
            hidden_states, logits = target_pass(self.model, batch, self.adapter, self.train_vocab)
        with acc.no_sync(self.objective):
            loss = self.objective(hidden_states, logits, mask).sum() / tc.gradient_accumulation_steps
            acc.backward(loss)
        return loss.detach()

    def lora_comparison(self) -> str:
        """Held-out alpha with the draft adapter, with it switched off (the same heads) and of the baseline heads."""
        heads = self.heads
        lora, heads.draft_lora = heads.draft_lora, None
        try:
            off = self.evaluate(heads)
        finally:
            heads.draft_lora = lora
        baseline = self.evaluate(self.baseline) if self.baseline is not None else None
        table = lora_comparison_table(self.progress.trained, off, baseline)
        self.accelerator.print(f"draft LoRA:\n{table}")
        return table

    def check_finite(self, loss: torch.Tensor, last_saved: int) -> None:
        """Stop before the optimizer step when any process's loss is NaN or infinite, so that no update made from
        it reaches the heads or a checkpoint; the last good checkpoint stays on disk for `--resume`."""
        bad = self.accelerator.reduce((~torch.isfinite(loss)).float(), reduction="sum")
        if bad.item() > 0:
            step = self.progress.step + 1
            kept = f"step {last_saved}" if last_saved else "none yet"
            raise FloatingPointError(
                f"training stopped at step {step}: the loss is not finite ({loss.item()}) on "
                f"{int(bad.item())} process(es); the heads were not updated with it. Last good checkpoint: {kept} "
                f"in {self.out / 'checkpoints'}. Lower train.lr, set train.mixed_precision: no, or check the data, "
                "then continue with --resume."
            )

    def finish(self, rows: list[dict]) -> None:
        """Write the heads folder with its card and a summary; end the run."""
        acc = self.accelerator
        lora = self.lora_comparison() if self.heads.draft_lora is not None else None
        self.save_heads(rows, lora)
        acc.wait_for_everyone()  # the process group ends when every process is done, not while one still saves
        acc.end_training()

    def save_heads(self, rows: list[dict], lora: str | None = None) -> None:
        """Check that the target is unchanged, then write the heads as they are now, with their card (`rows`:
        this step's evaluation) and a summary."""
        acc, progress, config = self.accelerator, self.progress, self.config
        digest = state_digest(self.model)
        if digest != self.target_digest:
            raise RuntimeError("the target's weights changed during training; the heads are not saved")
        facts = {
            "steps": progress.step,
            "tokens_seen": progress.tokens_seen,
            "elapsed_s": progress.elapsed_s,
            "commands": progress.commands,
            "target_digest": digest,
            "data": self.rows.summary,
            "processes": acc.num_processes,
            "mixed_precision": acc.mixed_precision,
            "device": f"{acc.device} ({torch.get_num_threads()} threads)"
            if acc.device.type == "cpu"
            else str(acc.device),
        }
        if acc.is_main_process:
            heads = acc.unwrap_model(self.objective).heads
            card, dtype = heads_card(config, heads, rows, facts, lora), getattr(torch, config.train.save_dtype)
            heads.save_pretrained(config.heads_dir, card=card, dtype=dtype)
            summary = {**facts, "target_digest_before": self.target_digest, "heads_dir": config.heads_dir, "rows": rows}
            (self.out / "training_summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
            acc.print(f"saved heads to {config.heads_dir} after {progress.step} steps")


def check_heads_dir(config: TrainHeadsConfig, resume: bool, overwrite: bool) -> None:
    """Refuse, before any work, a run that would replace an existing heads folder (the bundled heads, say:
    their tuned defaults and card are not in the run) unless --overwrite asks for it. A resumed run may
    replace it: it started while the folder was absent, or with --overwrite."""
    heads_dir = Path(config.heads_dir)
    output_dir = Path(config.output_dir)
    # the folders above heads_dir (heads_dir itself, when it exists, follows the rule below) and output_dir
    for option, given, folder in (
        ("heads_dir", heads_dir, heads_dir.absolute().parent),
        ("output_dir", output_dir, output_dir),
    ):
        existing = nearest_existing(folder)
        if not existing.is_dir():
            raise NotADirectoryError(f"{option} {given}: {existing} is a file, where the run writes a folder")
    if heads_dir.is_dir():
        check_not_a_model(heads_dir)  # save_pretrained refuses it: say so now, not after training (--overwrite too)
    if overwrite or not heads_dir.exists() or (heads_dir.is_dir() and not any(heads_dir.iterdir())):
        return
    checkpoint = checkpoint_to_resume(output_dir, resume) if resume else None
    if checkpoint is not None:  # the run being resumed may replace the folder it writes, not one named anew
        started = load_config(TrainHeadsConfig, checkpoint / "config.yaml").heads_dir
        if Path(started).resolve() == heads_dir.resolve():
            return
        raise FileExistsError(
            f"heads_dir {heads_dir} already exists and the run in {output_dir} was writing {started}: pass "
            "--overwrite to replace it, or resume with the heads_dir the run started with"
        )
    raise FileExistsError(
        f"heads_dir {heads_dir} already exists and this run would replace it: pass --overwrite to replace it, "
        "or choose another folder (--heads_dir PATH)"
    )


def main(argv: list[str] | None = None) -> None:
    try:  # a config file, key or value, or a folder that cannot be used: the message names it, before any work
        args, config = parse_args(argv)
        check_heads_dir(config, args.resume, args.overwrite)
        checkpoint_to_resume(Path(config.output_dir), args.resume)  # checkpoints without --resume, or none whole
    except (OSError, ValueError) as error:
        raise SystemExit(f"train_heads.py: {error}") from error
    Run(config, resume=args.resume).train()


if __name__ == "__main__":
    main()
