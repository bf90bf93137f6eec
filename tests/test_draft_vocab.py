"""A reduced draft vocabulary: drafts come from a subset of the LM head's rows, output stays exact."""

from __future__ import annotations

import json

import pytest
import torch
from test_batch import assert_rows_exact
from test_eagle import eagle_heads
from test_medusa import medusa_heads
from tiny_models import random_prompt, tiny_model

from selfspec import SelfSpeculative, frequent_tokens
from selfspec.adapter import CallVocabulary, ModelAdapter


@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
def test_greedy_with_a_reduced_or_int8_draft_head_matches_generate(arch, quant):
    model = tiny_model(arch)
    subset = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(0))[:40]
    prompt = random_prompt(6, seed=4)
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
    tree = [[0], [1], [0, 0], [0, 0, 0]]
    for options in ({"exit_layer": 2, "num_draft_tokens": 3, "draft_vocab": subset}, {"exit_layer": 1},
                    {"heads": medusa_heads(model), "tree": [], "draft_vocab": subset},
                    {"heads": medusa_heads(model), "tree": tree, "draft_vocab": subset}):  # fmt: skip
        spec = SelfSpeculative(model, draft_quant=quant, **options)
        if quant == "int8":
            assert spec.drafter.vocab.weight.dtype == torch.int8
        assert torch.equal(spec.generate(prompt, max_new_tokens=30, do_sample=False), expected), options
        assert spec.stats.proposed > 0


def test_drafts_stay_inside_the_draft_vocabulary():
    model = tiny_model("llama")
    subset = [3, 5, 7, 11, 13]
    spec = SelfSpeculative(model, exit_layer=2, num_draft_tokens=4, draft_vocab=subset)
    hidden = torch.randn(2, model.config.hidden_size)
    logits = spec.drafter.exit_logits(hidden)
    assert logits.shape == (2, model.config.vocab_size)
    outside = torch.ones(model.config.vocab_size, dtype=torch.bool)
    outside[subset] = False
    assert torch.isneginf(logits[:, outside]).all() and torch.isfinite(logits[:, ~outside]).all()
    full = SelfSpeculative(model, exit_layer=2).drafter.exit_logits(hidden)
    torch.testing.assert_close(logits[:, subset], full[:, subset])  # the same rows of the same LM head
    assert spec.draft_cost < SelfSpeculative(model, exit_layer=2).draft_cost


def test_draft_vocabulary_errors():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="token ids from 0 to 95"):
        SelfSpeculative(model, draft_vocab=[1, 96])
    with pytest.raises(ValueError, match="token ids from 0 to 95"):
        SelfSpeculative(model, draft_vocab=[])
    with pytest.raises(ValueError, match=r"lists a negative token id \(-5\): token ids run from 0"):
        SelfSpeculative(model, draft_vocab=[0, -5, 3])  # not "made for another target"
    with pytest.raises(ValueError, match="apply to the shared LM head; these Medusa heads have their own"):
        SelfSpeculative(model, heads=medusa_heads(model, own_lm_head=True), draft_vocab=[1, 2])


def test_draft_vocab_from_a_json_file(tmp_path):
    model = tiny_model("llama")
    subset = [3, 5, 7, 11, 13]
    (tmp_path / "vocab.json").write_text(json.dumps(subset))
    assert ModelAdapter(model).draft_vocabulary(tmp_path / "vocab.json").ids.tolist() == subset
    prompt = random_prompt(5, seed=2)
    spec = SelfSpeculative(model, exit_layer=2, draft_vocab=str(tmp_path / "vocab.json"))  # a path, as the CLI takes
    assert torch.equal(spec.generate(prompt, max_new_tokens=12), model.generate(prompt, max_new_tokens=12))
    with pytest.raises(FileNotFoundError, match="draft_vocab: no file at .*missing.json"):
        SelfSpeculative(model, draft_vocab=tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"ids": [1, 2]}')
    with pytest.raises(ValueError, match="bad.json must hold one JSON list of integer token ids"):
        SelfSpeculative(model, draft_vocab=tmp_path / "bad.json")


