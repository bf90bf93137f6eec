"""Spec-Bench prompts (first turn through the chat template, categories grouped as Spec-Bench reports them),
bench results per category, the memory the heads add, and `selfspec bench --prompts question.jsonl`."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import tiny_model
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from selfspec import ExitHeads, SelfSpeculative
from selfspec.adapter import ModelAdapter
from selfspec.cli.main import main
from selfspec.cli.options import encode
from selfspec.measure.bench import added_memory, category_report, summarize_by_category
from selfspec.measure.contenders import Contender
from selfspec.measure.prompts import ChatPrompt, first_per_category, read_prompts

QUESTIONS = [  # Spec-Bench rows; words are the tiny tokenizer's tokens
    {"question_id": 1, "category": "writing", "turns": ["t5 t6", "t7 t8"]},
    {"question_id": 2, "category": "qa", "turns": ["t9 t10 t11"]},
    {"question_id": 3, "category": "coding", "turns": ["t12"]},
    {"question_id": 4, "category": "qa", "turns": ["t13"]},
    {"question_id": 5, "category": "translation", "turns": ["t14 t15"]},
]


def tiny_tokenizer(chat: bool = True) -> PreTrainedTokenizerFast:
    """Word-level tokens t0..t95; every encoding starts with t2 (its BOS); with `chat`, a chat template that
    writes t2, the messages, and t1 as the generation prompt."""
    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(96)}, unk_token="t3"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="t2 $A", special_tokens=[("t2", 2)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="t2", unk_token="t3", pad_token="t0")
    if chat:
        tokenizer.chat_template = (
            "t2{% for m in messages %} {{ m['content'] }}{% endfor %}{% if add_generation_prompt %} t1{% endif %}"
        )
    return tokenizer


def write_questions(path, rows=QUESTIONS):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_questions_become_first_turn_chat_prompts_by_category(tmp_path):
    prompts = read_prompts(write_questions(tmp_path / "q.jsonl"), tiny_tokenizer())
    assert prompts == ["t2 t5 t6 t1", "t2 t9 t10 t11 t1", "t2 t12 t1", "t2 t13 t1", "t2 t14 t15 t1"]
    assert all(isinstance(p, ChatPrompt) for p in prompts)
    assert [p.category for p in prompts] == ["mt_bench", "qa", "mt_bench", "qa", "translation"]
    ids = encode(tiny_tokenizer(), [prompts[0], "t5 t6"], torch.device("cpu"))
    assert ids[0].tolist() == [[2, 5, 6, 1]]  # the template's BOS, no second one
    assert ids[1].tolist() == [[2, 5, 6]]  # a plain prompt gets the tokenizer's special tokens
    assert [p.category for p in first_per_category(prompts, 1)] == ["mt_bench", "qa", "translation"]
    with pytest.raises(ValueError, match="needs Spec-Bench prompts"):
        first_per_category(["t5"], 1)


def test_question_files_are_checked(tmp_path):
    with pytest.raises(ValueError, match="this tokenizer has none"):
        read_prompts(write_questions(tmp_path / "q.jsonl"), tiny_tokenizer(chat=False))
    bad = [QUESTIONS[0], {"question_id": 9, "category": "qa", "turns": []}]
    with pytest.raises(ValueError, match="row 2 is not a Spec-Bench question"):
        read_prompts(write_questions(tmp_path / "bad.jsonl", bad), tiny_tokenizer())
    for rows, problem in [
        ([{"category": "qa", "question": "t5"}], "row 1 is not a Spec-Bench question: it has no `turns` field"),
        ([QUESTIONS[0], {"turns": ["t5"]}], "row 2 is not a Spec-Bench question: it has no `category`"),
        ([QUESTIONS[0], {"category": "qa", "turns": "t5"}], "row 2 .* `turns` that are not a non-empty list"),
    ]:
        with pytest.raises(ValueError, match=problem):  # not "item 1 has no prompt": the field missing is named
            read_prompts(write_questions(tmp_path / "bad.jsonl", rows), tiny_tokenizer())
    (tmp_path / "plain.jsonl").write_text('{"prompt": "t5 t6"}\n')  # not Spec-Bench: plain prompts, as before
    assert read_prompts(tmp_path / "plain.jsonl", tiny_tokenizer()) == ["t5 t6"]
    (tmp_path / "plain.jsonl").write_text('{"prompt": "t5 t6", "category": "mine"}\n')  # a prompt with a label
    assert read_prompts(tmp_path / "plain.jsonl", tiny_tokenizer()) == ["t5 t6"]


def test_bench_rows_are_summarized_per_category():
    prompts = [ChatPrompt("a", "mt_bench"), ChatPrompt("b", "qa"), ChatPrompt("c", "qa")]
    plain = Contender("generate", False, None, baseline=True, seconds=[1.0, 2.0, 4.0], tokens=[10, 10, 10],
                      matched=[True, True, True], prompt_indices=[0, 1, 2])  # fmt: skip
    fast = Contender("fast", False, None, seconds=[0.5, 2.0, 2.0], tokens=[10, 10, 10],
                     matched=[True, False, True], prompt_indices=[0, 1, 2])  # fmt: skip
    by_category = summarize_by_category([plain, fast], prompts)
    assert list(by_category) == ["mt_bench", "qa", "overall"]
    speedups = {category: rows[1]["speedup"] for category, rows in by_category.items()}
    assert speedups["mt_bench"] == pytest.approx(20 / 10)
    assert speedups["qa"] == pytest.approx(5 / 3.75)  # medians of 5, 5 and of 5, 2.5 tokens/s
    assert speedups["overall"] == pytest.approx(5 / 5)
    assert [rows[1]["matched"] for rows in by_category.values()] == [True, False, False]
    assert [rows[1]["runs"] for rows in by_category.values()] == [1, 2, 3]
    report = category_report(by_category, prompts)
    for heading in ("### mt_bench (1 prompts)", "### qa (2 prompts)", "### overall (3 prompts)"):
        assert heading in report
    assert "| contender | mt_bench | qa | overall |" in report and "| fast | 2.00x | 1.33x | 1.00x |" in report


def test_added_memory_counts_the_heads_and_draft_copies():
    model = tiny_model("llama", num_layers=4)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert added_memory(SelfSpeculative(model, exit_layer=2)) == {"heads_mb": 0.0, "heads_share": 0.0}
    heads = ExitHeads(ModelAdapter(model).fingerprint(), [2])
    head_bytes = sum(p.numel() * p.element_size() for p in heads.parameters())
    memory = added_memory(SelfSpeculative(model, heads=heads, exit_layer=2))
    assert memory["heads_mb"] == head_bytes / 2**20 and memory["heads_share"] == head_bytes / model_bytes
    ids = list(range(0, 96, 2))  # 48 rows of the LM head copied for the drafts, with their ids
    reduced = added_memory(SelfSpeculative(model, heads=heads, exit_layer=2, draft_vocab=ids))
    copy_bytes = 48 * model.config.hidden_size * 4 + 48 * 8
    assert reduced["heads_mb"] * 2**20 == head_bytes + copy_bytes


def test_bench_command_reads_spec_bench_questions(tmp_path, capsys):
    model = tiny_model("llama", num_layers=4)
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    args = ["bench", "--model", str(tmp_path / "model"), "--prompts", str(write_questions(tmp_path / "q.jsonl"))]
    args += ["--limit_per_category", "1", "--max_new_tokens", "6", "--repeats", "1", "--no_transformers"]
    assert main([*args, "--no_sampling", "--output", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    for heading in ("### mt_bench (1 prompts)", "### qa (1 prompts)", "### translation (1 prompts)", "### overall"):
        assert heading in out
    assert "| contender | mt_bench | translation | qa | overall |" in out  # Spec-Bench's order
    rows = json.loads((tmp_path / "out" / "bench_by_category.json").read_text())["results"]
    assert {(row["category"], row["contender"]) for row in rows} >= {("qa", "generate"), ("overall", "generate")}
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["meta"]["prompts"] == 3


def eagle_bench_args(tmp_path) -> list[str]:
    """`selfspec bench` arguments for a saved tiny Llama, an untrained EAGLE head for it (`--heads` left to the test)
    and three Spec-Bench questions, greedy, 8 new tokens."""
    from selfspec.heads import EagleHeads
    from selfspec.training.config import HeadsConfig

    model = tiny_model("llama", num_layers=4)
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    torch.manual_seed(0)
    EagleHeads.from_config(HeadsConfig(kind="eagle"), ModelAdapter(model)).save_pretrained(tmp_path / "eagle")
    args = ["bench", "--model", str(tmp_path / "model"), "--prompts", str(write_questions(tmp_path / "q.jsonl"))]
    args += ["--limit_per_category", "1", "--max_new_tokens", "8", "--repeats", "1", "--no_transformers"]
    return [*args, "--no_sampling", "--output", str(tmp_path / "out")]


def test_bench_runs_fixed_chains_and_reports_acceptance_by_position(tmp_path, capsys):
    args = [*eagle_bench_args(tmp_path), "--only", "chain"]
    assert main([*args, "--heads", str(tmp_path / "eagle"), "--chains", "1,3"]) == 0
    out = capsys.readouterr().out
    table = out.split("### acceptance by draft position")[1]
    assert "| contender | tokens/pass | position 1 | position 2 | position 3 |" in table
    rows = json.loads((tmp_path / "out" / "bench.json").read_text())["results"]
    chains = {row["contender"]: row for row in rows if "chain" in row["contender"]}
    assert len(chains["selfspec eagle chain 1 (fixed)"]["proposed_per_position"]) == 1
    three = chains["selfspec eagle chain 3 (fixed)"]
    assert len(three["proposed_per_position"]) == 3
    assert three["accepted_per_position"] == sorted(three["accepted_per_position"], reverse=True)  # a chain
    assert f"| selfspec eagle chain 3 (fixed) | {three['tokens_per_pass']:.2f} |" in table
    with pytest.raises(SystemExit, match="--chains needs EAGLE heads"):
        main([*args, "--chains", "2"])


def test_bench_runs_lookup_merged_into_eagle_trees(tmp_path):
    args = [*eagle_bench_args(tmp_path), "--only", "merged", "--heads", str(tmp_path / "eagle")]
    assert main([*args, "--merged_trees", "2-2-1/3, 3-1-3/2"]) == 0
    rows = json.loads((tmp_path / "out" / "bench.json").read_text())["results"]
    merged = {row["contender"]: row for row in rows if "merged" in row["contender"]}
    assert set(merged) == {"selfspec merged ngram 3 + eagle tree 2-2-1", "selfspec merged ngram 2 + eagle tree 3-1-3"}
    assert all(row["matched"] is True and row["tokens_per_pass"] >= 1.0 for row in merged.values())
    with pytest.raises(SystemExit, match="--merged_trees needs EAGLE heads"):
        main([*args[:-2], "--merged_trees", "2-2-1/3"])


def test_bench_merges_a_suffix_memory_into_the_given_trees(tmp_path):
    """--suffix_memory with --merged_trees: the memory's chain in each tree, alone and beside lookup's, greedy and
    sampled, and with --fixed_trees a fixed copy of each; greedy output stays generate's."""
    args = [a for a in eagle_bench_args(tmp_path) if a != "--no_sampling"]
    tokenizer = tiny_tokenizer()  # a template that renders a conversation's turns as prefixes (no generation prompt)
    tokenizer.chat_template = "t2{% for m in messages %} {{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(tmp_path / "model")
    chat = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "t5"}, {"role": "assistant", "content": "t6 t7"}]
    chat.write_text(json.dumps({"messages": turns}) + "\n", encoding="utf-8")
    args += ["--heads", str(tmp_path / "eagle"), "--merged_trees", "2-2-1/3", "--temperature", "0.7"]
    assert main([*args, "--suffix_memory", str(chat), "--only", "suffix 3", "--fixed_trees"]) == 0
    rows = {row["contender"]: row for row in json.loads((tmp_path / "out" / "bench.json").read_text())["results"]}
    merged = [f"selfspec merged {parts}suffix 3, memory 2 tokens + eagle tree 2-2-1" for parts in ("", "ngram 3 + ")]
    modes = [f"{name}{label}" for name in merged for label in ("", " T=0.7")]
    assert set(rows) == {"generate", "generate T=0.7", *modes, *(f"{name} (fixed)" for name in modes)}
    for name in modes:
        for row in (rows[name], rows[f"{name} (fixed)"]):
            assert row["sampling"] is ("T=0.7" in name) and row["tokens_per_pass"] >= 1.0
            assert row["matched"] is (None if row["sampling"] else True)


