"""`selfspec bench` and `selfspec demo` on tiny models: every contender runs, greedy outputs are checked
against `model.generate`, the figures are consistent with the statistics they come from, files are written."""

from __future__ import annotations

import json

import pytest
import torch
from test_medusa import medusa_heads
from tiny_models import random_prompt, tiny_model
from transformers import PreTrainedTokenizerFast

from selfspec import ExitHeads, SelfSpeculative
from selfspec.adapter import ModelAdapter
from selfspec.cli.main import main
from selfspec.measure.bench import markdown_table, run_bench, summarize
from selfspec.measure.contenders import Contender, standard_contenders
from selfspec.measure.prompts import load_prompts


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_layers=4)


def test_every_contender_runs_and_greedy_ones_match(model):
    exit_heads = ExitHeads(ModelAdapter(model).fingerprint(), [1, 2])
    vocab = list(range(0, model.config.vocab_size, 2))
    contenders = standard_contenders(
        model, exit_heads, medusa_heads(model), assistant_exit_layers=[2], draft_vocab=vocab
    )
    prompts = [random_prompt(5, seed=1), random_prompt(9, seed=2)]
    rows = run_bench(contenders, prompts, max_new_tokens=12, repeats=2, progress=False)
    names = [row["contender"] for row in rows]
    assert names == [
        "generate",
        "generate T=0.8",
        "transformers early exit 2",
        "transformers prompt lookup",
        "selfspec plain loop",
        "selfspec ngram",
        "selfspec suffix",
        "selfspec hybrid ngram + exit trained",
        "selfspec hybrid ngram + medusa chain",
        "selfspec exit 1 untrained",
        "selfspec exit 1 trained",
        "selfspec exit 2 trained",
        "selfspec exit 2 trained, vocab 48",
        "selfspec exit 2 trained, int8 head",
        "selfspec medusa chain",
        "selfspec medusa tree",
        "selfspec medusa chain, vocab 48",
        "selfspec medusa tree, vocab 48",
        "selfspec medusa chain, int8 head",
        "selfspec medusa chain, vocab 48, int8 head",
        "selfspec medusa chain T=0.8, vocab 48",
    ]
    by_name = {row["contender"]: row for row in rows}
    for row in rows:
        assert row["runs"] == 4 and row["tokens_per_s"] > 0
        assert row["matched"] is (None if row["sampling"] else True), row["contender"]
    assert by_name["generate"]["speedup"] == 1.0 and by_name["generate T=0.8"]["speedup"] == 1.0
    assert by_name["generate"]["paired_speedup"] == 1.0 and by_name["generate T=0.8"]["paired_speedup"] == 1.0
    assert all(len(row["run_tokens"]) == len(row["run_seconds"]) == len(row["run_prompts"]) == 4 for row in rows)
    for row in rows:  # each selfspec run's stats, for figures the table does not give
        assert [s["new_tokens"] for s in row["run_stats"]] == (
            row["run_tokens"] if "selfspec" in row["contender"] else []
        )
    assert by_name["selfspec ngram"]["run_prompts"] == [0, 1, 0, 1]
    plain = by_name["selfspec plain loop"]
    assert plain["tokens_per_pass"] == 1.0 and plain["alpha_hat"] is None and plain["gamma"] == 0
    # the plain loop is the unit: v = 1 and 1.00x against itself, the prompt's pass left out of both
    assert plain["v"] == pytest.approx(1.0) and plain["plain_loop_speedup"] == pytest.approx(1.0)
    medusa = by_name["selfspec medusa chain"]
    assert 1.0 <= medusa["tokens_per_pass"] <= 5.0 and 0.0 <= medusa["alpha_hat"] <= 1.0
    assert medusa["c"] > 0 and medusa["v"] > 0 and medusa["predicted_speedup"] > 0
    assert "predicted_speedup" not in by_name["selfspec medusa tree"]  # the chain equation does not apply
    table = markdown_table(rows)
    assert table.count("\n") == len(rows) + 1 and "| selfspec medusa tree |" in table


def test_a_wrong_output_is_reported_as_a_mismatch(model):
    def wrong(input_ids, max_new_tokens):
        out = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)
        out[0, -1] = (out[0, -1] + 1) % model.config.vocab_size
        return out

    def right(input_ids, max_new_tokens):
        return model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)

    contenders = [Contender("generate", False, right, baseline=True), Contender("broken", False, wrong)]
    rows = run_bench(contenders, [random_prompt(4, seed=3)], max_new_tokens=6, progress=False)
    assert [row["matched"] for row in rows] == [True, False]
    assert "| broken |" in markdown_table(rows) and "NO" in markdown_table(rows)


