"""Model-free drafters replayed on recorded greedy answers: their tokens per pass, without the model.

Greedy output is fixed by the prompt, and a drafter that reads no weights (n-gram lookup, suffix drafting) sees only
tokens. So the passes a decoding with it takes can be counted offline: record each prompt's greedy answer once
(`record_answers`), then let the drafter draft along it (`replay`), accepting each draft up to its first token that
differs from the answer. At a fixed gamma this counts exactly the passes of `SelfSpeculative(model, drafter=...,
num_draft_tokens=gamma, adaptive=False)` in float32 (tested); a whole grid of settings replays in seconds, on no
particular machine. What it leaves out is the cost of a pass, which `selfspec bench` measures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.drafter import Drafter


@dataclass
class Recorded:
    """One prompt's token ids, its greedy answer (as `model.generate` returns the new tokens) and its category."""

    prompt: list[int]
    answer: list[int]
    category: str | None = None


@torch.no_grad()
def record_answers(model, prompts: list[torch.Tensor], max_new_tokens: int, categories=None) -> list[Recorded]:
    """Each [1, n] prompt's greedy answer from `model.generate`, cut after its first end-of-sequence token."""
    eos = model.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    records = []
    for index, prompt in enumerate(prompts):
        mask = torch.ones_like(prompt)
        output = model.generate(prompt, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
        answer = output[0, prompt.shape[1] :].tolist()
        end = next((i for i, token in enumerate(answer) if token in stops), None)
        category = categories[index] if categories is not None else getattr(prompt, "category", None)
        records.append(Recorded(prompt[0].tolist(), answer[: end + 1] if end is not None else answer, category))
    return records


class OneRow:
    """What a model-free drafter reads of the decoding state (`DecodeState`'s sequences, pad_offset and length):
    one row of tokens, no padding."""

    def __init__(self, tokens: list[int]):
        self.sequences = torch.tensor([tokens])
        self.pad_offset = torch.zeros(1, dtype=torch.long)

    @property
    def length(self) -> int:
        return self.sequences.shape[1]


def replay(drafter: Drafter, records: list[Recorded], max_new_tokens: int, gamma: int | None = None) -> dict:
    """Decode every record's answer in order with `drafter` at a fixed `gamma` (default: the drafter's own,
    `default_drafts`; at most its `max_drafts`), calls in sequence, so a memory across calls fills as in a run:
    {"tokens", "passes", "drafted", "tokens_per_pass", "drafted_per_pass", "by_category": {category: tokens per
    pass}}. Passes count the prefill, as `GenerationStats` does."""
    if drafter.hidden_layers or drafter.tree is not None or drafter.estimated_cost() > 0:
        raise ValueError(f"replay needs a model-free chain drafter (n-gram, suffix); {drafter.name} reads the model "
                         "or drafts trees")  # fmt: skip
    gamma = min(gamma if gamma is not None else drafter.default_drafts, drafter.max_drafts)
    totals = {"tokens": 0, "passes": 0, "drafted": 0}
    by_category: dict[str, list[int]] = {}
    for record in records:
        answer = record.answer[:max_new_tokens]
        drafter.begin(OneRow(record.prompt), None)  # as the loop does: the prompt, before the first token
        sequence = record.prompt + answer[:1]  # the prefill's pass gave the first token
        done, passes = 1, 1
        while done < len(answer):
            accepted, limit = 0, min(gamma, max_new_tokens - done - 1)
            if limit > 0 and drafter.available(text := OneRow(sequence)):
                proposal = drafter.draft(text, limit, None, False).tokens[0].tolist()
                totals["drafted"] += len(proposal)
                while accepted < len(proposal) and done + accepted < len(answer):
                    if proposal[accepted] != answer[done + accepted]:
                        break
                    accepted += 1
                drafter.accept(None)
            step = min(accepted + 1, len(answer) - done)
            sequence, done, passes = sequence + answer[done : done + step], done + step, passes + 1
        drafter.end([torch.tensor(sequence)])
        totals["tokens"] += len(answer)
        totals["passes"] += passes
        counts = by_category.setdefault(str(record.category), [0, 0])
        counts[0], counts[1] = counts[0] + len(answer), counts[1] + passes
    totals["tokens_per_pass"] = totals["tokens"] / max(totals["passes"], 1)
    totals["drafted_per_pass"] = totals["drafted"] / max(totals["passes"], 1)
    totals["by_category"] = {category: tokens / passes for category, (tokens, passes) in by_category.items()}
    return totals
