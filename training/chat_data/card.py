"""The packed data and its card: `train.jsonl.gz` and `heldout.jsonl.gz` (one conversation per instruction, the
two-turn version where there is one, in instruction order, gzip without a timestamp so that the same rows
give the same bytes), `lengths.png` (prompt and answer lengths) and `README.md` (sources, counts per kind,
settings, the command)."""

from __future__ import annotations

import gzip
import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path

KEEP = (
    "index",
    "kind",
    "sampled",
    "turns",
    "prompt_tokens",
    "answer_tokens",
    "truncated",
    "engine",
    "dtype",
    "messages",
)
SOURCES = {
    "writing": "word lists: forms x topics",
    "roleplay": "word lists: roles x situations",
    "reasoning": "puzzles with random names and numbers",
    "math": "word problems with random numbers",
    "coding": "task list; Python standard-library docstrings",
    "extraction": "manual pages (120-400 words)",
    "stem": "concept list x audiences",
    "humanities": "topic list x audiences",
    "translation": "gettext catalogues: program messages in 11 languages, into English",
    "summarization": "manual pages (300-850 words) and standard-library docs",
    "rag": "manual pages (250-750 words) with a question",
    "qa": "ISO 3166 country names; short factual questions",
    "magpie": "the target's own user turns, sampled at T=1 after its chat template's user prefix",
    "news summary": "ABC news stories (gensim's Lee corpus, 100-400 words) to summarise",
    "news questions": "ABC news stories with a question about them",
    "news writing": "a news report to write from a story's first sentence",
    "wiki summary": "English Wikipedia articles (gensim's shortened dump): passages of 300-800 words to summarise",
    "wiki rag": "Wikipedia passages of 200-700 words with a question",
    "wiki qa": "questions on Wikipedia article titles, without a passage",
}


def read_jsonl(path: Path, repair: bool = False) -> list[dict]:
    """The rows of a JSON-lines file (none if it is missing). A torn last line (a run killed, or still busy,
    while writing it) is left out; with `repair` it is also cut off the file, so that the next row appended
    starts a line of its own. Only the run that appends repairs: `--pack` may read while a run writes."""
    if not path.exists():
        return []
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        if repair:
            path.write_bytes(data)
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def read_rows(out_dir: Path) -> tuple[list[dict], dict]:
    """One conversation per answered instruction (the two-turn row where there is one), and the counts of
    skipped prompts and dropped Magpie turns."""
    best: dict[int, dict] = {}
    skipped = 0
    for row in read_jsonl(out_dir / "rows.jsonl"):
        if row["turns"] == 0:
            skipped += 1
        elif row["turns"] >= best.get(row["index"], {}).get("turns", 0):
            if row["turns"] == 2 and row["index"] in best:
                row["answer_tokens"] += best[row["index"]]["answer_tokens"]  # both answers count
            best[row["index"]] = row
    magpie = read_jsonl(out_dir / "magpie.jsonl")
    counts = {"skipped_long": skipped, "magpie_dropped": sum(m["text"] is None for m in magpie)}
    return [best[i] for i in sorted(best)], counts


def jsonl_bytes(rows: list[dict]) -> bytes:
    """The rows' `KEEP` fields as JSON lines: what `write_gzip` compresses."""
    return "".join(
        json.dumps({k: row[k] for k in KEEP if k in row}, ensure_ascii=False) + "\n" for row in rows
    ).encode()


def write_gzip(path: Path, rows: list[dict]) -> None:
    write_bytes_gzip(path, jsonl_bytes(rows))