def test_the_paired_speedup_divides_each_run_by_the_baseline_on_the_same_prompt():
    def timed(name, tokens, seconds, baseline=False, prompts=(0, 1, 2)):
        contender = Contender(name, False, None, baseline=baseline)
        contender.tokens, contender.seconds, contender.prompt_indices = list(tokens), list(seconds), list(prompts)
        return contender

    # tokens/s per prompt: generate 10, 2.5, 5; the contender 24, 7.5, 5: 2.4x, 3x and 1x on the same prompts
    generate = timed("generate", [10, 20, 10], [1, 8, 2], baseline=True)
    contender = timed("fast", [12, 15, 10], [0.5, 2, 2])
    rows = {row["contender"]: row for row in summarize([generate, contender])}
    assert rows["fast"]["speedup"] == pytest.approx(7.5 / 5)  # the medians' ratio: different middle prompts
    # the median of 2.4, 3 and 1; not their mean (2.13), nor sorted rates divided unpaired (2.0), nor seconds
    # alone (2, 4, 1: 2.0)
    assert rows["fast"]["paired_speedup"] == pytest.approx(2.4)
    assert rows["fast"]["run_seconds"] == [0.5, 2, 2] and rows["fast"]["run_tokens"] == [12, 15, 10]
    assert rows["generate"]["paired_speedup"] == 1.0
    with pytest.raises(ValueError, match="ran different prompts"):
        summarize([generate, timed("other", [10] * 3, [1, 1, 1], prompts=(2, 1, 0))])


def _no_nan(constant):
    raise AssertionError(f"bench.json holds {constant}, which strict JSON parsers reject")


def test_decoding_figures_leave_the_prompts_pass_out():
    from selfspec.engine.stats import decoding_tokens
    from selfspec.measure.bench import decoding_unit
    from selfspec.measure.tune import decoding_pass_seconds

    # two one-prompt calls of a plain loop: 2 prompt passes, then 18 steps of 0.1 s with 0.02 s of bookkeeping each
    plain = {"new_tokens": 20, "target_passes": 20, "iterations": 18, "verify_seconds": 2 + 1.8,
             "prefill_seconds": 2.0, "measure_seconds": 0.5, "total_seconds": 2 + 1.8 + 0.36 + 0.5}  # fmt: skip
    assert decoding_tokens(plain) == 18  # each call's first token is the prompt pass's
    step, rate = decoding_unit(plain)
    assert step == pytest.approx(0.1) and rate == pytest.approx(18 / 2.16)
    assert decoding_pass_seconds(plain) == pytest.approx(0.12)
    slow_prompts = dict(plain, verify_seconds=20 + 1.8, prefill_seconds=20.0, total_seconds=20 + 1.8 + 0.36 + 0.5)
    assert decoding_unit(slow_prompts) == pytest.approx(decoding_unit(plain))  # the prompts' pass does not count
    nothing = dict(plain, iterations=0, new_tokens=2, target_passes=2)
    assert decoding_unit(nothing) is None
    with pytest.raises(ValueError, match="no decoding step"):
        decoding_pass_seconds(nothing)


def test_prompt_files_are_checked(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps(["a", {"prompt": "b"}, {"text": "c"}]))
    assert load_prompts(tmp_path / "p.json") == ["a", "b", "c"]
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n\n{"text": ""}\n')
    with pytest.raises(ValueError, match="item 2 has no prompt"):
        load_prompts(tmp_path / "p.jsonl")
    (tmp_path / "p.txt").write_text("x")
    with pytest.raises(ValueError, match=r"\.json list or a \.jsonl file"):
        load_prompts(tmp_path / "p.txt")
    for text, problem in [
        ('"def f(x):"', "holds a list, got a JSON str"),  # its characters were the prompts
        ('{"a": 1, "b": 2}', "holds a list, got a JSON dict"),  # its keys were
        ("[1, 2]", "item 1 has no prompt"),
        ('["a", ', "is not valid JSON"),
        ("", "holds no prompts"),
    ]:
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ValueError, match=problem):
            load_prompts(tmp_path / "bad.json")
    (tmp_path / "folder.json").mkdir()
    with pytest.raises(ValueError, match="is a folder"):
        load_prompts(tmp_path / "folder.json")


