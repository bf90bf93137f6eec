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
def target_pass(model: nn.Module, input_ids: torch.Tensor):
    """One forward of the frozen target: (hidden states, one per layer boundary, the last normed; logits)."""
    # with the model's default use_cache (True): GPT-2's hidden states without a cache differ by ~1e-8 from
    # the cached path that generation (and `run_lower`) takes
    out = model(input_ids=input_ids, output_hidden_states=True)
    return out.hidden_states, out.logits


class DistillationObjective(nn.Module):
    """The trainable heads and their loss against the frozen target (whose modules are not registered here,
    so DDP and the optimizer see the heads only). forward(hidden_states, logits) -> mean loss per draft."""

    def __init__(self, heads: DraftHeads, adapter: ModelAdapter, loss: str = "kl", recompute_logits: bool = False):
        super().__init__()
        if loss not in ("kl", "soft_ce"):
            raise ValueError(f"loss must be kl or soft_ce, got {loss!r}")
        self.heads = heads
        self._adapter = adapter  # a plain object: the target's norm and LM head stay outside this module
        self.loss = loss
        self.recompute_logits = recompute_logits

    @staticmethod
    def _cross_entropy(draft: Draft, hidden: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        # -sum_x p log q; the draft's logits come from an LM head, so they are finite and so is p * log q
        return -(p * torch.log_softmax(draft.head(hidden).float(), dim=-1)).sum(-1).mean()

    def forward(self, hidden_states, logits: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # the teacher once per batch, shared by every draft
            log_p = torch.log_softmax(logits.float(), dim=-1)
            p = log_p.exp()  # [batch, T, V]
            # sum_x p log p: KL(p || q) = cross-entropy - entropy of p; 0 for the soft cross-entropy
            negative_entropy = torch.where(p > 0, p * log_p, 0.0).sum(-1) if self.loss == "kl" else None
        losses = []
        for draft in self.heads.distillation_drafts(self._adapter, hidden_states):
            if self.recompute_logits:  # keep one draft's [batch, T, V] activations at a time, not all of them
                loss = checkpoint(self._cross_entropy, draft, draft.hidden, draft.teacher(p), use_reentrant=False)
            else:
                loss = self._cross_entropy(draft, draft.hidden, draft.teacher(p))
            if negative_entropy is not None:
                loss = loss + draft.teacher(negative_entropy).mean()
            losses.append(draft.weight * loss)
        return torch.stack(losses)


@torch.no_grad()
def score_sums(
    heads: DraftHeads, adapter: ModelAdapter, hidden_states, logits: torch.Tensor, vocab: DraftVocabulary | None = None
) -> torch.Tensor:
    """Per draft, sums over positions of (KL(p || q), alpha, top-1 agreement, 1): `[num_drafts, 4]` float64
    (KL is infinite where a reduced `vocab` gives q = 0 to a token p has)."""
    log_p = torch.log_softmax(logits.float(), dim=-1)  # [batch, T, V], shared by every draft
    p, top = log_p.exp(), logits.argmax(-1)
    rows = []
    for draft in heads.distillation_drafts(adapter, hidden_states, vocab):
        q_logits = draft.head(draft.hidden)
        log_q = torch.log_softmax(q_logits.float(), dim=-1)
        p_draft = draft.teacher(p)
        kl = torch.where(p_draft > 0, p_draft * (draft.teacher(log_p) - log_q), 0.0).sum(-1)  # [batch, positions]
        alpha = torch.minimum(p_draft, log_q.exp()).sum(-1)
        agree = q_logits.argmax(-1) == draft.teacher(top)
        count = torch.tensor(agree.numel(), dtype=torch.float64, device=agree.device)
        rows.append(torch.stack([kl.double().sum(), alpha.double().sum(), agree.double().sum(), count]))
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
