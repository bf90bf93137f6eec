"""Greedy output compared with `model.generate` in half precision: identical, or left it at a tie.

A verify pass over several positions multiplies other matrix shapes than a one-position step, so in
bfloat16 or float16 its logits round differently. Where the reference's two best processed scores are
equal in the model's dtype, or a few rounding steps apart, its argmax can go either way, and a speculative
decoder (transformers' own included) may continue with the other token. selfspec's property in half
precision: the output equals `model.generate`'s up to the first position where the reference's top
scores are within `TIE_STEPS` rounding steps of each other, and there it takes one of those tokens;
`compare_greedy` says which case an output is. In float32 runs are identical.

How far rounding moves the top-2 gap, in rounding steps of the dtype: one pass over a whole greedy answer
against `generate`'s one-token steps (a coarser change of shapes than a verify pass over a few positions).
SmolLM2-135M-Instruct in bfloat16, 48 new tokens after the first Spec-Bench development prompt of each
category, 288 positions (`python -m selfspec.measure.ties --prompts specbench_dev.jsonl`): median 1.0, 90th
percentile 1.5, 99th percentile 5.2, largest 109. TIE_STEPS = 4 covers about 98% of positions; a divergence
at a wider gap is reported as a mismatch, even though rounding can reach it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

TIE = "tie"  # the verdict for a divergence at a tie of the reference's top-2 scores
TIE_STEPS = 4  # rounding steps of the model's dtype within which two scores count as tied (see above)


def first_divergence(reference: torch.Tensor, output: torch.Tensor) -> int | None:
    """The first index where two [1, T] id sequences differ (or where the shorter ends), None if equal."""
    if torch.equal(reference, output):
        return None
    width = min(reference.shape[1], output.shape[1])
    differs = (reference[0, :width] != output[0, :width]).nonzero()
    return int(differs[0, 0]) if len(differs) else width


def rounding_step(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s representable numbers at `value` (one ulp)."""
    if value == 0:
        return torch.finfo(dtype).tiny
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(abs(value)))


@torch.no_grad()
def greedy_with_scores(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int):
    """`model.generate`'s greedy output for `prompt` [1, n], with the processed scores of every new token."""
    return model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )


def reference_scores(model: nn.Module, prompt: torch.Tensor, new_index: int) -> torch.Tensor:
    """The processed scores [V] behind the `new_index`-th new token of a greedy `model.generate` of `prompt` [1, n]."""
    return greedy_with_scores(model, prompt, new_index + 1).scores[new_index][0].float()


def compare_greedy(model: nn.Module, prompt: torch.Tensor, reference: torch.Tensor, output: torch.Tensor):
    """True when `output` equals the reference greedy output; `TIE` when it first leaves it (half precision
    only) with another token whose reference score is within `TIE_STEPS` rounding steps of the model's
    dtype of the best; else False. Sequences are [1, prompt + new]."""
    index = first_divergence(reference, output)
    if index is None:
        return True
    if model.dtype == torch.float32 or index < prompt.shape[1] or index >= min(reference.shape[1], output.shape[1]):
        return False
    scores = reference_scores(model, prompt, index - prompt.shape[1])
    best = float(scores.max())
    near = scores >= best - TIE_STEPS * rounding_step(best, model.dtype)  # [V]: the top scores, up to rounding
    return TIE if int(near.sum()) >= 2 and bool(near[output[0, index]]) else False


@torch.no_grad()
def gap_shifts(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int) -> list[float]:
    """How far one pass over a whole greedy answer moves the top-2 gap of each new position against
    `generate`'s one-token steps, in rounding steps of the model's dtype (prompt [1, n])."""
    out = greedy_with_scores(model, prompt, max_new_tokens)
    multi = model(out.sequences).logits[0, prompt.shape[1] - 1 : -1].float()  # [new, V]
    shifts = []
    for position, scores in enumerate(out.scores):
        single = scores[0].float()
        first, second = single.topk(2).indices.tolist()
        change = (multi[position, first] - multi[position, second]) - (single[first] - single[second])
        shifts.append(abs(float(change)) / rounding_step(float(single[first]), model.dtype))
    return shifts


def main(argv: list[str] | None = None) -> None:
    """`python -m selfspec.measure.ties --model NAME --prompts FILE`: the rounding figures quoted above."""
    import argparse

    from ..targets import load_model
    from .prompts import first_per_category, read_prompts

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a known target or a model folder")
    parser.add_argument("--prompts", required=True, help="a Spec-Bench .jsonl (the first prompt of each category)")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 or float16")
    parser.add_argument("--max_new_tokens", type=int, default=48, help="greedy tokens per prompt")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    shifts = []
    for text in first_per_category(read_prompts(args.prompts, tokenizer), 1):
        ids = tokenizer(str(text), return_tensors="pt", add_special_tokens=False).input_ids
        shifts += gap_shifts(model, ids, args.max_new_tokens)
    values = torch.tensor(shifts)
    quantiles = [float(values.quantile(q)) for q in (0.5, 0.9, 0.99)]
    print(
        f"{len(shifts)} positions; top-2 gap moved by (rounding steps): median {quantiles[0]:.1f}, "
        f"90th percentile {quantiles[1]:.1f}, 99th percentile {quantiles[2]:.1f}, largest {float(values.max()):.1f}"
    )


if __name__ == "__main__":
    main()
