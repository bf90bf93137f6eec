"""The repeated workload (`selfspec.measure.workload`): built offline from the standard library's own functions,
split into warm-up and timed prompts, with two-turn revisions of the target's own answers; `selfspec bench
--workload repeated` runs it with warm-up calls and reports it per kind."""

from __future__ import annotations

import json

import pytest
from test_specbench import tiny_tokenizer
from tiny_models import tiny_model

from selfspec.cli.main import main
from selfspec.measure.workload import FUNCTIONS, TASKS, function_sources, revision_prompts, same_task_prompts


def test_the_workload_is_built_from_standard_library_functions():
    sources = function_sources()
    assert 8 <= len(sources) <= len(FUNCTIONS) and all(source.startswith("def ") for source in sources)
    warm, timed = same_task_prompts(tiny_tokenizer(), warmup=2)
    assert len(warm) == 2 * len(TASKS) and len(timed) == (len(sources) - 2) * len(TASKS)
    assert {p.category for p in warm + timed} == {"same_task"}
    answers = []
    revisions = revision_prompts(tiny_tokenizer(), lambda text: answers.append(text) or "t7 t8", 3)
    assert len(revisions) == 3 == len(answers) and all(p.category == "revision" for p in revisions)
    assert all("t7 t8" in p and p.endswith(" t1") for p in revisions)  # the answer, then the generation prompt


def test_bench_runs_the_repeated_workload_after_its_warm_up(tmp_path, capsys):
    model = tiny_model("llama", num_layers=4)
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    args = ["bench", "--model", str(tmp_path / "model"), "--workload", "repeated", "--warmup", "1"]
    args += ["--max_new_tokens", "5", "--repeats", "1", "--num_prompts", "40", "--output", str(tmp_path / "out")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "### same_task" in out and "### revision (3 prompts)" in out and "| selfspec suffix |" in out
    rows = json.loads((tmp_path / "out" / "bench_repeated.json").read_text())
    assert rows["meta"]["warmup"] == len(TASKS)
    contenders = {row["contender"] for row in rows["results"]}
    assert contenders == {
        "generate",
        "transformers prompt lookup",
        "selfspec plain loop",
        "selfspec ngram",
        "selfspec suffix",
    }
    # with a memory of earlier answers, and only the suffix contenders
    chat = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "t5"}, {"role": "assistant", "content": "t6 t7"}]
    chat.write_text(json.dumps({"messages": turns}) + "\n", encoding="utf-8")
    more = ["--suffix_memory", str(chat), "--only", "suffix", "--output", str(tmp_path / "memory")]
    with pytest.raises(SystemExit, match="row 1: the chat template does not render a conversation's turns as prefixes"):
        main(args[:-2] + more)  # its generation prompt (t1) is not in the rendered conversation
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "t2{% for m in messages %} {{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(tmp_path / "model")
    assert main(args[:-2] + more) == 0
    rows = json.loads((tmp_path / "memory" / "bench_repeated.json").read_text())
    names = {row["contender"] for row in rows["results"]}
    assert names == {"generate", "selfspec suffix", "selfspec suffix, memory 2 tokens"}
    with pytest.raises(SystemExit, match="--merged_trees needs EAGLE heads"):  # as on Spec-Bench prompts
        main(args[:-2] + more + ["--merged_trees", "2-2-1/3"])
