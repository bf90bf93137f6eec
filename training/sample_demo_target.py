"""Print greedy completions of held-out standard library files by the demo target.

    python training/sample_demo_target.py [--path heads/demo-target | runs/demo_target/checkpoints/step_001000]
    python training/sample_demo_target.py --write_prompts heads/demo-target/prompts.json --num_prompts 8 \
        --prompt_chars 600

`--path` is an exported model folder (config.json) or a training checkpoint (config.yaml, whose
tokenizer is in the run directory). Each prompt is the beginning of a held-out file, cut at a line
break, so the completions show whether the model writes Python it has not seen.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from selfspec.training.config import load_config

from pretrain_demo_target import Config, ModelConfig, TrainConfig, build_model
from stdlib_corpus import END_OF_TEXT, DataConfig, read_sources, split_files, stdlib_root


def load_model(path: Path):
    """(model, tokenizer, config) from an exported folder or a checkpoint, in float32 for CPU."""
    if (path / "config.json").exists():
        summary = path / "training_summary.json"
        config = load_config(Config) if not summary.exists() else _config_from_summary(summary)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return model, AutoTokenizer.from_pretrained(path), config
    if (path / "config.yaml").exists():
        config = load_config(Config, path / "config.yaml")
        tokenizer = AutoTokenizer.from_pretrained(path.parent.parent / "data" / "tokenizer")
        model = build_model(config.model, tokenizer)
        missing, unexpected = model.load_state_dict(load_file(path / "model.safetensors"), strict=False)
        tied = {"lm_head.weight"} if config.model.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise ValueError(f"{path}: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
        return model, tokenizer, config
    raise FileNotFoundError(f"{path} is neither an exported model (config.json) nor a checkpoint (config.yaml)")


def _config_from_summary(summary: Path) -> Config:
    """The config an exported model was trained with (its held-out split is what matters here)."""
    saved = json.loads(summary.read_text(encoding="utf-8"))["config"]
    return Config(
        data=DataConfig(**saved["data"]), model=ModelConfig(**saved["model"]), train=TrainConfig(**saved["train"])
    )


def heldout_prompts(config: Config, count: int, max_chars: int) -> list[tuple[str, str]]:
    """(file, prompt) for `count` held-out files spread over the sorted list, each cut at a line break."""
    root = stdlib_root()
    _, heldout = split_files(root, config.data.heldout_fraction)
    texts, _ = read_sources(root, heldout)
    candidates = [(path.as_posix(), text) for path, text in texts.items() if len(text) > max_chars]
    chosen = candidates[:: max(1, len(candidates) // count)][:count]
    return [(name, text[: text.rfind("\n", 0, max_chars) + 1] or text[:max_chars]) for name, text in chosen]


def code_prompts(config: Config, count: int, max_chars: int) -> list[dict]:
    """Prompts from inside held-out files: up to `max_chars` characters of code ending with the first line of
    a function (its `def` line, without its line break: byte-level BPE merges a line break with the next
    line's indentation, so a prompt cut after it would end in a split the model never saw), one per file,
    from `count` files spread over the held-out list."""
    root = stdlib_root()
    _, heldout = split_files(root, config.data.heldout_fraction)
    texts, _ = read_sources(root, heldout)
    found = []
    for path, text in texts.items():
        cut = text.find("\n    def ", len(text) // 3)  # a method a third of the way in, past the header
        end = text.find("\n", cut + 1) + 1 if cut > 0 else 0
        if end > 0:
            start = text.find("\n", max(0, end - max_chars)) + 1
            found.append({"file": path.as_posix(), "prompt": text[start : end - 1]})
    return found[:: max(1, len(found) // count)][:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", default="heads/demo-target", help="exported folder or checkpoint folder")
    parser.add_argument("--num_prompts", type=int, default=4, help="held-out files to complete")
    parser.add_argument("--prompt_chars", type=int, default=200, help="prompt length in characters (cut at a line)")
    parser.add_argument("--max_new_tokens", type=int, default=96, help="greedy tokens per completion")
    parser.add_argument("--write_prompts", help="write held-out code prompts (a JSON list) to this file and exit")
    args = parser.parse_args()

    if args.write_prompts:
        _, _, config = load_model(Path(args.path))
        prompts = code_prompts(config, args.num_prompts, args.prompt_chars)
        Path(args.write_prompts).write_text(json.dumps(prompts, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {len(prompts)} prompts to {args.write_prompts}")
        return

    model, tokenizer, config = load_model(Path(args.path))
    model.eval()
    eot = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    for name, prompt in heldout_prompts(config, args.num_prompts, args.prompt_chars):
        input_ids = torch.tensor([[eot] + tokenizer(prompt)["input_ids"]])  # files start after <|endoftext|>
        with torch.no_grad():
            output = model.generate(
                input_ids, max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eot, pad_token_id=eot
            )
        completion = tokenizer.decode(output[0, input_ids.shape[1] :])
        print(
            f"===== {name} =====\n{prompt}\033[1m{completion}\033[0m\n"
            if sys.stdout.isatty()
            else f"===== {name} =====\n{prompt}<<<COMPLETION>>>{completion}\n"
        )


if __name__ == "__main__":
    main()
