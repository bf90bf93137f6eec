"""A workload that repeats itself across calls, built offline: what people run through a model in a loop.

- **Same task, many inputs** (`same_task`): "add type hints to / write a docstring for / rename the variables of
  this function" over small functions of Python's own standard library (their source, read with `inspect`).
- **Revisions** (`revision`): a two-turn conversation whose second turn asks to revise the first answer (the
  target's own greedy answer, generated when the workload is built).

`selfspec bench --workload repeated` runs it: every contender first answers the first `warmup` prompts of each
task untimed (a drafter with a memory across calls, `SuffixDrafter`, learns from them), then the rest are timed
and reported per kind. Nothing here comes from a benchmark's prompts.
"""

from __future__ import annotations

import importlib
import inspect

from .prompts import ChatPrompt

TASKS = (
    "Add type hints to this Python function. Return the whole function.",
    "Write a docstring for this Python function. Return the whole function with its docstring.",
    "Rename the variables of this Python function to clearer names. Return the whole function.",
)
REVISION = "Now return the same function again, without any comments or docstring."
# small pure-Python functions of the standard library (module, name): the inputs the tasks repeat over
FUNCTIONS = (
    ("posixpath", "basename"),
    ("posixpath", "dirname"),
    ("textwrap", "indent"),
    ("string", "capwords"),
    ("shlex", "quote"),
    ("fnmatch", "filter"),
    ("colorsys", "rgb_to_hsv"),
    ("colorsys", "hsv_to_rgb"),
    ("glob", "has_magic"),
    ("html", "escape"),
    ("calendar", "isleap"),
    ("calendar", "leapdays"),
)
MAX_LINES = 40  # functions longer than this are left out (a prompt stays short)


def function_sources() -> list[str]:
    """The source of each of `FUNCTIONS` that this Python has in Python, at most MAX_LINES long, in order."""
    sources = []
    for module, name in FUNCTIONS:
        try:
            source = inspect.getsource(getattr(importlib.import_module(module), name))
        except (OSError, TypeError, AttributeError):  # written in C here, or gone
            continue
        if source.count("\n") <= MAX_LINES:
            sources.append(inspect.cleandoc(source) if source.startswith(" ") else source.rstrip() + "\n")
    return sources


def task_message(task: str, source: str) -> str:
    return f"{task}\n\n```python\n{source}```"


def same_task_prompts(tokenizer, warmup: int) -> tuple[list[ChatPrompt], list[ChatPrompt]]:
    """(warm-up prompts, timed prompts): each task over every function, the first `warmup` functions of each task
    for the warm-up."""
    sources = function_sources()
    if len(sources) <= warmup:
        raise ValueError(f"--warmup {warmup}: the workload has {len(sources)} functions per task; warm up on fewer")
    warm, timed = [], []
    for task in TASKS:
        for index, source in enumerate(sources):
            messages = [{"role": "user", "content": task_message(task, source)}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            (warm if index < warmup else timed).append(ChatPrompt(text, "same_task"))
    return warm, timed


def revision_prompts(tokenizer, answer, count: int) -> list[ChatPrompt]:
    """Two-turn conversations over the first `count` functions: the first task, the target's own answer to it
    (`answer(prompt_text) -> str`), then `REVISION`."""
    prompts = []
    for source in function_sources()[:count]:
        first = [{"role": "user", "content": task_message(TASKS[0], source)}]
        reply = answer(tokenizer.apply_chat_template(first, tokenize=False, add_generation_prompt=True))
        messages = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": REVISION}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(ChatPrompt(text, "revision"))
    return prompts


def repeated_contenders(model, eagle_heads=None, draft_vocab=None) -> list:
    """model.generate, transformers' prompt lookup, selfspec's plain loop (the unit of c and v), n-gram lookup, suffix
    drafting with its memory across calls, and its hybrid with an EAGLE head (where one is given), greedy."""
    from .contenders import generate_contender, selfspec_contender

    field_ = [generate_contender(model, "generate", False, 1.0),
              generate_contender(model, "transformers prompt lookup", False, 1.0, prompt_lookup_num_tokens=10),
              selfspec_contender(model, "selfspec plain loop", False, 1.0, num_draft_tokens=0),  # the unit of c
              selfspec_contender(model, "selfspec ngram", False, 1.0, drafter="ngram"),
              selfspec_contender(model, "selfspec suffix", False, 1.0, drafter="suffix")]  # fmt: skip
    if eagle_heads is not None:
        suffix = f", vocab {len(draft_vocab)}" if draft_vocab else ""
        hybrid = {"drafter": ["suffix", "heads"], "heads": eagle_heads, "draft_vocab": draft_vocab}
        field_.append(selfspec_contender(model, f"selfspec hybrid suffix + eagle{suffix}", False, 1.0, **hybrid))
    return field_


def warm_up(contenders: list, prompts: list, max_new_tokens: int) -> None:
    """Run the contenders whose drafters remember earlier calls on `prompts`, untimed (the others gain nothing)."""
    from tqdm.auto import tqdm

    learning = [c for c in contenders if c.spec is not None and any(hasattr(p, "cache") for p in c.spec.drafters)]
    for contender in tqdm(learning, desc="warm-up", leave=False):
        for prompt in prompts:
            contender.run(prompt, max_new_tokens)
