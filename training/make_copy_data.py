"""Copy tasks for a draft head: conversations whose answer repeats text from the prompt, so that the head learns to
copy (an induction circuit: find the earlier occurrence of the current token, read what came after it).

Why: an EAGLE head trained on chat answers alone learns to copy very slowly. Spec-Bench's translation, summaries
and retrieval answers copy long stretches of their prompts (names, German sentences, passages), and there the
SmolLM2 head is right less often than elsewhere (docs/benchmarks.md, "Copying"). A short stage of these tasks
forms the circuit; the chat data then keeps it.

Each conversation asks the target to repeat a text: "copy shuffled" takes 12-80 words drawn at random from the
source conversations (any order, so only copying predicts them), "copy passage" a contiguous span of 30-200 words
of a source prompt (manual pages, news, Wikipedia, program messages in 11 languages). With probability 0.3 a
second turn asks for it once more (words are joined by single spaces: layout and code indentation are not
copied). The answer is the text itself: training distils the target's distribution at
every answer position, and on this context the target copies, so no generation is needed. Seeded: the same
command writes the same bytes.

    python training/make_copy_data.py --out training/data/copy [--overwrite]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chat_data import card  # noqa: E402

from selfspec.chat import open_text  # noqa: E402

SOURCES = ("training/data/smollm2-chat/train.jsonl.gz", "training/data/smollm2-prose/train.jsonl.gz")
ASKS = (
    "Repeat the following text exactly:\n\n{}",
    "Copy this out word for word:\n\n{}",
    "Write this back to me unchanged.\n\n{}",
    "{}\n\nRepeat the text above exactly, with nothing added.",
)
AGAIN = ("Once more, please.", "Repeat it again.", "Write it out one more time.")
HELD_OUT_EVERY = 10  # every 10th conversation is held out


def source_texts(paths) -> list[str]:
    """The user turns of the source conversations (their passages, messages and questions), in file order."""
    texts = []
    for path in paths:
        with open_text(path) as file:
            rows = [json.loads(line) for line in file if line.strip()]
        for row in rows:
            texts += [m["content"] for m in row["messages"] if m["role"] == "user"]
    if not texts:
        raise SystemExit(f"no user turns in {', '.join(paths)}")
    return texts


def make_text(rng: random.Random, texts: list[str], words: list[str]) -> tuple[str, str]:
    """(kind, text): a shuffled draw of words, or a contiguous span of one source prompt."""
    if rng.random() < 0.5:
        return "copy shuffled", " ".join(rng.choice(words) for _ in range(rng.randint(12, 80)))
    for _ in range(100):
        parts = rng.choice(texts).split()
        if len(parts) >= 30:
            count = min(len(parts), rng.randint(30, 200))
            start = rng.randrange(len(parts) - count + 1)
            return "copy passage", " ".join(parts[start : start + count])
    raise SystemExit("the sources hold no prompt of 30 words or more")


def conversation(rng: random.Random, index: int, texts: list[str], words: list[str]) -> dict:
    kind, text = make_text(rng, texts, words)
    messages = [{"role": "user", "content": rng.choice(ASKS).format(text)}, {"role": "assistant", "content": text}]
    if rng.random() < 0.3:
        messages += [{"role": "user", "content": rng.choice(AGAIN)}, {"role": "assistant", "content": text}]
    return {"index": index, "kind": kind, "turns": len(messages) // 2, "words": len(text.split()),
            "messages": messages}  # fmt: skip


def write_card(out: Path, rows: list[dict], args: argparse.Namespace) -> None:
    counts = Counter(row["kind"] for row in rows)
    lines = [
        "# Copy tasks for draft heads",
        "",
        "Conversations whose answer repeats text from the prompt (made by `training/make_copy_data.py`; its",
        "docstring says why). The answers are the text itself, not generated: training distils the target's",
        "distribution at each answer position, and on this context the target copies.",
        "",
        "| kind | conversations | two-turn | median words |",
        "|---|---:|---:|---:|",
    ]
    for kind in sorted(counts):
        group = [row for row in rows if row["kind"] == kind]
        lines.append(f"| {kind} | {len(group)} | {sum(r['turns'] == 2 for r in group)} | "
                     f"{statistics.median(r['words'] for r in group):.0f} |")  # fmt: skip
    lines += [
        "",
        f"Sources: the user turns of {', '.join(f'`{s}`' for s in args.sources)}. Every {HELD_OUT_EVERY}th "
        "conversation is in `heldout.jsonl.gz`. Seed " + str(args.seed) + ".",
        "",
        "```bash",
        f"python training/make_copy_data.py --out {args.out} --count {args.count} --seed {args.seed}",
        "```",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


def check_out(out: Path, splits: dict[str, bytes], overwrite: bool) -> None:
    """Refuse to write into a folder that holds anything but these splits (`splits`: each file's uncompressed
    content) unless `overwrite`: what it holds would be lost (the default --out is the committed data, made from
    the sources as they were then). A folder that holds these splits (the same command again) is written again,
    with a message."""
    if out.exists() and not out.is_dir():
        raise SystemExit(f"make_copy_data.py: --out {out} is a file, where the splits go into a folder")
    if not out.exists() or not any(out.iterdir()) or overwrite:
        return
    other = [name for name, rows in splits.items() if not (out / name).is_file() or read_gzip(out / name) != rows]
    if other:
        raise SystemExit(
            f"make_copy_data.py: --out {out} is not empty and does not hold this run's rows in {', '.join(other)} "
            "(other --count, --seed or --sources, or the sources changed since): pass --overwrite to replace its "
            f"{', '.join(splits)} and README.md, or name a new folder"
        )
    print(f"{out} already holds these rows: writing them and the card again")


def read_gzip(path: Path) -> bytes | None:
    """A gzip file's content; None where it is not one."""
    try:
        return gzip.decompress(path.read_bytes())
    except (OSError, EOFError):
        return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="training/data/copy", help="folder for train/heldout.jsonl.gz and the card")
    parser.add_argument("--count", type=int, default=3000, help="conversations to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sources", type=lambda s: s.split(","), default=list(SOURCES),
                        help="comma-separated .jsonl.gz conversation files whose user turns give the text")  # fmt: skip
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the splits and card in --out where it holds other rows")  # fmt: skip
    args = parser.parse_args(argv)
    if args.count < HELD_OUT_EVERY:
        parser.error(f"--count must be at least {HELD_OUT_EVERY} (every {HELD_OUT_EVERY}th row is held out)")
    texts = source_texts(args.sources)
    words = sorted({word for text in texts for word in text.split() if len(word) < 30})
    rng = random.Random(args.seed)
    rows = [conversation(rng, index, texts, words) for index in range(args.count)]
    out = Path(args.out)
    is_held = [row["index"] % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 for row in rows]
    held = [row for row, flag in zip(rows, is_held, strict=True) if flag]
    train = [row for row, flag in zip(rows, is_held, strict=True) if not flag]
    check_out(
        out, {"train.jsonl.gz": card.jsonl_bytes(train), "heldout.jsonl.gz": card.jsonl_bytes(held)}, args.overwrite
    )
    out.mkdir(parents=True, exist_ok=True)
    card.write_gzip(out / "train.jsonl.gz", train)
    card.write_gzip(out / "heldout.jsonl.gz", held)
    write_card(out, rows, args)
    print(f"{len(rows) - len(held)} training and {len(held)} held-out conversations in {out}")


if __name__ == "__main__":
    main()
