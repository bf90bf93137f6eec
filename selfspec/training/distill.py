"""Self-distillation of draft heads on a frozen target: the losses, and the held-out alpha and top-1 agreement that
predict their speedup with c (timed by `selfspec.measure.costs`).

p is the frozen target's own next-token distribution at a position (temperature 1, raw logits), q a
draft's distribution for the same token (docs/design.md, "The math"):

- loss: KL(p || q) = sum_x p(x) log(p(x) / q(x)), or the soft cross-entropy -sum_x p(x) log q(x) (the same
  gradient in q; KL is 0 for a perfect draft). Both push q towards p everywhere, and so raise alpha.
- alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q): the chance that the accept-reject rule keeps a draft.
- top-1 agreement: argmax q == argmax p, the greedy acceptance.
- expected tokens per iteration E = 1 + a_1 + a_1 a_2 + ... (= (1 - alpha^(gamma+1)) / (1 - alpha) for a
  constant alpha) and the speedup S(gamma) = E / (v(gamma) + gamma c), c = t_draft / t_step and
  v(gamma) = t_verify(gamma+1 positions) / t_step (1 unless measured): `selfspec.engine.adaptive`.

Drafts: each kind of heads says what its drafts read and which target position teaches them
(`DraftHeads.distillation_drafts`, a list of `selfspec.heads.base.Draft`). An exit head k reads the pre-norm
hidden state after layer k (`hidden_states[k]`) and predicts the next token, so its teacher is the target's
distribution at the same position. Medusa head i (0-based) reads the normed final hidden state at position t
and predicts the token at t+2+i, so its teacher is the target's distribution at position t+1+i.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..adapter import DraftVocabulary, ModelAdapter
from ..heads.base import Draft, DraftHeads

# ------------------------------------------------------------------------------------------ the math

LOSSES = ("kl", "soft_ce", "tv")
TV_WEIGHT = 0.9  # the tv loss: 0.9 TV(p, q) + 0.1 KL(p || q) (DFlash2's mix of an acceptance loss and a likelihood)


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position: `[..., V]` logits -> `[...]`, in float32."""
    log_p = torch.log_softmax(p_logits.float(), dim=-1)
    log_q = torch.log_softmax(q_logits.float(), dim=-1)
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)  # 0 log 0 = 0 where p has no mass


