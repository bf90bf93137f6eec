"""Does a draft head copy? Two measures of EAGLE, Medusa or exit heads on a target, teacher-forced (`score_sums`):

1. **Repeats**: a text repeated three times; the heads' top-1 agreement with the target on the third copy, beside
   how often the target itself copies there. Once as a sentence, and as random tokens of the draft vocabulary
   (only copying predicts those) 40, 16 and 24 long: a head that reads a fixed distance back instead of matching
   the token scores on one length only.
2. **Recorded answers** (`--prompts`): each prompt's greedy answer from `model.generate` (recorded once into
   `--records`, JSON), and the heads' top-1 at draft 1 over its tokens, split into those a copy predicts (the
   token continues an earlier occurrence of the two tokens before it, in the prompt or the answer so far: a
   continuation n-gram lookup could draft) and the rest, and over all of them, per category, beside how often the
   latest such continuation is the token (what two-token lookup drafts, right) and how many of the tokens the
   draft vocabulary holds (a draft outside it is never proposed), alone and joined by the call's own tokens before
   each one (the prompt's and the answer's so far, as `SelfSpeculative(draft_vocab_context=True)` drafts).
3. **Sampling** (`--temperature T`, with recorded answers): on the same positions, what the first draft would be
   accepted with when the target samples at T: the head's best guess as a point mass (p_T of it), its three best
   guesses as siblings, and its five (the sum of p_T over them: the multi-candidate rule's acceptance, what a tree of
   the three or five best first guesses takes at its first level), and one draw from the head's q at T (sum of
   min(p_T, q_T)).
   Contexts are the greedy answers', not sampled ones.

`--data` reads the answers from a chat data set instead (`training/make_chat_data.py`'s packed rows): the first
turn of the first `--per_kind` greedy rows of each kind, cut to `--max_new_tokens`, the kind as the category. The
same measures on the target's answers to the instructions the heads learnt from (their held-out split) tell a gap
of distribution from one of the measure: the trainer's held-out figures cover every answer position of packed
2,048-token rows, sampled answers too.

    python training/probe_copying.py --heads heads/smollm2-135m-instruct/eagle-head \\
        --prompts specbench_dev.jsonl --limit_per_category 4 --records runs/copy_records.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from selfspec.adapter import ModelAdapter
from selfspec.chat import conversation_answers, open_text
from selfspec.cli.options import encode
from selfspec.heads import load_heads
from selfspec.measure.prompts import first_per_category, read_prompts
from selfspec.measure.replay import record_answers
from selfspec.targets import load_model
from selfspec.training.data import copy_pool
from selfspec.training.distill import score_sums, target_pass

SENTENCE = "The farmer sells apples, pears and plums at the market in the old town square every Sunday morning."


def copyable(tokens: list[int]) -> list[bool]:
    """Per index m (the position whose next token is m + 1, as a loss mask's): does tokens[m + 1] continue an
    earlier occurrence of (tokens[m - 1], tokens[m])?"""
    seen, flags = defaultdict(set), [False]
    for m in range(1, len(tokens) - 1):
        pair = tokens[m - 1], tokens[m]
        flags.append(tokens[m + 1] in seen[pair])
        seen[pair].add(tokens[m + 1])
    return flags + [False]


def lookup_right(tokens: list[int]) -> list[bool]:
    """Per index m, as `copyable`: is tokens[m + 1] what followed the latest earlier occurrence of (tokens[m - 1],
    tokens[m])? (what two-token n-gram lookup drafts there)"""
    latest, flags = {}, [False]
    for m in range(1, len(tokens) - 1):
        pair = tokens[m - 1], tokens[m]
        flags.append(latest.get(pair) == tokens[m + 1])
        latest[pair] = tokens[m + 1]
    return flags + [False]


def top1_sums(heads, adapter, hidden_states, logits, masks: list[torch.Tensor], vocab) -> list[torch.Tensor]:
    """Per mask, [drafts, 2]: the top-1 agreements over the positions it marks, and their count (one target pass's
    `hidden_states` and `logits`)."""
    return [score_sums(heads, adapter, hidden_states, logits, vocab, mask)[:, 2:4] for mask in masks]


def repeats(model, adapter, heads, tokenizer, vocab, seed: int = 0) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    # the draft vocabulary's tokens (no EOS in the text), as train.copy_rows draws them
    pool = copy_pool(model.config.vocab_size, tokenizer.all_special_ids, vocab.ids if vocab is not None else None)
    texts = {"sentence": tokenizer(SENTENCE, return_tensors="pt", add_special_tokens=False).input_ids[0]}
    for length in (40, 16, 24):  # 40 first: the same 40 tokens as when it was the only length
        texts[f"{length} random"] = pool[torch.randint(len(pool), (length,), generator=generator)]
    lines = []
    for name, part in texts.items():
        ids, n = part.repeat(3)[None], len(part)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[0, 2 * n - 1 : -1] = True  # the positions whose next token is in the third copy
        hidden_states, logits = target_pass(model, ids)
        target = (logits[0, 2 * n - 1 : -1].argmax(-1) == ids[0, 2 * n :]).float().mean()
        (sums,) = top1_sums(heads, adapter, hidden_states, logits, [mask], vocab)
        top1 = ", ".join(f"{float(s[0] / s[1]):.3f}" for s in sums)
        lines.append(f"{name:13s} third copy: the target copies {float(target):.3f}; heads' top-1 per draft {top1}")
    return lines


def recorded(model, tokenizer, args) -> list[dict]:
    path = Path(args.records) if args.records else None
    if path is not None and path.exists():
        return json.loads(path.read_text())
    prompts = read_prompts(args.prompts, tokenizer)
    if args.limit_per_category is not None:
        prompts = first_per_category(prompts, args.limit_per_category)
    categories = [getattr(p, "category", None) for p in prompts]
    rows = record_answers(model, encode(tokenizer, prompts, "cpu"), args.max_new_tokens, categories)
    records = [{"prompt": r.prompt, "answer": r.answer, "category": r.category} for r in rows]
    if path is not None:
        path.write_text(json.dumps(records))
    return records


def data_records(paths: list[str], tokenizer, per_kind: int, max_new_tokens: int) -> list[dict]:
    """Records of a chat data set's greedy first turns: per kind, the first `per_kind` rows whose `sampled` is
    false, the prompt as the chat template renders the first user turn for generation, the answer as the rendered
    conversation holds its tokens (`conversation_answers`), cut to `max_new_tokens`."""
    records, taken = [], defaultdict(int)
    for path in paths:
        with open_text(path) as f:
            for number, line in enumerate(f, 1):
                try:
                    row = json.loads(line)
                except ValueError:
                    row = None
                if not isinstance(row, dict) or "messages" not in row or "sampled" not in row:
                    raise ValueError(f"{path}: row {number} is not a packed chat row (`messages` and `sampled`)")
                kind = row.get("kind") or "all"
                if row["sampled"] or taken[kind] >= per_kind:
                    continue
                messages = row["messages"][:2]
                prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
                answers = conversation_answers(tokenizer, messages)
                if not answers:
                    raise ValueError(f"{path}: row {number} has no assistant answer in its first turn")
                answer = answers[0][:max_new_tokens]
                ids = tokenizer(prompt, add_special_tokens=False).input_ids
                records.append({"prompt": ids, "answer": answer, "category": kind})
                taken[kind] += 1
    return records


def sampling_sums(heads, adapter, hidden_states, logits, vocab, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """The first draft at the positions `mask` marks, the target sampling at `temperature`: sums of p_T(the head's
    best guess), of p_T over its 3 and its 5 best guesses, and of sum_x min(p_T(x), q_T(x)) (one draw from q_T),
    and the count, [5] float64."""
    draft = heads.distillation_drafts(adapter, hidden_states, vocab, mask)[0]
    q_logits = draft.head(draft.hidden).float()  # [batch, positions, V], -inf off a draft vocabulary
    p = draft.teacher(torch.softmax(logits.float() / temperature, dim=-1))
    q = torch.softmax(q_logits / temperature, dim=-1)
    best = p.gather(-1, q_logits.topk(5, dim=-1).indices)  # p_T of the head's 5 best guesses, best first
    weight = draft.teacher(mask.double())
    parts = [best[..., 0], best[..., :3].sum(-1), best.sum(-1), torch.minimum(p, q).sum(-1)]
    return torch.stack([(part.double() * weight).sum() for part in parts] + [weight.sum()])


def joined_share(vocab: set[int], prompt: list[int], answer: list[int]) -> int:
    """How many answer tokens the draft vocabulary holds once the prompt's tokens and the answer's before each
    one have joined it."""
    joined, count = vocab | set(prompt), 0
    for token in answer:
        count += token in joined
        joined.add(token)
    return count


def split_by_copying(model, adapter, heads, vocab, records: list[dict], temperature: float | None = None) -> list[str]:
    """The copy split's table over the recorded answers; with `temperature`, then the sampling table
    (`sampling_sums`), from the same target pass per record."""
    # category -> [copied, other, lookup right, in the draft vocabulary (alone, joined)] x [agree, n]
    sums = defaultdict(lambda: torch.zeros(4, 2, dtype=torch.float64))
    sampled = defaultdict(lambda: torch.zeros(5, dtype=torch.float64))  # category -> sampling_sums
    in_vocab = None if vocab is None else set(vocab.ids.tolist())
    for record in records:
        tokens = record["prompt"] + record["answer"]
        ids, flags = torch.tensor([tokens]), torch.tensor([copyable(tokens)])
        answer = torch.zeros_like(ids, dtype=torch.bool)
        answer[0, len(record["prompt"]) - 1 : -1] = True  # the positions that predict an answer token
        hidden_states, logits = target_pass(model, ids)
        parts = top1_sums(heads, adapter, hidden_states, logits, [answer & flags, answer & ~flags], vocab)
        looked_up = (answer & torch.tensor([lookup_right(tokens)])).sum()
        draftable = sum(in_vocab is None or token in in_vocab for token in record["answer"])
        joined = draftable if in_vocab is None else joined_share(in_vocab, record["prompt"], record["answer"])
        if temperature is not None:
            drawn = sampling_sums(heads, adapter, hidden_states, logits, vocab, answer, temperature)
        for category in (record.get("category") or "all", "overall"):
            for k, part in enumerate(parts):
                sums[category][k] += part[0]
            sums[category][2, 0] += looked_up
            sums[category][3] += torch.tensor([draftable, joined], dtype=torch.float64)
            if temperature is not None:
                sampled[category] += drawn
    lines = ["| category | positions | in the draft vocabulary | with the call's tokens | copied share | "
             "lookup right | top-1, copied | top-1, the rest | top-1, all |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for category in sorted(sums, key=lambda c: (c == "overall", c)):
        (copied, n_copied), (other, n_other), (looked_up, _), (draftable, joined) = sums[category].tolist()
        n = max(1, n_copied + n_other)
        lines.append(f"| {category} | {n_copied + n_other:.0f} | {draftable / n:.3f} | {joined / n:.3f} | "
                     f"{n_copied / n:.2f} | {looked_up / n:.2f} | {copied / max(1, n_copied):.3f} | "
                     f"{other / max(1, n_other):.3f} | {(copied + other) / n:.3f} |")  # fmt: skip
    if temperature is None:
        return lines
    lines += ["", f"draft 1 with the target sampling at T={temperature}, on the same answers' contexts:", "",
              f"| category | positions | best guess at T={temperature} | 3 best guesses | 5 best guesses | "
              "one draw from q |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for category in sorted(sampled, key=lambda c: (c == "overall", c)):
        best, three, five, drawn, n = sampled[category].tolist()
        n = max(1.0, n)
        lines.append(f"| {category} | {n:.0f} | {best / n:.3f} | {three / n:.3f} | {five / n:.3f} | {drawn / n:.3f} |")
    return lines


@torch.no_grad()
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", nargs="+", required=True, help="heads folders to probe")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="known target name or model folder")
    parser.add_argument("--draft_vocab", default="heads/smollm2-135m-instruct/draft_vocab.json",
                        help="the draft vocabulary the heads draft from ('none': the whole vocabulary)")  # fmt: skip
    parser.add_argument("--prompts", default=None, help="a prompts file (selfspec bench's formats)")
    parser.add_argument("--limit_per_category", type=int, default=None)
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--records", default=None,
                        help="JSON of answers: read if it exists (whatever --prompts says), else recorded")  # fmt: skip
    parser.add_argument("--data", default=None,
                        help="packed chat files, comma-separated: their greedy answers, not --prompts")  # fmt: skip
    parser.add_argument("--per_kind", type=int, default=5, help="with --data: rows per kind")
    parser.add_argument("--temperature", type=float, default=None,
                        help="the first draft's acceptance when the target samples at this T too")  # fmt: skip
    parser.add_argument("--num_threads", type=int, default=1)
    args = parser.parse_args(argv)
    answers = bool(args.prompts or args.records or args.data)
    if args.temperature is not None and not (args.temperature > 0 and answers):
        parser.error("--temperature needs a positive value and recorded answers (--prompts, --records or --data)")
    if args.data and (args.prompts or args.records):
        parser.error("--data reads its answers from the data set: without --prompts and --records")
    if args.per_kind < 1:
        parser.error(f"--per_kind {args.per_kind}: at least one row per kind")
    torch.set_num_threads(args.num_threads)
    model, tokenizer = load_model(args.model, dtype=torch.float32)
    adapter = ModelAdapter(model)
    vocab = adapter.draft_vocabulary(args.draft_vocab) if args.draft_vocab != "none" else None
    if args.data:
        records = data_records(args.data.split(","), tokenizer, args.per_kind, args.max_new_tokens)
    else:
        records = recorded(model, tokenizer, args) if answers else None
    for path in args.heads:
        heads = load_heads(path, adapter).eval()
        print(f"## {path}")
        print("\n".join(repeats(model, adapter, heads, tokenizer, vocab)))
        if records:
            print(f"\ndraft 1 on {len(records)} recorded greedy answers:\n")
            print("\n".join(split_by_copying(model, adapter, heads, vocab, records, args.temperature)))
        print()


if __name__ == "__main__":
    main()