def test_bench_samples_the_merged_and_hybrid_trees_against_sampled_generate(tmp_path):
    args = [a for a in eagle_bench_args(tmp_path) if a != "--no_sampling"]
    args += ["--only", "T=", "--temperature", "0.7", "--heads", str(tmp_path / "eagle"), "--merged_trees", "2-2-1/3"]
    assert main(args) == 0
    rows = {row["contender"]: row for row in json.loads((tmp_path / "out" / "bench.json").read_text())["results"]}
    sampled = {"selfspec merged ngram 3 + eagle tree 2-2-1 T=0.7", "selfspec hybrid ngram + eagle tree T=0.7"}
    assert sampled <= set(rows) and "selfspec merged ngram 3 + eagle tree 2-2-1" not in rows  # --only T=
    assert all(rows[name]["sampling"] is True and rows[name]["tokens_per_pass"] >= 1.0 for name in sampled)
    base = rows["generate T=0.7"]["tokens_per_s"]
    for name in sampled:  # against sampled generate, not greedy
        assert rows[name]["speedup"] == pytest.approx(rows[name]["tokens_per_s"] / base)


def test_loop_profile_times_the_eagle_tree_and_the_merged_tree_section_by_section(tmp_path, capsys):
    from selfspec.cli import loop_profile

    args = eagle_bench_args(tmp_path)
    model_args = args[1:5] + ["--heads", str(tmp_path / "eagle")]  # --model and --prompts
    argv = [*model_args, "--modes", "plain,eagle_tree,merged", "--merged_tree", "2-2-1/3", "--num_prompts", "2"]
    assert loop_profile.main([*argv, "--repeats", "1", "--max_new_tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "| section (us per iteration) | plain | eagle_tree | merged |" in out
    timed = next(line for line in out.splitlines() if line.startswith("| iterations timed |"))
    assert all(int(cell) > 0 for cell in timed.strip("|").split("|")[1:])
    options = loop_profile.mode_options(None, "merged", {"eagle": "heads"}, 3, ({"nodes": 2}, 3), [5, 7])
    assert options == {"drafter": "hybrid", "heads": "heads", "draft_vocab": [5, 7], "tree": {"nodes": 2},
                       "prompt_lookup_num_tokens": 3}  # fmt: skip
    # the EAGLE modes draft from the target's draft vocabulary, as the bench runs them; the others never do
    assert loop_profile.mode_options(None, "eagle", {"eagle": "heads"}, 3, ({}, 3), [5])["draft_vocab"] == [5]
    assert "draft_vocab" not in loop_profile.mode_options(None, "ngram", {}, 3, ({}, 3), [5])
    with pytest.raises(SystemExit) as stopped:
        loop_profile.main([*argv[:-4], "--merged_tree", "2-2"])
    assert stopped.value.code == 2 and "--merged_tree: expected NODES-TOP_K-DEPTH" in capsys.readouterr().err


def test_loop_profile_takes_one_merged_tree(monkeypatch, capsys):
    """--merged_tree is the one tree of eagle_tree and merged: several shapes (bench's --merged_trees takes those)
    are refused by the parser, not cut to the first."""
    from selfspec.cli import loop_profile

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the bad input was refused")

    monkeypatch.setattr(loop_profile, "load_target", refuse)
    with pytest.raises(SystemExit) as stopped:
        loop_profile.main(["--modes", "eagle_tree", "--merged_tree", "2-2-1/3,3-1-3/2"])
    message = "--merged_tree: takes one shape, got 2 in '2-2-1/3,3-1-3/2': profile each in its own run"
    assert stopped.value.code == 2 and message in capsys.readouterr().err
    assert loop_profile.one_merged_tree(" 2-2-1/3 ") == ({"nodes": 2, "top_k": 2, "depth": 1}, 3)
    with pytest.raises(SystemExit) as stopped:  # the modes that read no tree
        loop_profile.main(["--modes", "plain,eagle", "--merged_tree", "2-2-1/3"])
    message = "--merged_tree shapes the modes eagle_tree and merged; --modes plain,eagle has neither"
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_loop_profile_runs_a_committed_version_beside_the_working_tree_on_prompts_per_category(tmp_path, capsys):
    """--before REF imports the package as committed at REF (its submodules too, which its lazy exports do not
    load) and times it interleaved; --limit_per_category picks the first prompts of each Spec-Bench category."""
    from selfspec.cli import loop_profile

    model_args = eagle_bench_args(tmp_path)[1:5] + ["--heads", str(tmp_path / "eagle")]
    argv = [*model_args, "--modes", "plain,eagle", "--limit_per_category", "1", "--num_prompts", "2"]
    assert loop_profile.main([*argv, "--repeats", "1", "--max_new_tokens", "6", "--before", "HEAD"]) == 0
    out = capsys.readouterr().out
    assert "| section (us per iteration) | plain | eagle | plain @HEAD | eagle @HEAD |" in out
    assert "mean over 2 prompts (4-5 tokens) x 1 repeats" in out  # mt_bench's first and qa's first
