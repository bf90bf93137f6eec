"""Self-distillation chat data for an instruct target: instructions built offline, answered by the target itself.

    python training/make_chat_data.py --out_dir runs/smollm2-chat [--target smollm2-135m-instruct] \
        [--limit 1200] [--seed 0] [--time_limit 15]

The instructions come from material on this machine, never from a benchmark: docstrings of Python's standard
library turned into coding, explanation, summarisation, translation and reading-comprehension requests,
math word problems made from random numbers, and writing / question prompts from small word lists below.
The target answers each (chat template, left-padded batches, `model.generate`), half greedily and half
sampled at temperature 0.7; each answer is cut at the first end-of-text token. Rows go to
`train.jsonl` and, for every 10th instruction, `heldout.jsonl`, as chat `messages` (user, assistant) that
`data.messages_field` in a training config reads. A batch is appended when it is done, so a stopped run
(Ctrl-C, `--time_limit`) continues where it was by running the same command again.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

# ---- defaults (each overridable on the command line) ----
TARGET = "smollm2-135m-instruct"  # a known target name (selfspec/targets.py) or a model folder
NUM_INSTRUCTIONS = 1300  # instructions built; --limit answers only the first N of them (in shuffled order)
BATCH_SIZE = 32  # prompts per generate call (left-padded)
MAX_NEW_TOKENS = 160  # answer length cap; longer answers are cut and marked truncated
TEMPERATURE = 0.7  # for the sampled half
HELDOUT_EVERY = 10  # instruction i with i % 10 == 9 goes to heldout.jsonl
NUM_THREADS = 2  # the machine is shared

# stdlib modules whose docstrings become instructions (importable everywhere, documented in English)
MODULES = (
    "abc argparse array ast base64 bisect calendar cmath codecs collections colorsys configparser contextlib copy "
    "csv dataclasses datetime decimal difflib dis email enum filecmp fnmatch fractions ftplib functools getopt "
    "gettext glob gzip hashlib heapq hmac html http.client imaplib inspect io ipaddress itertools json keyword "
    "linecache locale logging lzma mailbox math mimetypes numbers operator optparse os os.path pathlib pickle "
    "pkgutil platform plistlib poplib pprint queue quopri random re reprlib sched secrets selectors shelve shlex "
    "shutil smtplib socket sqlite3 statistics string struct subprocess tarfile tempfile textwrap threading "
    "timeit tokenize traceback types typing unicodedata unittest urllib.parse urllib.request uuid warnings "
    "wave weakref xml.dom.minidom xml.etree.ElementTree zipfile zlib"
).split()
LANGUAGES = ("French", "French", "German", "Spanish", "Italian", "Portuguese")
WRITING_FORMS = (
    "a short story",
    "a poem",
    "a haiku",
    "a formal email",
    "a friendly letter",
    "a product description",
    "a blog post introduction",
    "a limerick",
    "a persuasive paragraph",
    "a short speech",
    "a diary entry",
    "a news headline and lead paragraph",
    "a dialogue between two friends",
    "a motivational message",
)
TOPICS = (
    "a rainy afternoon in a small town",
    "learning to ride a bicycle",
    "the first day at a new job",
    "a lost cat",
    "the ocean at night",
    "a robot who wants to paint",
    "recycling at home",
    "a trip to the mountains",
    "the importance of sleep",
    "a library that never closes",
    "friendship",
    "autumn leaves",
    "a busy kitchen",
    "space exploration",
    "a garden in spring",
    "a village festival",
    "saving money",
    "learning a new language",
    "a broken umbrella",
    "the history of bread",
    "a city without cars",
    "an old lighthouse",
    "climate change",
    "a chess tournament",
    "working from home",
    "a time traveller's mistake",
    "healthy breakfast ideas",
    "a volunteer day at the park",
    "a thunderstorm",
    "the joy of reading",
)
ADVICE = (
    "staying focused while studying",
    "preparing for a job interview",
    "keeping a plant alive",
    "running a first 5k",
    "writing clean Python code",
    "saving energy at home",
    "making new friends in a new city",
    "planning a trip on a budget",
    "learning to cook",
    "getting better sleep",
    "giving a good presentation",
    "reducing stress",
    "organising a small team",
    "debugging a program",
    "writing a clear email",
    "starting a vegetable garden",
)
QUESTIONS = (
    "Why is the sky blue?",
    "How do vaccines work?",
    "What causes the seasons on Earth?",
    "How does a rainbow form?",
    "What is photosynthesis?",
    "Why do we have leap years?",
    "How does the internet send data?",
    "What is inflation?",
    "How do airplanes stay in the air?",
    "What is the difference between weather and climate?",
    "How does a compiler differ from an interpreter?",
    "What is a black hole?",
    "Why does ice float on water?",
    "How do bees make honey?",
    "What is machine learning?",
    "What causes earthquakes?",
    "How does the heart pump blood?",
    "What is the water cycle?",
    "Why do leaves change colour in autumn?",
    "What is DNA?",
    "How do solar panels produce electricity?",
    "What is a prime number?",
    "Why is exercise good for health?",
    "How does a refrigerator keep food cold?",
    "What is the greenhouse effect?",
    "What is an algorithm?",
    "How do tides work?",
    "What is the difference between a virus and a bacterium?",
    "What is recursion?",
    "Why do cats purr?",
    "What does a database index do?",
    "How does GPS find your location?",
)
NAMES = ("Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Lena", "Maya", "Omar")
ITEMS = ("apples", "pencils", "books", "stickers", "cookies", "marbles", "tickets", "notebooks", "oranges", "cards")


@dataclass
class Instruction:
    """One request to the target, with its place in the output."""

    index: int  # position in the seeded, shuffled list; the resume key
    kind: str  # code, explain, summarize, translate, reading, math, question, writing, advice
    text: str
    sampled: bool  # sampled at TEMPERATURE, else greedy
    heldout: bool


def documented_objects() -> list[tuple[str, str, str]]:
    """(module, qualified name, docstring) of the public functions, classes and modules in MODULES."""
    found = []
    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a module missing from this Python build
            continue
        if inspect.getdoc(module):
            found.append((module_name, module_name, inspect.getdoc(module)))
        for name, member in inspect.getmembers(module):
            if name.startswith("_") or getattr(member, "__module__", None) != module.__name__:
                continue
            if (inspect.isfunction(member) or inspect.isclass(member)) and inspect.getdoc(member):
                found.append((module_name, f"{module_name}.{name}", inspect.getdoc(member)))
    return found


def first_sentence(doc: str) -> str:
    """The docstring's first sentence, on one line."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    return re.split(r"(?<=[.!?])\s", paragraph, maxsplit=1)[0]


