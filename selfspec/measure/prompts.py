"""The prompts of a benchmark: a .json list or a .jsonl file of strings (`load_prompts`), or Spec-Bench questions
for `selfspec bench --prompts question.jsonl` (`read_prompts` tells them apart).

Spec-Bench (Xia et al., ACL Findings 2024) is a JSONL file of questions: `question_id`, `category` and
`turns` (the user's messages). A prompt is the first turn rendered with the tokenizer's chat template,
ending in the assistant's generation prompt; a tokenizer without a chat template (a base model, such as the
demo target) is refused, since a bare question is not what an instruct model is benchmarked on. Each prompt
remembers its category: results are reported per category (`selfspec.measure.bench.summarize_by_category`), with the
eight MT-bench categories grouped as one (`mt_bench`), and overall.
"""

from __future__ import annotations

import json
from pathlib import Path

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")  # Spec-Bench's order
OVERALL = "overall"


class ChatPrompt(str):
    """A prompt rendered with the chat template (its special tokens are in the text: encode it without
    adding more), which remembers the Spec-Bench category it is reported under."""

    category: str

    def __new__(cls, text: str, category: str) -> ChatPrompt:
        prompt = super().__new__(cls, text)
        prompt.category = category
        return prompt


def report_category(category: str) -> str:
    """The category a Spec-Bench question is reported under: `mt_bench` for MT-bench's eight, else its own."""
    return "mt_bench" if category in MT_BENCH else category


def read_questions(path: str | Path) -> list[dict] | None:
    """The rows of a Spec-Bench file (a .jsonl whose rows have `turns`, or a `category` and no `prompt` or `text`),
    or None for another prompts file."""
    path = Path(path)
    if path.suffix != ".jsonl":
        return None
    if path.is_dir():
        raise ValueError(f"{path} is a folder: pass the prompts file itself (.json or .jsonl)")
    try:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON lines: {error}") from None
    first = rows[0] if rows and isinstance(rows[0], dict) else {}
    if "turns" not in first and ("category" not in first or "prompt" in first or "text" in first):
        return None
    for number, row in enumerate(rows, 1):
        turns = row.get("turns") if isinstance(row, dict) else None
        problem = (
            "is not a JSON object" if not isinstance(row, dict)
            else "has no `turns` field" if turns is None
            else "has no `category`" if not row.get("category")
            else None if isinstance(turns, list) and turns and isinstance(turns[0], str)
            else "has `turns` that are not a non-empty list of strings"
        )  # fmt: skip
        if problem:
            raise ValueError(f"{path}: row {number} is not a Spec-Bench question: it {problem} (a `category` and a "
                             "list of `turns`)")  # fmt: skip
    return rows


def chat_prompts(rows: list[dict], tokenizer, source: str = "Spec-Bench") -> list[ChatPrompt]:
    """Each question's first turn through the tokenizer's chat template, with the generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{source}: Spec-Bench questions are rendered with the tokenizer's chat template, and this tokenizer "
            "has none (a base model?). Benchmark an instruct model, or pass prompts as a .json list of strings."
        )
    prompts = []
    for row in rows:
        messages = [{"role": "user", "content": row["turns"][0]}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(ChatPrompt(text, report_category(row["category"])))
    return prompts


def load_prompts(path: str | Path) -> list[str]:
    """Prompts from a .json list (strings, or objects with a `prompt` or `text` field) or a .jsonl file."""
    path = Path(path)
    if path.suffix not in (".json", ".jsonl"):
        raise ValueError(f"{path}: prompts must be a .json list or a .jsonl file, one prompt per line")
    if path.is_dir():
        raise ValueError(f"{path} is a folder: pass the prompts file itself (.json or .jsonl)")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".json":
            items = json.loads(text) if text.strip() else []
        else:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON{'' if path.suffix == '.json' else ' lines'}: {error}") from None
    if not isinstance(items, list):
        raise ValueError(f"{path}: a .json prompts file holds a list, got a JSON {type(items).__name__}")
    prompts = []
    for number, item in enumerate(items, 1):
        prompt = item
        if isinstance(item, dict):
            prompt = item.get("prompt") or item.get("text")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}: item {number} has no prompt (a string, or a `prompt` or `text` field)")
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def read_prompts(path: str | Path, tokenizer) -> list[str]:
    """The prompts of a file: Spec-Bench questions as `ChatPrompt`s, else `load_prompts`'s strings."""
    rows = read_questions(path)
    return chat_prompts(rows, tokenizer, str(path)) if rows is not None else load_prompts(path)


def first_per_category(prompts: list[str], limit: int) -> list[str]:
    """The first `limit` prompts of each reported category, in file order (Spec-Bench prompts only)."""
    if not all(isinstance(prompt, ChatPrompt) for prompt in prompts):
        raise ValueError("a limit per category needs Spec-Bench prompts (a .jsonl of category and turns)")
    kept, counts = [], {}
    for prompt in prompts:
        counts[prompt.category] = counts.get(prompt.category, 0) + 1
        if counts[prompt.category] <= limit:
            kept.append(prompt)
    return kept


def categories_of(prompts: list[str]) -> list[str] | None:
    """The reported categories present, in Spec-Bench's order; None unless every prompt has one."""
    if not prompts or not all(isinstance(prompt, ChatPrompt) for prompt in prompts):
        return None
    present = {prompt.category for prompt in prompts}
    return [c for c in CATEGORIES if c in present] + sorted(present - set(CATEGORIES))