def soft_cross_entropy(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """-sum_x p(x) log q(x) per position: `[..., V]` logits -> `[...]`, in float32."""
    p = torch.softmax(p_logits.float(), dim=-1)
    return -torch.where(p > 0, p * torch.log_softmax(q_logits.float(), dim=-1), 0.0).sum(-1)


def acceptance_rate(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """alpha = sum_x min(p(x), q(x)) per position: `[..., V]` logits -> `[...]`, in float32."""
    return torch.minimum(torch.softmax(p_logits.float(), dim=-1), torch.softmax(q_logits.float(), dim=-1)).sum(-1)


def top1_agreement(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """1.0 where argmax q == argmax p, else 0.0: `[..., V]` logits -> `[...]`."""
    return (p_logits.argmax(-1) == q_logits.argmax(-1)).float()


# --------------------------------------------------------------------------------------- the drafts


@torch.no_grad()
def target_pass(model: nn.Module, input_ids: torch.Tensor, adapter: ModelAdapter | None = None, vocab=None):
    """One forward of the frozen target: (hidden states, one per layer boundary, the last normed; logits).
    With a compact draft `vocab` (`DraftVocabulary.compacted`) and the model's `adapter`, the logits are
    over its tokens only, from their LM-head rows: the rest of the LM head is never computed."""
    # with the model's default use_cache (True): GPT-2's hidden states without a cache differ by ~1e-8 from
    # the cached path that generation (and `run_lower`) takes
    if vocab is None:
        out = model(input_ids=input_ids, output_hidden_states=True)
        return out.hidden_states, out.logits
    if not vocab.compact or adapter is None:
        raise ValueError("target_pass over a draft vocabulary needs the model's adapter and a compacted vocabulary")
    hidden_states = target_states(model, input_ids)
    return hidden_states, adapter.lm_logits(hidden_states[-1], vocab=vocab)


@torch.no_grad()
def target_states(model: nn.Module, input_ids: torch.Tensor):
    """One forward of the frozen target, its hidden states only (one per layer boundary, the last normed): the
    LM head runs on the last position alone."""
    return model(input_ids=input_ids, output_hidden_states=True, logits_to_keep=1).hidden_states


class DistillationObjective(nn.Module):
    """The trainable heads and their loss against the frozen target (whose modules are not registered here,
    so DDP and the optimizer see the heads only). forward(hidden_states, logits, mask) -> mean loss per draft
    over the positions that `mask` marks (all without one).

    With a draft `vocab` (`DraftVocabulary`), q and p are both distributions over its tokens: q from their
    LM-head rows, p the target's logits restricted to them and renormalised (EAGLE-3's reduced vocabulary).
    The loss then costs a sixth of the full vocabulary's for SmolLM2's 8,192 of 49,152 tokens, and it
    trains what drafting with the same vocabulary proposes. With `teacher_temperature` T, p is the target's
    distribution at T (softmax of its logits / T): below 1 it leans toward the target's argmax."""

    def __init__(self, heads: DraftHeads, adapter: ModelAdapter, loss: str = "kl", recompute_logits: bool = False,
                 vocab: DraftVocabulary | None = None, teacher_temperature: float = 1.0):  # fmt: skip
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")
        if not teacher_temperature > 0:
            raise ValueError(f"teacher_temperature must be positive, got {teacher_temperature}")
        self.teacher_temperature = teacher_temperature
        self.heads = heads
        self._adapter = adapter  # a plain object: the target's norm and LM head stay outside this module
        self.loss = loss
        self.recompute_logits = recompute_logits
        self.vocab = vocab.compacted() if vocab is not None and vocab.rows is not None else None  # None: all tokens

    def _cross_entropy(self, draft: Draft, hidden: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        # -sum_x p log q per position; the draft's logits come from an LM head (over the draft vocabulary's
        # rows when there is one), so they are finite on every token that p covers. tv: 0.9 TV(p, q) + 0.1 of it,
        # TV = 1 - alpha is what acceptance pays for, the cross-entropy keeps a gradient where q misses p entirely
        log_q = torch.log_softmax(draft.head(hidden).float(), dim=-1)
        cross_entropy = -(p * log_q).sum(-1)
        if self.loss != "tv":
            return cross_entropy
        return TV_WEIGHT * 0.5 * (p - log_q.exp()).abs().sum(-1) + (1 - TV_WEIGHT) * cross_entropy

    def forward(self, hidden_states, logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """`logits`: the target's, over the whole vocabulary or (`target_pass` with `self.vocab`) over the draft
        vocabulary's tokens."""
        with torch.no_grad():  # the teacher once per batch, shared by every draft
            if self.vocab is not None and logits.shape[-1] != len(self.vocab.ids):
                logits = logits.index_select(-1, self.vocab.ids)
            log_p = torch.log_softmax(logits.float() / self.teacher_temperature, dim=-1)
            p = log_p.exp()  # [batch, T, V]
            # sum_x p log p: KL(p || q) = cross-entropy - entropy of p; 0 for the soft cross-entropy
            negative_entropy = torch.where(p > 0, p * log_p, 0.0).sum(-1) if self.loss != "soft_ce" else None
            if self.loss == "tv":  # only the cross-entropy's share carries the entropy offset
                negative_entropy = (1 - TV_WEIGHT) * negative_entropy
            weights = torch.ones(logits.shape[:2], device=logits.device) if mask is None else mask.float()
        losses = []
        for draft in self.heads.distillation_drafts(self._adapter, hidden_states, self.vocab, mask):
            weight, hidden, teacher = draft.teacher(weights), draft.hidden, draft.teacher(p)
            entropy = draft.teacher(negative_entropy) if negative_entropy is not None else None
            if mask is not None:
                # the LM head and the loss only where the mask asks (answers: 30-45% of a chat row): a left-out
                # position adds 0 to the loss and nothing to the gradient either way, nor to the weights' sum
                kept = weight > 0
                hidden, teacher, weight = hidden[kept], teacher[kept], weight[kept]
                entropy = entropy[kept] if entropy is not None else None
            if self.recompute_logits:  # keep one draft's [positions, V] activations at a time, not all of them
                loss = checkpoint(self._cross_entropy, draft, hidden, teacher, use_reentrant=False)
            else:
                loss = self._cross_entropy(draft, hidden, teacher)
            if entropy is not None:
                loss = loss + entropy
            losses.append(draft.weight * (loss * weight).sum() / weight.sum().clamp(min=1))
        return torch.stack(losses)


@torch.no_grad()
def score_sums(
    heads: DraftHeads,
    adapter: ModelAdapter,
    hidden_states,
    logits: torch.Tensor,
    vocab: DraftVocabulary | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per draft, sums over the positions `mask` marks (all without one) of (KL(p || q), alpha, top-1
    agreement, 1, chain): `[num_drafts, 5]` float64. With a reduced `vocab`, alpha and top-1 are those of its
    drafts against the whole p (what verification sees), and KL is between p and q both renormalised over
    its tokens (what training minimises; over the whole vocabulary it would be infinite). `chain` is the
    top-1 agreement of this draft and of every draft before it at the same anchor, the greedy acceptance of a
    chain this deep (meaningful where the drafts form a chain: Medusa and EAGLE heads, whose draft j at index
    t is anchored at t)."""
    log_p = torch.log_softmax(logits.float(), dim=-1)  # [batch, T, V], shared by every draft
    p, top = log_p.exp(), logits.argmax(-1)
    ids = vocab.rows if vocab is not None else None  # None: KL over the whole vocabulary
    log_p_kl = log_p
    if ids is not None:  # q is zero off the vocabulary's tokens: every sum runs over them alone, [..., N] not [..., V]
        vocab, p = vocab.compacted(), p.index_select(-1, ids)
        log_p_kl = torch.log_softmax(logits.index_select(-1, ids).float(), dim=-1)
    weights = torch.ones(logits.shape[:2], device=logits.device) if mask is None else mask.double()
    rows, chain = [], None
    for draft in heads.distillation_drafts(adapter, hidden_states, vocab, mask):
        q_logits = draft.head(draft.hidden)  # [..., N] over the vocabulary's tokens, in its (sorted) order
        log_q = torch.log_softmax(q_logits.float(), dim=-1)
        teacher_log_p = draft.teacher(log_p_kl)
        p_kl = teacher_log_p.exp()
        kl = torch.where(p_kl > 0, p_kl * (teacher_log_p - log_q), 0.0).sum(-1)  # [batch, positions]
        alpha = torch.minimum(draft.teacher(p), log_q.exp()).sum(-1)
        guess = q_logits.argmax(-1)  # the first of equal maxima: the smallest token id, as over [..., V]
        agree = ((ids[guess] if ids is not None else guess) == draft.teacher(top)).double()
        weight = draft.teacher(weights).double()
        chain = agree if chain is None else chain[:, : agree.shape[1]] * agree
        kl = torch.where(weight > 0, kl.double() * weight, 0.0)  # not inf * 0 where a position is left out
        sums = [kl.sum(), (alpha.double() * weight).sum(), (agree * weight).sum(), weight.sum()]
        rows.append(torch.stack(sums + [(chain * weight).sum()]))
    return torch.stack(rows)


def state_digest(module: nn.Module) -> str:
    """SHA-256 of every parameter and buffer (names, dtypes, shapes, bytes): equal iff bitwise equal."""
    digest = hashlib.sha256()
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{data.dtype}:{tuple(data.shape)}".encode())
        # flat first: a 0-dim tensor (Gemma 3's embed_scale buffer) cannot be viewed as bytes
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()