def paragraphs(doc: str, min_chars: int = 200, max_chars: int = 900) -> list[str]:
    """The docstring's prose paragraphs of `min_chars` or more (code examples left out), cut to `max_chars`."""
    result = []
    for block in doc.split("\n\n"):
        text = " ".join(block.split())
        if len(text) >= min_chars and ">>>" not in text and text.count("(") < 6:
            result.append(text[:max_chars].rsplit(" ", 1)[0] if len(text) > max_chars else text)
    return result


def plain_sentences(doc: str) -> list[str]:
    """Sentences of prose (40-180 characters, few code symbols) fit for a translation request."""
    text = " ".join(doc.split())
    sentences = re.split(r"(?<=[.!?])\s", text)
    return [s for s in sentences if 40 <= len(s) <= 180 and not re.search(r"[`_=(){}\[\]<>*/\\]|\.\w", s)]


def code_request(rng: random.Random, qualname: str, doc: str) -> str:
    """A request to implement something that a docstring describes."""
    name, summary = qualname.rsplit(".", 1)[-1], first_sentence(doc)
    return rng.choice(
        (
            f"Write a Python function named `{name}` that does the following: {summary}",
            f"Implement this in Python, with a short explanation: {summary}",
            f"Write a small Python program that uses `{qualname}` and explain what it prints.",
            f"Write a Python function for this description, with a docstring and an example call: {summary}",
        )
    )


def explain_request(rng: random.Random, qualname: str, doc: str) -> str:
    """A request to explain a documented object."""
    return rng.choice(
        (
            f"Explain what `{qualname}` does in Python.",
            f"What is `{qualname}` used for? Give a short example.",
            f"Explain to a beginner how to use `{qualname}`.",
            f"Describe the purpose of `{qualname}` in two or three sentences.",
        )
    )


