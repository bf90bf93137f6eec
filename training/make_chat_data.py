"""Self-distillation chat data for an instruct target: instructions of every kind Spec-Bench measures, built
offline, and the target's own user turns (Magpie), all answered by the target itself.

    python training/make_chat_data.py --out_dir runs/smollm2-chat [--count 16000] [--seed 0] \
        [--time_limit 60] [--num_threads 1]                                   # generate (resumable)
    .venv-vllm/bin/python training/make_chat_data.py --engine vllm --target runs/smollm2-hf-bf16 \
        --out_dir runs/smollm2-chat                                           # the same, with vLLM (faster)
    python training/make_chat_data.py --out_dir runs/smollm2-chat --pack training/data/smollm2-chat  # card

Instructions (training/chat_data/kinds.py) come from material on this machine, never from a benchmark: manual
pages (summaries, extraction and questions over passages of 120-850 words), gettext catalogues (program
messages in eleven languages, translated into English), the standard library's docstrings (coding), word
lists (writing, roleplay, STEM, humanities, short questions) and random numbers (math, reasoning). A share
of the slots ("magpie") holds user turns the target writes itself, sampled at T=1 after its chat
template's user prefix. With `--prose_wheel` the instructions come instead from the news stories and
encyclopedia articles in gensim's wheel (`pip download --no-deps gensim==4.4.0`; kinds.PROSE_MAKERS), in a run
of their own. Every instruction is answered greedily or at T=0.7 (half each), by transformers in
batches whose finished rows leave (chat_data/decode.py; on a GPU where one is visible, `--device`, with a larger
`--batch_size` and `--token_budget` there) or by vLLM's offline engine (`--engine vllm`, in vLLM's own
environment, on the target written as a model folder); a fifth of them get a second user turn
(a follow-up such as "Can you make it shorter?") and a second answer. Every 10th instruction is held out.

Work goes in windows of `--window` instructions: Magpie turns, then answers, then second turns, each batch
appended to `magpie.jsonl` / `rows.jsonl` as it finishes. A stopped run (Ctrl-C, `--time_limit`, a session's
end) continues where it was when the same command runs again. `--pack DIR` writes `train.jsonl.gz`,
`heldout.jsonl.gz` (chat `messages`, the two-turn version where there is one), a data card, a length
histogram and the run's own files (`raw/`) to DIR; `--resume_from DIR` continues that run in an empty
`--out_dir`, on another machine or in another session (an `--out_dir` that holds that run goes on from its own
rows, and one that holds another run is refused).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # the pipeline beside this script; selfspec in vLLM's environment
from chat_data import card, kinds  # noqa: E402
from chat_data.engines import TransformersEngine, VllmEngine  # noqa: E402

from selfspec.cli.parsers import positive  # noqa: E402

# ---- defaults (each overridable on the command line) ----
TARGET = "smollm2-135m-instruct"  # a known target name (selfspec/targets.py) or a model folder
NUM_INSTRUCTIONS = 16000  # instruction slots built (about 2.5M answer tokens for SmolLM2)
WINDOW = 256  # instructions per resumable unit of work
BATCH_SIZE = 64  # rows per decoding batch, fewer where prompts are long (TOKEN_BUDGET)
TOKEN_BUDGET = 16384  # prompt tokens per batch's prefill
MAX_NEW_TOKENS = 384  # answer length cap; longer answers are cut and marked truncated
MAX_PROMPT_TOKENS = 2048 - MAX_NEW_TOKENS  # longer prompts are skipped (recorded)
MAGPIE_MAX_TOKENS = 160  # a Magpie user turn that does not end by then is dropped
TEMPERATURE = 0.7  # for the sampled half
TWO_TURN_SHARE = 0.2
HELDOUT_EVERY = 10  # instruction i with i % 10 == 9 is held out
NUM_THREADS = 1  # the machine is shared


@dataclass
class Instruction:
    """One instruction slot, with its place in the output."""

    index: int  # position in the seeded, shuffled list; the resume key
    kind: str
    text: str | None  # None for a Magpie slot until the target has written it
    sampled: bool  # answered at TEMPERATURE, else greedily
    heldout: bool
    follow_up: str | None  # the second user turn, for two-turn conversations


def build_instructions(
    count: int, seed: int, material: kinds.Material | kinds.Prose | None = None
) -> list[Instruction]:
    """`count` instruction slots in a seeded order, kinds drawn by kinds.SHARES (from `kinds.Prose` material: by
    kinds.PROSE_SHARES), texts without repeats."""
    rng = random.Random(seed)
    material = material or kinds.Material()
    prose = isinstance(material, kinds.Prose)
    makers, shares = (kinds.PROSE_MAKERS, kinds.PROSE_SHARES) if prose else (kinds.MAKERS, kinds.SHARES)
    names, weights = zip(*shares.items(), strict=True)
    slots, seen = [], set()
    while len(slots) < count:  # every draw in order, so a smaller count gives a prefix of a larger one
        kind = rng.choices(names, weights)[0]
        text = None if kind == "magpie" else makers[kind](rng, material)
        if text is not None and text in seen:
            continue
        seen.add(text)
        index = len(slots)
        slots.append(
            Instruction(
                index=index,
                kind=kind,
                text=text,
                sampled=rng.random() < 0.5,
                heldout=index % HELDOUT_EVERY == HELDOUT_EVERY - 1,
                follow_up=rng.choice(kinds.FOLLOW_UPS) if rng.random() < TWO_TURN_SHARE else None,
            )
        )
    return slots


class Writer:
    """Decodes batches with an engine (chat_data/engines.py) and appends their rows to the output files."""

    def __init__(self, engine, out_dir: Path, args):
        self.engine, self.tokenizer, self.out_dir, self.args = engine, engine.tokenizer, out_dir, args
        self.tokens = 0  # answer tokens written by this run
        self.on_batch = None  # called with self.tokens after each batch is written

    def user_prefix(self) -> str:
        """The chat template up to where a user turn's text starts (with its default system turn, if any)."""
        marker = "\x00MAGPIE\x00"
        rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
        return rendered.split(marker)[0]

    def prompt_ids(self, conversation: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def run(self, prompts: list[list[int]], temperature: float | None, max_new_tokens: int, seed: int):
        """The engine's batches as (prompt indices, [(text, tokens, truncated)])."""
        for group, decoded in self.engine.run(prompts, temperature, max_new_tokens, seed):
            texts = [self.tokenizer.decode(tokens, skip_special_tokens=True).strip() for tokens, _ in decoded]
            yield group, [(text, len(tokens), cut) for text, (tokens, cut) in zip(texts, decoded, strict=True)]

    def append(self, name: str, rows: list[dict]) -> None:
        with (self.out_dir / name).open("a") as handle:  # closed per batch: a killed run loses the batch in flight
            handle.writelines(json.dumps(row) + "\n" for row in rows)
        if self.on_batch is not None:
            self.on_batch(self.tokens)

    def magpie(self, slots: list[Instruction], seen: set[str]) -> list[dict]:
        """The target's own user turns for Magpie slots, sampled at T=1 (kept: ended, three words or more, not in
        `seen`, the turns written before); the rows written."""
        prefix = self.tokenizer(self.user_prefix(), add_special_tokens=False).input_ids
        seed = self.args.seed * 7919 + slots[0].index
        written = []
        for group, done in self.run([prefix] * len(slots), 1.0, MAGPIE_MAX_TOKENS, seed):
            rows = []
            for k, (text, _, truncated) in zip(group, done, strict=True):
                kept = not truncated and len(text.split()) >= 3 and text not in seen  # ended, a sentence, new
                rows.append({"index": slots[k].index, "text": text if kept else None})
                seen.add(text)
            self.append("magpie.jsonl", rows)
            written += rows
        return written

    def answer(self, slots: list[Instruction], two_turn: dict[int, list[dict]] | None = None) -> list[dict]:
        """First answers (or, with `two_turn`, second answers to the conversations it holds per index); the rows
        written."""
        written = []
        for sampled in (False, True):
            group = [s for s in slots if s.sampled == sampled]
            conversations = [two_turn[s.index] if two_turn else [{"role": "user", "content": s.text}] for s in group]
            prompts = [self.prompt_ids(c) for c in conversations]
            fits = [k for k, p in enumerate(prompts) if len(p) <= self.args.max_prompt_tokens]
            skipped = [s for k, s in enumerate(group) if k not in set(fits)]
            if skipped:
                rows = [{**asdict(s), "turns": 0, "skipped": "prompt too long"} for s in skipped]
                self.append("rows.jsonl", rows)
                written += rows
            if not fits:
                continue
            temperature = TEMPERATURE if sampled else None
            seed = self.args.seed * 7919 + group[0].index + (1 << 20 if two_turn else 0)
            for batch, done in self.run([prompts[k] for k in fits], temperature, self.args.max_new_tokens, seed):
                rows = []
                for k, (text, tokens, truncated) in zip((fits[b] for b in batch), done, strict=True):
                    rows.append(
                        {
                            **asdict(group[k]),
                            "turns": len(conversations[k]) // 2 + 1,
                            "prompt_tokens": len(prompts[k]),
                            "answer_tokens": tokens,
                            "truncated": truncated,
                            "dtype": self.engine.dtype,
                            "engine": self.engine.name,
                            "messages": conversations[k] + [{"role": "assistant", "content": text}],
                        }
                    )
                    self.tokens += tokens
                self.append("rows.jsonl", rows)
                written += rows
        return written


def generate(args) -> None:
    out_dir = Path(args.out_dir)
    if args.resume_from and card.restore_raw(Path(args.resume_from), out_dir):
        print(f"continuing the run packed in {args.resume_from}")
    elif args.resume_from:
        print(f"{out_dir} already holds the run packed in {args.resume_from}: continuing from the rows in {out_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    # what decides the instructions and their answers; the target's form (its name, or a folder for vLLM), the
    # engine and the dtype may change between sessions and machines (each row records its engine and dtype)
    settings = {k: getattr(args, k) for k in ("count", "seed", "max_new_tokens", "max_prompt_tokens")}
    # the wheel by project and version (its test data is the same in every platform's wheel); None: not a prose
    # run, so that a prose run resumed without --prose_wheel (or the reverse) is refused
    settings["prose_wheel"] = "-".join(Path(args.prose_wheel).name.split("-")[:2]) if args.prose_wheel else None
    settings_path = out_dir / "settings.json"
    if settings_path.exists():
        before = json.loads(settings_path.read_text())
        if {k: before.get(k) for k in settings} != settings:
            raise SystemExit(
                f"{out_dir} holds a run with other settings ({json.dumps(before)}); "
                "use another --out_dir or the same settings"
            )
    else:
        settings_path.write_text(json.dumps({"target": args.target, **settings}) + "\n")
    slots = build_instructions(args.count, args.seed, kinds.Prose(args.prose_wheel) if args.prose_wheel else None)
    magpie = {row["index"]: row["text"] for row in card.read_jsonl(out_dir / "magpie.jsonl", repair=True)}
    rows = card.read_jsonl(out_dir / "rows.jsonl", repair=True)
    first = {row["index"]: row for row in rows if row["turns"] in (0, 1)}
    second = {row["index"] for row in rows if row["turns"] == 2}
    dropped = {index for index, text in magpie.items() if text is None}  # Magpie turns that did not end

    def needs_second(s: Instruction) -> bool:  # a follow-up to an answer that ended within its cap
        row = first.get(s.index, {})
        return bool(s.follow_up) and row.get("turns") == 1 and not row["truncated"] and s.index not in second

    pending = [s for s in slots if s.index not in dropped and (s.index not in first or needs_second(s))]
    print(f"{len(slots)} instruction slots; {len(first)} answered before, {len(pending)} with work left")
    if not pending:
        return
    if args.engine == "vllm":
        max_len = args.max_prompt_tokens + args.max_new_tokens
        # a session's engine seed from where it starts, so that a resumed run does not replay an earlier stream
        engine = VllmEngine(args.target, args.dtype, args.num_threads, max_len, args.seed * 7919 + pending[0].index)
    else:
        engine = TransformersEngine(
            args.target, args.dtype, args.num_threads, args.batch_size, args.token_budget, args.device
        )
    writer = Writer(engine, out_dir, args)
    start = time.monotonic()
    progress = tqdm(total=len(pending), unit="instr")
    writer.on_batch = lambda tokens: progress.set_postfix(
        tokens=tokens, tok_s=f"{tokens / (time.monotonic() - start):.0f}"
    )
    for begin in range(0, len(pending), args.window):
        window = pending[begin : begin + args.window]
        need = [s for s in window if s.kind == "magpie" and s.index not in magpie]
        if need:
            magpie |= {row["index"]: row["text"] for row in writer.magpie(need, set(magpie.values()))}
        for s in window:
            if s.kind == "magpie":
                s.text = magpie.get(s.index)  # None: dropped, or lost with a torn line (the next run writes it)
        unanswered = [s for s in window if s.index not in first and s.text is not None]
        first |= {r["index"]: r for r in writer.answer(unanswered) if r["turns"] == 1}
        conversations = {
            s.index: first[s.index]["messages"] + [{"role": "user", "content": s.follow_up}]
            for s in window
            if needs_second(s)
        }
        writer.answer([s for s in window if s.index in conversations], conversations)
        second |= set(conversations)
        progress.update(len(window))
        elapsed = time.monotonic() - start
        if args.time_limit is not None and elapsed > 60 * args.time_limit:
            print(f"time limit of {args.time_limit} min reached: run the same command again to continue")
            break
    progress.close()
    print(f"{writer.tokens} answer tokens in {time.monotonic() - start:.0f} s")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default="runs/smollm2-chat", help="where magpie.jsonl and rows.jsonl grow")
    parser.add_argument("--pack", default=None, help="write the compressed data and its card to this folder")
    parser.add_argument(
        "--resume_from", default=None, help="a --pack folder: an empty --out_dir starts from the run packed there"
    )
    parser.add_argument("--target", default=TARGET, help="known target name or model folder")
    parser.add_argument("--count", type=positive, default=NUM_INSTRUCTIONS, help="instruction slots to build")
    parser.add_argument("--seed", type=int, default=0, help="instructions, their order, decoding mode, sampling")
    parser.add_argument(
        "--prose_wheel",
        help=f"instructions over news and encyclopedia articles instead, from {kinds.material.PROSE_WHEEL}'s wheel "
        f"(pip download --no-deps {kinds.material.PROSE_WHEEL}): a run and data folder of their own",
    )
    parser.add_argument("--window", type=positive, default=WINDOW)
    parser.add_argument("--batch_size", type=positive, default=BATCH_SIZE)
    parser.add_argument("--token_budget", type=positive, default=TOKEN_BUDGET)
    parser.add_argument("--max_new_tokens", type=positive, default=MAX_NEW_TOKENS)
    parser.add_argument("--max_prompt_tokens", type=positive, default=MAX_PROMPT_TOKENS)
    parser.add_argument(
        "--device", default="auto", help="the transformers engine's device; auto: cuda where a GPU is visible, else cpu"
    )
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 where the device has native bf16, else float32")
    parser.add_argument(
        "--engine",
        choices=["transformers", "vllm"],
        default="transformers",
        help="vllm: vLLM's offline engine in its own environment, on a model folder (--target)",
    )
    parser.add_argument("--num_threads", type=positive, default=NUM_THREADS)
    parser.add_argument("--time_limit", type=float, default=None, help="minutes; stop after the window that passes it")
    args = parser.parse_args(argv)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype == "auto":
        from selfspec.hardware import native_bf16

        args.dtype = "bfloat16" if native_bf16(args.device)[0] else "float32"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.pack:
        card.pack(Path(args.out_dir), Path(args.pack))
    else:
        generate(args)


if __name__ == "__main__":
    main()