def test_frequent_tokens():
    ids = torch.tensor([[5, 5, 5, 2, 2, 9], [5, 2, 1, 1, 1, 1]])
    assert frequent_tokens(ids, 2).tolist() == [1, 5]  # 1 (4 times) and 5 (4 times), sorted by id
    assert frequent_tokens(ids, 1, always=[9]).tolist() == [1, 9]
    assert frequent_tokens([ids[0], ids[1]], 3).tolist() == [1, 2, 5]
    for count in (0, -1):  # a slice [:-1] kept every id seen but the rarest one
        with pytest.raises(ValueError, match=f"count must be a positive number of ids, got {count}"):
            frequent_tokens(ids, count)


@pytest.mark.parametrize("count", ["0", "-5"])
def test_make_draft_vocab_refuses_a_count_below_one_before_loading_the_target(count, monkeypatch, tmp_path, capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
    import make_draft_vocab

    def load_model(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(make_draft_vocab, "load_model", load_model)
    out = tmp_path / "vocab.json"
    argv = ["make_draft_vocab.py", "--data", str(tmp_path / "chat.jsonl"), "--out", str(out), "--count", count]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as stopped:
        make_draft_vocab.main()
    assert stopped.value.code == 2 and f"argument --count: must be 1 or more, got {count}" in capsys.readouterr().err
    assert not out.exists()


# ------------------------------------------------------------------------------ int8 draft LM head


def test_int8_draft_head_is_close_to_the_full_head_and_cheaper():
    model = tiny_model("llama")
    full = SelfSpeculative(model, exit_layer=2)
    int8 = SelfSpeculative(model, exit_layer=2, draft_quant="int8")
    hidden = torch.randn(3, model.config.hidden_size)
    exact, quantised = full.drafter.exit_logits(hidden), int8.drafter.exit_logits(hidden)
    assert not torch.equal(exact, quantised)  # the int8 path is the one taken
    error = (exact - quantised).abs().max() / exact.abs().max()
    assert error < 0.02, f"int8 logits off by {error:.3%} of their range"
    assert int8.draft_cost < full.draft_cost


def test_int8_draft_head_errors():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="draft_quant must be None or 'int8', got 'int4'"):
        SelfSpeculative(model, draft_quant="int4")
    with pytest.raises(ValueError, match="draft_vocab and draft_quant apply to the shared LM head"):
        SelfSpeculative(model, heads=medusa_heads(model, own_lm_head=True), draft_quant="int8")


def test_profile_reports_the_alpha_and_c_of_a_draft_head():
    from selfspec.adapter import ModelAdapter
    from selfspec.heads import ExitHeads
    from selfspec.measure.profile import format_table, profile_heads
    from selfspec.training.config import EvalConfig

    model = tiny_model("llama")
    adapter = ModelAdapter(model)
    heads = ExitHeads(adapter.fingerprint(), [1, 2])
    rows = torch.randint(0, model.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
    config = EvalConfig(max_rows=4, batch_size=2, timing_context=8, timing_repeats=2, max_gamma=2)
    every = profile_heads(model, heads, rows, config, vocab=adapter.draft_vocabulary(range(model.config.vocab_size)))
    for row in every:  # all rows of the head, unquantised: the same q as the model's own head
        assert row["draft_alpha"] == pytest.approx(row["alpha"], abs=1e-6) and row["draft_top1"] == row["top1"]
    int8 = profile_heads(model, heads, rows, config, vocab=adapter.draft_vocabulary(None, "int8"))
    for row in int8:
        assert row["draft_alpha"] != row["alpha"] and abs(row["draft_alpha"] - row["alpha"]) < 0.02, row
        assert row["draft_c"] > 0
    assert "alpha, draft head" in format_table(int8) and "c, draft head" in format_table(int8)


# ------------------------------------------------------------------------------ a call's own tokens join it


def recorded_drafts(spec) -> set[int]:
    """The tokens `spec`'s drafter proposes from now on (its `draft` wrapped), filled in as it drafts."""
    drafted, draft = set(), spec.drafter.draft

    def recording(state, gamma, process, do_sample):
        proposal = draft(state, gamma, process, do_sample)
        drafted.update(proposal.tokens.flatten().tolist())
        return proposal

    spec.drafter.draft = recording
    return drafted


@pytest.mark.parametrize("quant", [None, "int8"])
def test_a_calls_tokens_join_the_vocabulary_as_the_lm_heads_rows(quant):
    model = tiny_model("llama")
    adapter = ModelAdapter(model)
    hidden = torch.randn(3, model.config.hidden_size)
    subset = adapter.draft_vocabulary([9, 4, 30], quant, context=True)
    call = CallVocabulary(subset, adapter.lm_head)
    call.begin(torch.tensor([[30, 7, 7, 2], [4, 2, 50, 9]]))
    assert call.current.ids.tolist() == [4, 9, 30, 2, 7, 50]  # the subset sorted, then the prompts' new tokens
    call.follow(torch.tensor([[30, 7, 7, 2, 11], [4, 2, 50, 9, 4]]))  # one more position: 11 joins
    call.follow(torch.tensor([[30, 7, 7, 2, 11], [4, 2, 50, 9, 4]]))  # nothing new
    joined = call.current
    assert joined.ids.tolist() == [4, 9, 30, 2, 7, 50, 11] and subset.ids.tolist() == [4, 9, 30]
    every = adapter.draft_vocabulary(None, quant)  # the whole head, as these rows are taken
    logits, full = adapter.lm_logits(hidden, vocab=joined), adapter.lm_logits(hidden, vocab=every)
    inside = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    inside[joined.ids] = True
    tolerance = 2e-2 if quant else 1e-5  # a product over other rows may round differently; int8 runs in bfloat16
    torch.testing.assert_close(logits[:, inside], full[:, inside], rtol=tolerance, atol=tolerance)
    assert torch.isneginf(logits[:, ~inside]).all()
    call.begin(torch.tensor([[4, 9]]))  # a new call starts from the subset again
    assert call.current is subset
    assert call.follow(torch.tensor([[4, 9, 7]])).ids.tolist() == [4, 9, 30, 7]  # joined again in this call
    for vocabulary in (adapter.draft_vocabulary([9, 4, 30], quant), subset.compacted()):  # context off; training's
        static = CallVocabulary(vocabulary, adapter.lm_head)
        static.begin(torch.tensor([[7, 50]]))
        assert static.current is vocabulary


@pytest.mark.parametrize("quant", [None, "int8"])
def test_a_joined_vocabulary_over_every_token_keeps_each_tokens_logit(quant):
    """Joined rows follow the subset's, so ids covering the whole vocabulary are still out of token order: each
    logit must land on its own token, not pass through as if sorted."""
    model = tiny_model("llama")
    adapter, size = ModelAdapter(model), model.config.vocab_size
    call = CallVocabulary(adapter.draft_vocabulary([size - 1, 3], quant, context=True), adapter.lm_head)
    call.begin(torch.arange(size)[None, :])
    assert call.current.ids.numel() == size and call.current.ids[:2].tolist() == [3, size - 1]
    hidden = torch.randn(2, model.config.hidden_size)
    joined, full = adapter.lm_logits(hidden, vocab=call.current), adapter.lm_logits(hidden, vocab=None)
    tolerance = 2e-2 if quant else 1e-5
    torch.testing.assert_close(joined, full, rtol=tolerance, atol=tolerance)


def test_the_prompts_padding_does_not_join_the_vocabulary():
    model = tiny_model("llama")
    adapter = ModelAdapter(model)
    call = CallVocabulary(adapter.draft_vocabulary([9, 4], context=True), adapter.lm_head)
    call.begin(torch.tensor([[0, 0, 7, 2], [5, 6, 7, 2]]), mask=torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))
    assert call.current.ids.tolist() == [4, 9, 2, 5, 6, 7]  # 0, the first row's padding, is not drafted
    assert call.follow(torch.tensor([[0, 0, 7, 2, 0], [5, 6, 7, 2, 8]])).ids.tolist()[-2:] == [0, 8]  # answered: joins


@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
def test_drafts_come_from_the_vocabulary_and_the_calls_tokens_and_output_stays_exact(arch, quant):
    model = tiny_model(arch)
    subset = list(range(40, 60))  # not the tokens the untrained exit drafts most, or the tiny gemma2 repeats
    prompt = random_prompt(12, seed=5)
    expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
    static = SelfSpeculative(model, exit_layer=2, num_draft_tokens=3, draft_vocab=subset, draft_quant=quant,
                             draft_vocab_context=False)  # fmt: skip
    joined = SelfSpeculative(model, exit_layer=2, num_draft_tokens=3, draft_vocab=subset, draft_quant=quant)
    drafted = {name: recorded_drafts(spec) for name, spec in (("static", static), ("joined", joined))}
    for spec in (static, joined):
        assert torch.equal(spec.generate(prompt, max_new_tokens=40, do_sample=False), expected)
    call = set(expected.flatten().tolist())
    assert drafted["static"] <= set(subset)
    assert drafted["joined"] <= set(subset) | call and drafted["joined"] - set(subset)  # the call's own tokens
    assert joined.stats.accepted > static.stats.accepted


def test_batched_rows_with_a_joined_vocabulary_are_exact():
    model = tiny_model("llama")
    spec = SelfSpeculative(model, exit_layer=2, num_draft_tokens=3, draft_vocab=list(range(3, 23)))
    assert_rows_exact(model, spec, [3, 9, 5, 1])  # each row's tokens join one vocabulary for the batch
    assert spec.stats.proposed > 0


@pytest.mark.parametrize("tree", [None, {"nodes": 6, "top_k": 2, "depth": 3}])
def test_eagle_chains_and_trees_draft_from_the_joined_vocabulary(tree):
    model = tiny_model("llama")
    prompt = random_prompt(10, seed=7)
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
    spec = SelfSpeculative(model, heads=eagle_heads(model), tree=tree, draft_vocab=list(range(3, 13)))
    assert torch.equal(spec.generate(prompt, max_new_tokens=30, do_sample=False), expected)
    assert spec.stats.proposed > 0


def test_the_bench_runs_static_vocabulary_copies_of_contenders_that_join_it():
    from selfspec.measure.contenders import generate_contender, selfspec_contender, static_vocab_contenders

    model = tiny_model("llama")
    subset = list(range(40, 60))
    contenders = [
        generate_contender(model, "generate", False, 1.0),
        selfspec_contender(model, "exit", False, 1.0, exit_layer=2, num_draft_tokens=3, draft_vocab=subset),
        selfspec_contender(
            model, "exit, static", False, 1.0, exit_layer=2, draft_vocab=subset, draft_vocab_context=False
        ),
        selfspec_contender(model, "exit, whole head", False, 1.0, exit_layer=2),
    ]
    (static,) = static_vocab_contenders(contenders)
    assert static.name == "exit (static vocab)"
    assert static.options == {
        "exit_layer": 2,
        "num_draft_tokens": 3,
        "draft_vocab": subset,
        "draft_vocab_context": False,
    }
    prompt = random_prompt(12, seed=5)
    assert torch.equal(static.run(prompt, 30), contenders[1].run(prompt, 30))
    assert static.spec.stats.accepted < contenders[1].spec.stats.accepted  # the prompt's tokens help here
    with pytest.raises(TypeError, match="draft_vocab_context='yes'"):
        SelfSpeculative(model, exit_layer=2, draft_vocab=subset, draft_vocab_context="yes")