def math_problem(rng: random.Random) -> str:
    """A short arithmetic word problem with random numbers."""
    name, other, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(3, 60), rng.randint(2, 12), rng.randint(2, 9)
    price, hours, speed = rng.randint(2, 25), rng.randint(2, 9), rng.randint(20, 90)
    problem = rng.choice(
        (
            f"{name} has {a} {item}. {other} gives {name} {b} boxes with {c} {item} in each. How many {item} does "
            f"{name} have now?",
            f"A shop sells {item} for ${price} each. {name} buys {b} of them and pays with a ${price * b + a} bill. "
            "How much change does "
            f"{name} get?",
            f"A train travels at {speed} km per hour for {hours} hours. How far does it go?",
            f"{name} reads {b} pages every day. How many days does {name} need to finish a book of {b * a} pages?",
            f"{name} and {other} share {a * c} {item} so that {name} gets {c - 1} times as many as {other}. How many "
            f"does each get?",
            f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?",
            f"{name} saves ${price} a week. How many weeks until {name} has ${price * a}?",
            f"There are {a} students in a class and {b} of them are absent. The rest sit in rows of {c}. How many full "
            "rows are there?",
        )
    )
    return rng.choice(("", "Solve step by step: ", "Answer the math question: ")) + problem


def build_instructions(count: int, seed: int) -> list[Instruction]:
    """`count` varied instructions in a seeded shuffled order (see the module docstring for the sources)."""
    rng = random.Random(seed)
    objects = documented_objects()
    long_texts = [(q, p) for _, q, doc in objects for p in paragraphs(doc)]
    sentences = sorted({s for _, _, doc in objects for s in plain_sentences(doc)})
    makers = {
        "code": lambda: code_request(rng, *rng.choice(objects)[1:]),
        "explain": lambda: explain_request(rng, *rng.choice(objects)[1:]),
        "summarize": lambda: (
            rng.choice(("Summarize this text", "Summarize in two sentences", "Give a one-line summary of this text"))
            + ":\n\n"
            + rng.choice(long_texts)[1]
        ),
        "translate": lambda: f"Translate to {rng.choice(LANGUAGES)}: {rng.choice(sentences)}",
        "reading": lambda: reading_request(rng, long_texts),
        "math": lambda: math_problem(rng),
        "question": lambda: rng.choice(("", "Answer the question: ", "Answer briefly: ")) + rng.choice(QUESTIONS),
        "writing": lambda: f"Write {rng.choice(WRITING_FORMS)} about {rng.choice(TOPICS)}.",
        "advice": lambda: f"Give {rng.choice(('three', 'five', 'a few'))} tips for {rng.choice(ADVICE)}.",
    }
    texts: dict[str, str] = {}  # text -> kind; duplicates dropped
    while len(texts) < count:
        kind = rng.choice(list(makers))
        texts.setdefault(makers[kind](), kind)
    items = list(texts.items())
    rng.shuffle(items)
    return [
        Instruction(i, kind, text, sampled=rng.random() < 0.5, heldout=i % HELDOUT_EVERY == HELDOUT_EVERY - 1)
        for i, (text, kind) in enumerate(items)
    ]


def reading_request(rng: random.Random, long_texts: list[tuple[str, str]]) -> str:
    """A question about a passage that answers it (retrieval-style)."""
    qualname, passage = rng.choice(long_texts)
    question = rng.choice(
        (f"What does `{qualname}` do?", "What is the main point of the passage?", "List the key facts in the passage.")
    )
    return f"Read the passage and answer the question.\n\nPassage: {passage}\n\nQuestion: {question}"


def done_indices(paths: list[Path]) -> set[int]:
    """Instruction indices already answered in the output files (the resume point)."""
    done = set()
    for path in paths:
        if path.exists():
            with path.open() as lines:
                done.update(json.loads(line)["index"] for line in lines if line.strip())
    return done


def batches(pending: list[Instruction], tokenizer, batch_size: int, window: int = 8) -> list[list[Instruction]]:
    """Batches of one decoding mode each, greedy and sampled alternating, in instruction order by windows of
    `window` batches; inside a window sorted by prompt length (less left padding)."""
    result = []
    for start in range(0, len(pending), batch_size * window):
        chunk = pending[start : start + batch_size * window]
        modes = [
            sorted((i for i in chunk if i.sampled == sampled), key=lambda i: len(tokenizer(i.text).input_ids))
            for sampled in (False, True)
        ]
        split = [[group[k : k + batch_size] for k in range(0, len(group), batch_size)] for group in modes]
        for k in range(max(map(len, split))):
            result += [batches_of_mode[k] for batches_of_mode in split if k < len(batches_of_mode)]
    return result


