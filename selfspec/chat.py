"""Chat conversations through a tokenizer's chat template: where the assistant's turns lie in the rendered text
(`answer_spans`, what training learns), and those turns as the token ids the model generates for them
(`chat_answers`, what a `SuffixDrafter` can remember before its first call)."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path


def open_text(path: str | os.PathLike, errors: str = "strict"):
    """A text file, or a gzip-compressed one by its `.gz` name, open for reading as UTF-8 (`errors` as `open`'s:
    "replace" puts U+FFFD for bad bytes)."""
    if str(path).lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors=errors)
    return open(path, encoding="utf-8", errors=errors)


def answer_spans(tokenizer, messages: list[dict], text: str) -> list[list[int]]:
    """The character spans of the assistant turns in the rendered conversation `text`: from the end of the
    conversation before the turn (with the generation prompt) to the end of the conversation up to it."""
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError(
                "the chat template does not render a conversation's turns as prefixes of it, so its answers cannot "
                "be told apart from its prompts"
            )
        spans.append([len(before), len(through)])
    return spans


def conversation_answers(tokenizer, messages: list[dict]) -> list[list[int]]:
    """Each assistant turn of one conversation as the token ids the model generates for it: the turn's tokens in
    the rendered conversation, up to and including the first end-of-sequence token (what follows it, such as a
    template's newline, is the template's, not the model's)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    eos = tokenizer.eos_token_id
    answers = []
    for start, end in answer_spans(tokenizer, messages, text):
        ids = [t for t, (a, _) in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True) if start <= a < end]
        if eos in ids:
            ids = ids[: ids.index(eos) + 1]
        if ids:
            answers.append(ids)
    return answers


def chat_answers(path: str | os.PathLike, tokenizer, max_tokens: int | None = None) -> list[list[int]]:
    """The assistant turns of a chat data set (a .jsonl file, or .jsonl.gz, whose rows have `messages`) as the
    token ids the model generates for them (`conversation_answers`), in file order, up to and including the row
    whose answers reach `max_tokens` (None: all rows). Raises ValueError naming the row for a row that is not
    JSON, has no `messages` or cannot be rendered, and for a tokenizer without a chat template or offsets."""
    path = Path(path)
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r} must be a positive number of tokens (None: all)")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{path}: reading chat answers needs a tokenizer with a chat template")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{path}: reading chat answers needs a fast tokenizer (its offsets place the answers)")
    answers, total = [], 0
    with open_text(path) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as error:
                raise ValueError(f"{path}: row {number} is not JSON ({error})") from None
            messages = row.get("messages") if isinstance(row, dict) else None
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise ValueError(f"{path}: row {number} has no chat `messages` (a list of role / content turns)")
            try:
                answers_here = conversation_answers(tokenizer, messages)
            except Exception as error:  # the template's own errors (jinja2's) included: name the row
                raise ValueError(f"{path}: row {number}: {error}") from error
            for ids in answers_here:
                answers.append(ids)
                total += len(ids)
            if max_tokens is not None and total >= max_tokens:
                break
    if not answers:
        raise ValueError(f"{path} holds no assistant turns")
    return answers