def test_demo_and_bench_commands_on_a_saved_model(model, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t3", pad_token="t0")
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    heads = ExitHeads(ModelAdapter(model).fingerprint(), [2])
    torch.manual_seed(0)
    heads.save_pretrained(tmp_path / "exit")
    medusa_heads(model, num_heads=3).save_pretrained(tmp_path / "medusa")
    (tmp_path / "model" / "prompts.json").write_text(json.dumps(["t5 t9 t2 t7", "t1 t1 t4"]))
    (tmp_path / "model" / "draft_vocab.json").write_text(json.dumps(list(range(0, 96, 3))))
    common = [
        "--model",
        str(tmp_path / "model"),
        "--heads",
        str(tmp_path / "exit"),
        "--heads",
        str(tmp_path / "medusa"),
    ]
    common += ["--max_new_tokens", "10"]

    assert main(["demo", *common, "--output", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "Greedy outputs identical to model.generate: yes" in out
    assert "| selfspec exit 2 trained, vocab 32 |" in out and "| selfspec medusa tree, vocab 32 |" in out
    assert "alpha_hat: drafts accepted / drafts proposed" in out and "vocab 32: the drafts choose among 32" in out
    assert "top-1: how often the draft's most likely token is the model's" in out  # the legends
    assert (tmp_path / "demo" / "alpha_by_depth.png").stat().st_size > 0

    assert main(["bench", *common, "--repeats", "1", "--no_transformers", "--output", str(tmp_path / "b")]) == 0
    result = json.loads((tmp_path / "b" / "bench.json").read_text(), parse_constant=_no_nan)  # strict JSON
    assert result["meta"]["prompts"] == 2 and result["meta"]["max_new_tokens"] == 10
    assert {row["contender"] for row in result["results"]} >= {"generate", "selfspec medusa tree"}
    assert (tmp_path / "b" / "bench.png").stat().st_size > 0 and (tmp_path / "b" / "bench.md").exists()
    fixed = ["--only", "medusa tree", "--fixed_trees", "--no_sampling", "--output", str(tmp_path / "f")]
    assert main(["bench", *common, "--repeats", "1", "--no_transformers", *fixed]) == 0
    rows = {row["contender"]: row for row in json.loads((tmp_path / "f" / "bench.json").read_text())["results"]}
    assert {"selfspec medusa tree", "selfspec medusa tree (fixed)"} <= set(rows)
    assert rows["selfspec medusa tree (fixed)"]["matched"] is True  # a tree every iteration, still exact
    fixed[1] = "tree (fixed)"  # a variant's name alone: the variant, not the contender it is built from
    assert main(["bench", *common, "--repeats", "1", "--no_transformers", *fixed]) == 0
    rows = [row["contender"] for row in json.loads((tmp_path / "f" / "bench.json").read_text())["results"]]
    assert rows == ["generate", "selfspec medusa tree (fixed)"]
    with pytest.raises(SystemExit, match="--only 'no such' names no contender of this run; they are: .*medusa tree"):
        main(["bench", *common, "--no_transformers", "--only", "no such", "--output", str(tmp_path / "f")])
    only = ["--only", "untrained", "--untrained_exit_layer", "1", "--no_sampling", "--output", str(tmp_path / "c")]
    assert main(["bench", *common, "--repeats", "1", *only]) == 0
    result = json.loads((tmp_path / "c" / "bench.json").read_text())
    assert [row["contender"] for row in result["results"]] == ["generate", "selfspec exit 1 untrained"]

    (tmp_path / "exit" / "notes.txt").write_text("mine")  # tune writes its defaults and leaves the rest alone
    weights = (tmp_path / "exit" / "model.safetensors").read_bytes()
    assert (
        main(["tune", *common, "--num_prompts", "1", "--timing_repeats", "2", "--max_gamma", "3", "--measure_grid"])
        == 0
    )
    out = capsys.readouterr().out
    assert "choice: " in out and "measured: the choice" in out
    assert json.loads((tmp_path / "exit" / "config.json").read_text())["num_draft_tokens"] in (1, 2, 3)
    assert (tmp_path / "exit" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "exit" / "model.safetensors").read_bytes() == weights
    assert "## Tuned defaults" in (tmp_path / "medusa" / "README.md").read_text()

    chat = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "t5 t9"}, {"role": "assistant", "content": "t2 t7 t1 t1 t4 t4"}]
    chat.write_text(json.dumps({"messages": turns}) + "\n", encoding="utf-8")
    memory = ["--suffix_memory", str(chat), "--only", "suffix", "--no_sampling", "--output", str(tmp_path / "d")]
    with pytest.raises(SystemExit, match="--suffix_memory: .* needs a tokenizer with a chat template"):
        main(["bench", *common, "--repeats", "1", *memory])
    with pytest.raises(SystemExit, match="--workload repeated asks a chat model .* no chat template"):
        main(["bench", *common, "--workload", "repeated"])
    with pytest.raises(SystemExit, match=r"--untrained_exit_layer 4: .* \(it has 4: 1 to 3\)"):
        main(["bench", *common, "--untrained_exit_layer", "4"])
    with pytest.raises(SystemExit, match="--assistant_exit_layers 7: an exit must come before"):
        main(["bench", *common, "--assistant_exit_layers", "2,7"])
    (tmp_path / "long.json").write_text(json.dumps(["t1", " ".join(["t2"] * model.config.max_position_embeddings)]))
    with pytest.raises(SystemExit, match=r"prompt 2 \(\d+ tokens\) plus --max_new_tokens 10 exceeds"):
        main(["bench", *common, "--prompts", str(tmp_path / "long.json")])
    with pytest.raises(SystemExit, match="--only is an option of the Spec-Bench runs; --batch_sizes takes none"):
        main(["bench", *common, "--batch_sizes", "1", "--only", "exit"])
    with pytest.raises(SystemExit, match="--suffix_memory_tokens limits --suffix_memory"):
        main(["bench", *common, "--suffix_memory_tokens", "10"])
    with pytest.raises(SystemExit, match="not to --batch_sizes"):
        main(["bench", *common, "--suffix_memory", str(chat), "--batch_sizes", "1,2"])
    with pytest.raises(SystemExit, match="--static_vocab adds variants .* not to --workload repeated"):
        main(["bench", *common, "--static_vocab", "--workload", "repeated"])
    with pytest.raises(SystemExit, match="--fixed_trees adds variants .* not to --batch_sizes"):
        main(["bench", *common, "--fixed_trees", "--unpacked", "--batch_sizes", "1,2"])
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(tmp_path / "model")
    assert main(["bench", *common, "--repeats", "1", *memory]) == 0
    result = json.loads((tmp_path / "d" / "bench.json").read_text())
    names = [row["contender"] for row in result["results"]]
    assert names == ["generate", "selfspec suffix", "selfspec suffix, memory 6 tokens"]
    assert all(row["matched"] is True for row in result["results"][1:])  # greedy only: every answer was compared

    with pytest.raises(SystemExit, match="two ExitHeads folders"):
        main(["demo", "--model", str(tmp_path / "model"), "--heads", str(tmp_path / "exit"), "--heads",
              str(tmp_path / "exit")])  # fmt: skip


def test_tune_predicts_from_measurements_and_writes_the_defaults(model, tmp_path):
    from selfspec import load_heads
    from selfspec.measure.tune import apply_choice, prefix_acceptance, tune, tuned_card

    adapter = ModelAdapter(model)
    heads = ExitHeads(adapter.fingerprint(), [1, 3])
    prompts = [random_prompt(6, seed=5), random_prompt(11, seed=6)]
    choices, position_cost = tune(model, heads, prompts, max_new_tokens=16, max_gamma=4, timing_repeats=2)
    assert position_cost >= 0
    assert len(choices) == 2 * 4  # every exit depth with gamma 1..4
    assert [c.predicted for c in choices] == sorted((c.predicted for c in choices), reverse=True)
    for choice in choices:
        assert 1.0 <= choice.tokens_per_pass <= choice.gamma + 1
        assert choice.cost == pytest.approx(choice.v + choice.gamma * choice.c)
        assert choice.predicted == pytest.approx(choice.tokens_per_pass / choice.cost)
    by_depth = {}
    for choice in choices:
        by_depth.setdefault(choice.exit_layer, []).append(choice)
    for depth_choices in by_depth.values():  # E grows with gamma: each extra draft adds P_i >= 0
        ordered = sorted(depth_choices, key=lambda c: c.gamma)
        assert all(a.tokens_per_pass <= b.tokens_per_pass for a, b in zip(ordered, ordered[1:], strict=False))
    assert prefix_acceptance({"proposed_per_position": [10, 10], "accepted_per_position": [6, 3]}, 3) == [
        0.6,
        0.3,
        0.0,
    ]

    best = choices[0]
    apply_choice(heads, best, 0.25)
    heads.save_pretrained(tmp_path / "h", card=tuned_card("# card\n\nbody\n", "| t |", best, "selfspec tune"))
    loaded = load_heads(tmp_path / "h", adapter)
    assert loaded.exit_layer == best.exit_layer and loaded.num_draft_tokens == best.gamma
    spec = SelfSpeculative(model, heads=loaded)
    assert spec.exit_layer == best.exit_layer and spec.num_draft_tokens == best.gamma and spec.position_cost == 0.25
    card = (tmp_path / "h" / "README.md").read_text()
    assert card.startswith("# card\n\nbody") and card.count("## Tuned defaults") == 1
    again = tuned_card(card, "| u |", best, "selfspec tune")
    assert again.count("## Tuned defaults") == 1 and "| u |" in again and "| t |" not in again


def test_batch_throughput_rows_match_the_padded_batch(model):
    from selfspec.measure.bench import batch_table, batch_throughput, left_pad

    prompts = [random_prompt(3, seed=1), random_prompt(8, seed=2), random_prompt(5, seed=3)]
    ids, mask = left_pad(prompts, pad_id=0)
    assert ids.shape == (3, 8) and mask.sum(1).tolist() == [3, 8, 5] and torch.equal(ids[1], prompts[1][0])
    spec = SelfSpeculative(model, exit_layer=2)
    rows = batch_throughput(spec, prompts, [1, 4], max_new_tokens=10)
    assert [row["batch_size"] for row in rows] == [1, 4]
    for row in rows:
        assert row["matched"] is True and row["generate_tokens_per_s"] > 0 and row["selfspec_tokens_per_s"] > 0
        assert row["speedup"] == pytest.approx(row["selfspec_tokens_per_s"] / row["generate_tokens_per_s"])
    assert batch_table(rows).count("| yes |") == 2


def test_the_batch_bench_measures_the_heads_it_is_given(model, tmp_path, capsys):
    """--batch_sizes with EAGLE heads measures their chain (it took an untrained exit instead)."""
    from argparse import Namespace

    from test_eagle import eagle_heads

    from selfspec.cli.commands import run_batch_bench
    from selfspec.heads import EagleHeads

    args = Namespace(batch_sizes=[2], max_new_tokens=6, repeats=1, output=str(tmp_path))
    prompts = [random_prompt(4, seed=1), random_prompt(6, seed=2)]
    assert run_batch_bench(args, model, {EagleHeads: eagle_heads(model)}, prompts, None) == 0
    assert "selfspec: EAGLE chain, adaptive gamma" in capsys.readouterr().out
    assert json.loads((tmp_path / "bench_batch.json").read_text())["meta"]["mode"] == "EAGLE chain"


def test_compiled_contenders_run_exactly_and_are_compared_with_the_compiled_generate(model):
    """--compile: transformers' static-cache compiled generate and selfspec's compiled chains, in one run; the
    compiled plain loop is the unit of the compiled contenders' c and v."""
    from selfspec.measure.contenders import compiled_contenders

    contenders = standard_contenders(model, sampling=False, transformers_modes=False)[:2]  # generate, plain loop
    contenders += compiled_contenders(model)
    assert [c.name for c in contenders] == [
        "generate", "selfspec plain loop", "generate compiled", "selfspec plain loop compiled",
        "selfspec ngram compiled",
    ]  # fmt: skip
    prompts = [torch.cat([random_prompt(5, seed=seed)] * 3, dim=1) for seed in (1, 2)]
    rows = {row["contender"]: row for row in run_bench(contenders, prompts, max_new_tokens=12, progress=False)}
    assert all(row["matched"] is True for row in rows.values())
    assert rows["generate compiled"]["vs_compiled_generate"] == pytest.approx(1.0)
    ngram = rows["selfspec ngram compiled"]
    assert ngram["vs_compiled_generate"] == pytest.approx(
        ngram["tokens_per_s"] / rows["generate compiled"]["tokens_per_s"]
    )
    compiled_plain = next(c for c in contenders if c.name == "selfspec plain loop compiled").stats

    def per_pass(runs):  # verify seconds per pass after the prompt's, and tokens per second while decoding
        passes = sum(s["iterations"] for s in runs)
        decoding = sum(s["total_seconds"] - s["prefill_seconds"] - s["measure_seconds"] for s in runs)
        verify = sum(s["verify_seconds"] - s["prefill_seconds"] for s in runs)
        assert all(0 < s["prefill_seconds"] < s["verify_seconds"] for s in runs)
        return verify / passes, sum(s["new_tokens"] for s in runs) / decoding

    stats = next(c for c in contenders if c.name == "selfspec ngram compiled").stats
    (step, plain_rate), (pass_seconds, rate) = per_pass(compiled_plain), per_pass(stats)
    assert ngram["v"] == pytest.approx(pass_seconds / step)
    assert ngram["plain_loop_speedup"] == pytest.approx(rate / plain_rate)
    assert rows["selfspec plain loop compiled"]["v"] == pytest.approx(1.0)
    assert "vs generate compiled" in markdown_table(list(rows.values()))
    eager_only = {key: value for key, value in rows["generate"].items() if key != "vs_compiled_generate"}
    assert "vs generate compiled" not in markdown_table([eager_only])  # no column where no figure applies


def test_tune_measures_eagle_tree_budgets_and_writes_the_best_chain(model, tmp_path):
    from selfspec import load_heads
    from selfspec.heads import EagleHeads
    from selfspec.heads.eagle import TUNED_TREES
    from selfspec.measure.tune import apply_choice, tune
    from selfspec.training.config import HeadsConfig

    adapter = ModelAdapter(model)
    torch.manual_seed(0)
    heads = EagleHeads.from_config(HeadsConfig(kind="eagle"), adapter)
    prompt = random_prompt(6, seed=5)
    choices, _ = tune(model, heads, [prompt], max_new_tokens=12, max_gamma=3, timing_repeats=2)
    trees = [c for c in choices if isinstance(c.tree, dict)]
    assert sorted(c.tree["nodes"] for c in trees) == sorted(t["nodes"] for t in TUNED_TREES)
    assert len(choices) == 3 + len(TUNED_TREES)  # chains of gamma 1..3 and every tree budget
    for choice in trees:
        assert choice.gamma == choice.tree["nodes"] and 1.0 <= choice.tokens_per_pass <= choice.tree["depth"] + 1
        assert f"tree of {choice.tree['nodes']} nodes (top-{choice.tree['top_k']}" in choice.label
        expected = model.generate(prompt, max_new_tokens=12, do_sample=False)
        spec = SelfSpeculative(model, heads=heads, **choice.options())
        assert torch.equal(spec.generate(prompt, max_new_tokens=12, do_sample=False), expected)
    chain = next(c for c in choices if c.tree is None)
    apply_choice(heads, chain)
    heads.save_pretrained(tmp_path / "eagle")
    loaded = load_heads(tmp_path / "eagle", adapter)
    assert loaded.num_draft_tokens == chain.gamma and "tree" not in json.loads(
        (tmp_path / "eagle" / "config.json").read_text()
    )
    assert SelfSpeculative(model, heads=loaded).drafter.tree is None  # the head's default stays a chain


def test_only_keeps_a_whole_name_with_commas_or_each_comma_separated_part():
    from types import SimpleNamespace

    from selfspec.cli.commands import only_kept

    def named(name: str, baseline: bool = False) -> SimpleNamespace:
        return SimpleNamespace(name=name, baseline=baseline)

    memory = "merged ngram 6 + suffix 6, memory 2,986,068 tokens + eagle tree 3-3-1"
    wide = memory.replace("3-3-1", "5-5-1")
    contenders = [named("generate", True), named(memory), named(wide), named("eagle chain 3")]
    kept = lambda only: [c.name for c in only_kept(SimpleNamespace(only=only), contenders)]  # noqa: E731
    assert kept(memory) == ["generate", memory]  # one contender by its whole name, commas and all
    assert kept("chain 3,5-5-1") == ["generate", wide, "eagle chain 3"]
    assert kept(" memory 2,986,068 ") == ["generate", memory, wide]
    with pytest.raises(SystemExit, match="names no contender"):
        only_kept(SimpleNamespace(only="3-3-1, medusa"), contenders[:1] + contenders[3:])