@torch.inference_mode()
def answer(model, tokenizer, batch: list[Instruction], max_new_tokens: int, seed: int) -> list[tuple[str, int, bool]]:
    """(answer text, answer tokens, truncated) per instruction, from one left-padded `generate` call."""
    prompts = [tokenizer.apply_chat_template([user_turn(i)], tokenize=False, add_generation_prompt=True) for i in batch]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    sampled = batch[0].sampled
    torch.manual_seed(seed + batch[0].index)  # a batch's samples do not depend on what ran before it
    output = model.generate(
        **inputs,
        max_new_tokens=max_new_tokens,
        do_sample=sampled,
        temperature=TEMPERATURE if sampled else None,
        top_p=None,
        top_k=None,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    new = output[:, inputs.input_ids.shape[1] :]  # [batch, generated]
    results = []
    for row in new.tolist():
        end = row.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in row else len(row)
        results.append((tokenizer.decode(row[:end], skip_special_tokens=True).strip(), end, end == len(row)))
    return results


def user_turn(instruction: Instruction) -> dict:
    """The instruction as a chat message."""
    return {"role": "user", "content": instruction.text}


def write_rows(out_dir: Path, batch: list[Instruction], answers: list[tuple[str, int, bool]]) -> int:
    """Append the batch to train.jsonl / heldout.jsonl; the number of answer tokens written."""
    files = {False: (out_dir / "train.jsonl").open("a"), True: (out_dir / "heldout.jsonl").open("a")}
    for instruction, (text, tokens, truncated) in zip(batch, answers, strict=True):
        row = {
            **asdict(instruction),
            "answer_tokens": tokens,
            "truncated": truncated,
            "messages": [user_turn(instruction), {"role": "assistant", "content": text}],
        }
        files[instruction.heldout].write(json.dumps(row) + "\n")
    for handle in files.values():
        handle.close()  # flushed per batch: a killed run loses at most the batch in flight
    return sum(tokens for _, tokens, _ in answers)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default="runs/smollm2-chat", help="where train.jsonl and heldout.jsonl go")
    parser.add_argument("--target", default=TARGET, help="known target name or model folder")
    parser.add_argument("--count", type=int, default=NUM_INSTRUCTIONS, help="instructions to build")
    parser.add_argument("--limit", type=int, default=None, help="answer only the first N instructions")
    parser.add_argument("--seed", type=int, default=0, help="instruction choice, order, decoding mode, sampling")
    parser.add_argument("--batch_size", type=int, default=BATCH_SIZE)
    parser.add_argument("--max_new_tokens", type=int, default=MAX_NEW_TOKENS)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num_threads", type=int, default=NUM_THREADS)
    parser.add_argument("--time_limit", type=float, default=None, help="minutes; stop after the batch that passes it")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from selfspec.targets import load_model

    torch.set_num_threads(args.num_threads)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    instructions = build_instructions(args.count, args.seed)[: args.limit]
    done = done_indices([out_dir / "train.jsonl", out_dir / "heldout.jsonl"])
    pending = [i for i in instructions if i.index not in done]
    print(f"{len(instructions)} instructions, {len(done)} answered before, {len(pending)} to answer")
    if not pending:
        return
    model, tokenizer = load_model(args.target, dtype=args.dtype)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    start, tokens = time.monotonic(), 0
    progress = tqdm(total=len(pending), unit="instr")
    for batch in batches(pending, tokenizer, args.batch_size):
        tokens += write_rows(out_dir, batch, answer(model, tokenizer, batch, args.max_new_tokens, args.seed))
        progress.update(len(batch))
        progress.set_postfix(tokens=tokens, tok_s=f"{tokens / (time.monotonic() - start):.0f}")
        if args.time_limit is not None and time.monotonic() - start > 60 * args.time_limit:
            print(f"time limit of {args.time_limit} min reached: run the same command again to continue")
            break
    progress.close()
    print(f"{tokens} answer tokens in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
