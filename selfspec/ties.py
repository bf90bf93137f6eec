"""Greedy output compared with `model.generate` in half precision: identical, or left it at a tie.

A verify pass over several positions multiplies other matrix shapes than a one-position step, so in
bfloat16 or float16 its logits round differently. Where the reference's two best processed scores are
equal in the model's dtype (or one rounding step apart), its argmax can go either way, and a speculative
decoder (transformers' own included) may continue with the other token. selfspec's property in half
precision: the output equals `model.generate`'s up to the first position where the reference's top-2
scores are within one rounding step; `compare_greedy` says which case an output is. In float32 runs are
identical.
"""

from __future__ import annotations

import math

import torch
from torch import nn

TIE = "tie"  # the verdict for a divergence at a tie of the reference's top-2 scores


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
def reference_scores(model: nn.Module, prompt: torch.Tensor, new_index: int, **generate_kwargs) -> torch.Tensor:
    """The processed scores [V] behind the `new_index`-th new token of a greedy `model.generate` of `prompt` [1, n]."""
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new_index + 1,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        **generate_kwargs,
    )
    return out.scores[new_index][0].float()


def compare_greedy(model: nn.Module, prompt: torch.Tensor, reference: torch.Tensor, output: torch.Tensor):
    """True when `output` equals the reference greedy output; `TIE` when it first leaves it (half precision
    only) with a token whose reference score is within one rounding step of the model's dtype of the best,
    while another token is too; else False. Sequences are [1, prompt + new]."""
    index = first_divergence(reference, output)
    if index is None:
        return True
    if model.dtype == torch.float32 or index < prompt.shape[1] or index >= min(reference.shape[1], output.shape[1]):
        return False
    scores = reference_scores(model, prompt, index - prompt.shape[1])
    best = float(scores.max())
    near = scores >= best - rounding_step(best, model.dtype)  # [V]: the reference's top scores, up to rounding
    return TIE if int(near.sum()) >= 2 and bool(near[output[0, index]]) else False
