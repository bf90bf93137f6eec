"""A draft vocabulary for a target from its own chat answers (the jsonl files, plain or .gz, that
training/make_chat_data.py writes).

    python training/make_draft_vocab.py --data runs/smollm2-chat/train.jsonl \
        --heldout runs/smollm2-chat/heldout.jsonl --out heads/smollm2-135m-instruct/draft_vocab.json

The `--count` most frequent token ids of the assistant answers as the model generates them
(`selfspec.chat.chat_answers`: the tokens drafts have to propose), plus the
end-of-text id, as a sorted JSON list for `SelfSpeculative(draft_vocab=...)` (`selfspec.frequent_tokens`).
Prints the share of held-out answer tokens the vocabulary covers: a draft outside it is never proposed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from selfspec.adapter import frequent_tokens
from selfspec.chat import chat_answers
from selfspec.cli.parsers import positive
from selfspec.targets import load_model

COUNT = 8192  # draft vocabulary size (plus EOS)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", nargs="+", required=True, help="jsonl (or .jsonl.gz) files with chat messages: "
                        "the vocabulary is counted here")  # fmt: skip
    parser.add_argument("--heldout", nargs="+", help="jsonl files with chat messages: the coverage is measured here")
    parser.add_argument("--out", required=True, help="the JSON list to write")
    parser.add_argument("--target", default="smollm2-135m-instruct", help="whose tokenizer")
    parser.add_argument("--count", type=positive, default=COUNT, help="the most frequent answer ids kept (plus EOS)")
    args = parser.parse_args(argv)
    _, tokenizer = load_model(args.target, dtype="bfloat16")  # only the tokenizer is used
    answers = [answer for path in args.data for answer in chat_answers(path, tokenizer)]
    ids = frequent_tokens(answers, args.count, always=[tokenizer.eos_token_id])
    Path(args.out).write_text(json.dumps(ids.tolist()))
    print(f"{len(ids)} ids -> {args.out}")
    if args.heldout:
        held = torch.tensor(
            [token for path in args.heldout for answer in chat_answers(path, tokenizer) for token in answer]
        )
        print(f"held-out answer tokens covered: {torch.isin(held, ids).float().mean().item():.4f} of {held.numel()}")


if __name__ == "__main__":
    main()