def plot_lengths(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for axis, field, title in zip(axes, ("prompt_tokens", "answer_tokens"), ("prompt", "answer(s)"), strict=True):
        axis.hist([row[field] for row in rows], bins=40, color="#4477aa")
        axis.set_xlabel(f"{title} tokens")
        axis.set_ylabel("conversations")
    figure.suptitle(f"{len(rows)} conversations: prompt and answer lengths in the target's tokens")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def table(rows: list[dict]) -> list[str]:
    """Markdown rows: per kind, conversations, two-turn ones, answer tokens, median prompt / answer, truncated."""
    by_kind = defaultdict(list)
    for row in rows:
        by_kind[row["kind"]].append(row)
    lines = [
        "| kind | source | conversations | two-turn | answer tokens | median prompt | median answer | cut at cap |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kind in sorted(by_kind, key=lambda k: -len(by_kind[k])) + ["all"]:
        group = rows if kind == "all" else by_kind[kind]
        prompt, answer = (statistics.median(r[field] for r in group) for field in ("prompt_tokens", "answer_tokens"))
        lines.append(
            f"| {kind} | {SOURCES.get(kind, '')} | {len(group)} | {sum(r['turns'] == 2 for r in group)} | "
            f"{sum(r['answer_tokens'] for r in group):,} | {prompt:.0f} | {answer:.0f} | "
            f"{sum(r['truncated'] for r in group) / len(group):.0%} |"
        )
    return lines


RAW = ("rows.jsonl", "magpie.jsonl", "settings.json")  # a run's own files, kept in `raw/` as its resume point


def save_raw(out_dir: Path, dest: Path) -> None:
    """The run's files, gzip-compressed without a timestamp, in `dest/raw`: `restore_raw` puts them back, so a
    run continues on another machine from what was packed (the run folder itself is not kept)."""
    (dest / "raw").mkdir(parents=True, exist_ok=True)
    for name in RAW:
        if (out_dir / name).exists():
            write_bytes_gzip(dest / "raw" / f"{name}.gz", (out_dir / name).read_bytes())


def restore_raw(packed: Path, out_dir: Path) -> bool:
    """Put a packed run's files back into `out_dir`; False when `out_dir` already holds that run (its settings.json,
    which a run writes first and a restore last: files a killed restore left without it are restored again), which
    then goes on from its own files. One that holds another run (other settings, the target aside) is refused:
    --resume_from would be ignored."""
    packed_settings = read_packed_settings(packed)
    if packed_settings is None:
        raise SystemExit(f"--resume_from {packed}: no packed run there (raw/settings.json.gz)")
    if (out_dir / "settings.json").exists():
        there = json.loads((out_dir / "settings.json").read_text())
        differ = settings_differences(packed_settings, there, ("in the pack", "in --out_dir"))
        if differ:
            raise SystemExit(
                f"--resume_from {packed}: --out_dir {out_dir} already holds another run ({differ}), which it would "
                "continue instead; name an empty --out_dir to start from the pack"
            )
        return False
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in RAW:  # settings.json last
        if (packed / "raw" / f"{name}.gz").exists():
            staged = out_dir / f"{name}.restoring"
            staged.write_bytes(gzip.decompress((packed / "raw" / f"{name}.gz").read_bytes()))
            staged.replace(out_dir / name)
    return True


def write_bytes_gzip(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as handle:
        handle.write(data)
    tmp.replace(path)


PACKED = ("train.jsonl.gz", "heldout.jsonl.gz", "README.md", "lengths.png", "raw")  # what `pack` writes in dest


def check_destination(dest: Path, settings: dict) -> None:
    """Refuse to pack over another run's data: `dest` may be new, hold none of `PACKED`, or hold a pack of a run
    with these `settings` (the target aside, as a resumed run may name it anew). Its `raw/` is that run's resume
    point and its splits may be committed data: replacing them would lose them."""
    packed = read_packed_settings(dest)
    if packed is not None:
        differ = settings_differences(packed, settings)
        if differ:
            raise SystemExit(f"--pack {dest} holds the data of another run ({differ}); pack into a new folder")
    elif any((dest / name).exists() for name in PACKED):
        raise SystemExit(
            f"--pack {dest} holds data that no run packed (no raw/settings.json.gz); pack into a new folder"
        )


def read_packed_settings(folder: Path) -> dict | None:
    """The settings of the run packed in `folder` (its raw/settings.json.gz); None where no run is packed there."""
    path = folder / "raw" / "settings.json.gz"
    return json.loads(gzip.decompress(path.read_bytes())) if path.exists() else None


def settings_differences(there: dict, here: dict, names: tuple[str, str] = ("there", "here")) -> str:
    """The settings in which two runs differ ("seed 1 there, 0 here, ..." with `names`; the target aside, as a
    resumed run may name it anew); empty where none does."""
    keys = sorted((there.keys() | here.keys()) - {"target"})
    differ = [key for key in keys if there.get(key) != here.get(key)]
    return ", ".join(f"{key} {there.get(key)!r} {names[0]}, {here.get(key)!r} {names[1]}" for key in differ)


def pack(out_dir: Path, dest: Path) -> None:
    """Compressed splits, histogram and card for the rows generated so far in `out_dir`, and the run's own files
    (`save_raw`) to continue it from; into a new folder or one that holds an earlier pack of the same run."""
    rows, counts = read_rows(out_dir)
    if not rows:
        raise SystemExit(f"{out_dir}/rows.jsonl holds no answered instruction yet")
    settings = json.loads((out_dir / "settings.json").read_text())
    check_destination(dest, settings)
    dest.mkdir(parents=True, exist_ok=True)
    save_raw(out_dir, dest)
    train, heldout = [r for r in rows if not r["heldout"]], [r for r in rows if r["heldout"]]
    write_gzip(dest / "train.jsonl.gz", train)
    write_gzip(dest / "heldout.jsonl.gz", heldout)
    plot_lengths(rows, dest / "lengths.png")
    decoders = Counter(f"{r.get('engine', 'transformers')} in {r.get('dtype', '?')}" for r in rows)
    engines = ", ".join(f"{count:,} by {decoder}" for decoder, count in sorted(decoders.items()))
    total = sum(r["answer_tokens"] for r in rows)
    wheel = settings.get("prose_wheel")
    if wheel:
        sources = (
            f"the instructions are built from the news stories and encyclopedia articles in `{wheel}` (its test "
            "data, no benchmark's: `pip download --no-deps gensim==4.4.0`) by `training/chat_data/kinds.py`"
        )
        options = f" --prose_wheel runs/wheels/{wheel}-*.whl"
    else:
        sources = (
            "the instructions come from material on a Debian machine with Python (manual pages, gettext catalogues, "
            "standard-library docstrings, the ISO country list), word lists and random numbers in "
            "`training/chat_data/kinds.py`, and the target's own user turns (Magpie)"
        )
        options = ""
    card = [
        f"# Chat data for `{settings['target']}`: its own answers to {len(rows):,} instructions",
        "",
        f"{total:,} answer tokens ({sum(r['answer_tokens'] for r in train):,} in `train.jsonl.gz`, "
        f"{sum(r['answer_tokens'] for r in heldout):,} in `heldout.jsonl.gz`, every 10th instruction), "
        f"{len(rows):,} conversations of which {sum(r['turns'] == 2 for r in rows):,} have two turns. Each row holds "
        "chat `messages` (`data.messages_field` in a training config), the instruction's `kind`, whether it was "
        "`sampled` (T=0.7) or greedy, and the prompt and answer lengths in the target's tokens.",
        "",
        f"No benchmark prompt is among them: {sources}. The target answered every one itself ({engines}), "
        "greedily or at T=0.7, at most "
        f"{settings['max_new_tokens']} new tokens per answer. A fifth of the instructions drew a follow-up turn, "
        f"answered where the first answer ended within its cap: {sum(r['turns'] == 2 for r in rows):,} "
        "conversations have two turns.",
        "",
        *table(rows),
        "",
        f"Left out: {counts['skipped_long']} prompts over {settings['max_prompt_tokens']} tokens, "
        f"{counts['magpie_dropped']} Magpie turns that did not end within their cap.",
        "",
        "![prompt and answer lengths](lengths.png)",
        "",
        "## How it was made",
        "",
        "```bash",
        *(["pip download --no-deps gensim==4.4.0 -d runs/wheels   # the material, read from the zip"] if wheel else []),
        "# the target as a model folder for vLLM, then answers with vLLM's offline engine in its own environment",
        f"selfspec export --format hf --model {settings['target']} --dtype bfloat16 --output runs/target-hf",
        "OMP_NUM_THREADS=1 .venv-vllm/bin/python training/make_chat_data.py --engine vllm --target runs/target-hf "
        f"--out_dir runs/chat --count {settings['count']} --seed {settings['seed']}{options} --window 512 "
        f"--resume_from {dest}",
        f"# or with transformers: python training/make_chat_data.py --out_dir runs/chat --count {settings['count']} "
        f"--seed {settings['seed']}{options} --resume_from {dest}",
        f"python training/make_chat_data.py --out_dir runs/chat --pack {dest}   # these files",
        "```",
        "",
        "Each command resumes where the run stopped; the rows record which engine answered them.",
        "",
        "Why it is kept here, compressed: answering costs hours of a CPU thread, and the material (manual pages and "
        "catalogues) depends on the packages a machine has, so the same seed rebuilds the same instructions only "
        "where the same packages are installed. `raw/` holds the run's own files: `--resume_from` this folder "
        "continues the run on another machine, and `--pack` rewrites these files.",
    ]
    (dest / "README.md").write_text("\n".join(card) + "\n")
    print(f"{len(rows)} conversations, {total} answer tokens -> {dest}")
