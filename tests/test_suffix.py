"""Suffix drafting: the index finds the longest earlier match and its most frequent continuation, the cache across
calls is bounded and evicts the least recently used, and generation stays exact (greedy token-identical to
`model.generate` on four families, batches included; sampling distributed as the target's law)."""

from __future__ import annotations

import pytest
import torch
from test_sampling_exactness import ROWS, chi_square_pvalue, exact_law, sampled_counts
from test_sampling_exactness import model as sampling_model  # noqa: F401  (the 4-token model fixture)
from tiny_models import chat_tokenizer, padded_prompts, random_prompt, tiny_model

from selfspec import NGramDrafter, SelfSpeculative, SuffixDrafter
from selfspec.drafters.suffix import SuffixIndex, best_continuation, continuation_tree


def test_the_index_finds_the_longest_match_and_its_occurrences():
    index = SuffixIndex()
    first = index.add([1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3, 4, 8])
    length, found = index.candidates([6, 7, 2, 3], max_match=8, max_candidates=10)
    # "7 2 3" occurs once (at 8..10, followed by 4); "2 3" alone three times
    assert length == 3 and [(uid, after) for _, after, uid in found] == [(first, 11)]
    length, found = index.candidates([0, 2, 3], max_match=8, max_candidates=10)
    assert length == 2 and [after for _, after, _ in found] == [11, 7, 3]  # most recent first
    assert index.candidates([0, 2, 3], max_match=8, max_candidates=2)[1][-1][1] == 7  # capped
    assert index.candidates([11, 12], max_match=8, max_candidates=10) == (0, [])
    assert index.candidates([6, 8], 8, 10)[0] == 0  # 8 ends the text: nothing followed it
    assert index.candidates([6, 9], 8, 10)[0] == 1  # a single token matches when no pair does


def test_the_last_token_matches_where_its_pair_occurred_only_without_a_successor():
    """The text being generated always ends with its own last pair: where that pair occurred nowhere else, its last
    token's earlier occurrences are the match, as where no pair occurred at all (an earlier answer's last pair too)."""
    from selfspec.measure.replay import OneRow

    index = SuffixIndex()
    text = [3, 4, 5, 9, 7, 5]  # the pair 7 5 only at its end; 5 alone at 2, followed by 9
    uid = index.add(text)
    assert index.candidates(text, max_match=8, max_candidates=10) == (1, [(index.sequences[uid], 3, uid)])
    index.add([8, 7, 5])  # an answer that ends with 7 5
    assert index.candidates([1, 7, 5], max_match=8, max_candidates=10)[0] == 1
    drafter = SuffixDrafter(max_cached_requests=0)
    drafter.begin(OneRow(text), None)
    assert drafter.available(OneRow(text))
    assert drafter.draft(OneRow(text), 4, None, False).tokens.tolist() == [[9]]


def test_a_match_is_at_most_max_match_tokens_long():
    """max_match_length=1 matches the last token alone: its drafts are at most max_spec_factor tokens long."""
    from selfspec.measure.replay import OneRow

    text = [5, 6, 9, 5, 6]
    index = SuffixIndex()
    index.add(text)
    assert index.candidates(text, max_match=1, max_candidates=10)[0] == 1
    assert index.candidates(text, max_match=2, max_candidates=10)[0] == 2
    drafter = SuffixDrafter(max_match_length=1, max_cached_requests=0)
    drafter.begin(OneRow(text), None)
    assert drafter.available(OneRow(text))
    assert drafter.draft(OneRow(text), 8, None, False).tokens.tolist() == [[9]]


def test_the_most_frequent_continuation_is_drafted_while_it_is_likely():
    index = SuffixIndex()
    for text in ([5, 1, 2, 3], [5, 1, 2, 3], [5, 1, 2, 4], [5, 1, 7, 7]):
        index.add(text)
    length, found = index.candidates([5, 1], max_match=4, max_candidates=10)
    assert length == 2 and len(found) == 4
    tokens, probability = best_continuation(found, depth=3, min_token_prob=0.1)
    assert tokens == [2, 3] and probability == pytest.approx(3 / 4 * 2 / 3)
    assert best_continuation(found, depth=3, min_token_prob=0.6)[0] == [2]  # 3/4 then 1/2 < 0.6: stop
    assert best_continuation(found, depth=3, min_token_prob=0.9)[0] == []


def test_the_tree_keeps_the_most_likely_continuations_parents_first():
    index = SuffixIndex()
    for text in ([5, 1, 2, 3], [5, 1, 2, 3], [5, 1, 2, 4], [5, 1, 7, 7]):
        index.add(text)
    _, found = index.candidates([5, 1], max_match=4, max_candidates=10)
    # 2 (3/4), then 2-3 (2/4), 7 and 2-4 and 7-7 (1/4 each): ranks among kept siblings, most frequent first
    assert continuation_tree(found, depth=2, nodes=3, min_token_prob=0.1) == {(0,): 2, (0, 0): 3, (1,): 7}
    assert continuation_tree(found, depth=2, nodes=9, min_token_prob=0.1) == {
        (0,): 2,
        (0, 0): 3,
        (1,): 7,
        (0, 1): 4,
        (1, 0): 7,
    }
    assert continuation_tree(found, depth=2, nodes=9, min_token_prob=0.3) == {(0,): 2, (0, 0): 3}


def test_the_text_being_generated_repeats_with_its_period():
    index = SuffixIndex()
    uid = index.add([8, 1, 2, 3, 1, 2])
    _, found = index.candidates([3, 1, 2], max_match=4, max_candidates=4)
    sequence = index.sequences[uid]
    tokens, _ = best_continuation(found, depth=5, min_token_prob=0.1, period_of=lambda o: len(sequence) - o[1])
    assert tokens == [3, 1, 2, 3, 1]


def test_the_cache_is_bounded_and_evicts_the_least_recently_used():
    model = tiny_model("llama")
    drafter = SuffixDrafter(max_cached_tokens=60, max_cached_requests=3)
    spec = SelfSpeculative(model, drafter=drafter)
    for seed in range(5):
        spec.generate(random_prompt(6, seed=seed), max_new_tokens=20, do_sample=False)
        assert drafter.cache.tokens <= 60 and len(drafter.cache) <= 3
    assert len(drafter.cache) == 3 and drafter.cache.tokens == 60
    uids = list(drafter.cache.sequences)
    drafter.cache.touch(uids[0])
    drafter.cache.add([1] * 20)
    while drafter.cache.tokens > 60:
        drafter.cache.drop(next(iter(drafter.cache.sequences)))
    assert uids[0] in drafter.cache.sequences and uids[1] not in drafter.cache.sequences
    assert drafter.cache.nbytes() > 0
    drafter.clear_cache()
    assert len(drafter.cache) == 0 and drafter.cache.tokens == 0 and drafter.cache.nbytes() < 1000
    off = SuffixDrafter(max_cached_requests=0)
    SelfSpeculative(model, drafter=off).generate(random_prompt(6), max_new_tokens=10)
    assert len(off.cache) == 0


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "gpt_neox"])
def test_suffix_greedy_matches_generate_and_learns_across_calls(arch):
    model = tiny_model(arch)
    repetitive = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6]])
    spec = SelfSpeculative(model, drafter="suffix", position_cost=0.0)
    for prompt in (random_prompt(12, seed=3), repetitive):
        expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
        assert torch.equal(spec.generate(prompt, max_new_tokens=40, do_sample=False), expected), arch
    prompt = random_prompt(9, seed=11)
    expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
    fresh = SelfSpeculative(model, drafter=SuffixDrafter(max_cached_requests=0), position_cost=0.0)
    assert torch.equal(fresh.generate(prompt, max_new_tokens=40, do_sample=False), expected)
    assert torch.equal(spec.generate(prompt, max_new_tokens=40, do_sample=False), expected)
    assert torch.equal(spec.generate(prompt, max_new_tokens=40, do_sample=False), expected)
    # the second time, the answer is in the cache: it is drafted from there, in long accepted runs
    assert spec.stats.accepted >= 30 and spec.stats.tokens_per_pass > fresh.stats.tokens_per_pass


def test_suffix_batch_rows_are_exact():
    model = tiny_model("qwen2")
    ids, mask = padded_prompts([3, 11, 7])
    ids[1, -5:] = ids[1, -10:-5]  # a row that repeats itself
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    spec = SelfSpeculative(model, drafter="suffix")
    for _ in range(2):  # the second call drafts from the first's answers too
        actual = spec.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
        assert torch.equal(actual, expected)
    assert len(spec.drafter.cache) == 6


def test_suffix_hybrid_with_heads_is_exact():
    from test_medusa import medusa_heads

    model = tiny_model("llama")
    prompt = random_prompt(10, seed=4)
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
    spec = SelfSpeculative(model, drafter=["suffix", "heads"], heads=medusa_heads(model, num_heads=3), tree=[])
    assert [part.name for part in spec.drafters][0] == "suffix"
    for _ in range(2):
        assert torch.equal(spec.generate(prompt, max_new_tokens=30, do_sample=False), expected)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_suffix_tree_greedy_matches_generate(arch):
    model = tiny_model(arch)
    spec = SelfSpeculative(model, drafter=SuffixDrafter(num_speculative_tokens=6, tree_nodes=8))
    assert spec.drafter.tree.max_depth == 6
    for seed in (3, 3, 5):  # the second call drafts its trees from the first's answer
        prompt = random_prompt(12, seed=seed)
        expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
        assert torch.equal(spec.generate(prompt, max_new_tokens=40, do_sample=False), expected), arch
    assert spec.stats.proposed > 0


def test_suffix_tree_sampling_is_distributed_as_the_target(sampling_model):  # noqa: F811
    spec = SelfSpeculative(sampling_model, drafter=SuffixDrafter(num_speculative_tokens=2, tree_nodes=3))
    assert chi_square_pvalue(sampled_counts(spec), exact_law(sampling_model)) > 1e-3


def test_suffix_sampling_is_distributed_as_the_target(sampling_model):  # noqa: F811
    spec = SelfSpeculative(sampling_model, drafter=SuffixDrafter(num_speculative_tokens=2), position_cost=0.0)
    counts = sampled_counts(spec, rows=ROWS)  # every call learns from the earlier samples: drafts from the cache too
    assert chi_square_pvalue(counts, exact_law(sampling_model)) > 1e-3


def test_suffix_settings_are_checked():
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        SuffixDrafter(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="min_token_prob=2"):
        SuffixDrafter(min_token_prob=2)
    with pytest.raises(ValueError, match="max_cached_tokens=-1"):
        SuffixDrafter(max_cached_tokens=-1)
    with pytest.raises(ValueError, match="drafter='suffix' drafts without the model"):
        SelfSpeculative(tiny_model("llama"), drafter="suffix", exit_layer=2)


def test_an_infinite_spec_factor_drafts_up_to_num_speculative_tokens():
    """max_spec_factor is checked as a positive number, so inf (no bound per matched token) is taken: it drafts."""
    from selfspec.measure.replay import OneRow

    text = [5, 6, 7, 8, 9, 5, 6]
    drafter = SuffixDrafter(num_speculative_tokens=4, max_spec_factor=float("inf"), max_cached_requests=0)
    drafter.begin(OneRow(text), None)
    assert drafter.available(OneRow(text))
    assert drafter.draft(OneRow(text), 4, None, False).tokens.tolist() == [[7, 8, 9, 5]]


def test_a_drafter_listed_twice_is_refused():
    """One drafter at two places of the list would hear every call twice: its memory would keep each answer twice."""
    model = tiny_model("llama")
    drafter = SuffixDrafter()
    with pytest.raises(ValueError, match="the same suffix drafter is listed twice"):
        SelfSpeculative(model, drafter=[drafter, "ngram", drafter])
    spec = SelfSpeculative(model, drafter=[drafter, SuffixDrafter()])  # two drafters: each remembers the answer once
    spec.generate(random_prompt(5), max_new_tokens=10, do_sample=False)
    assert len(drafter.cache) == 1 and len(spec.drafters[1].cache) == 1


def test_remembered_token_ids_must_be_the_models():
    """The cache's drafts are not range-checked each iteration: ids outside the vocabulary are refused where
    they come in, by `remember` or when a drafter that remembers them wraps a model."""
    model = tiny_model("llama")
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match="token id -3 is not in the model's vocabulary"):
        SuffixDrafter().remember([[5, -3]])
    drafter = SuffixDrafter()
    drafter.remember([[5, 6, vocab + 4]])  # no model yet: the id may be right for another
    with pytest.raises(ValueError, match=f"remembers token id {vocab + 4}, but the model has {vocab} tokens"):
        SelfSpeculative(model, drafter=drafter)
    drafter.clear_cache()
    spec = SelfSpeculative(model, drafter=drafter)
    with pytest.raises(ValueError, match=f"token id {vocab} is not in the model's vocabulary \\({vocab} tokens\\)"):
        drafter.remember([[5, 6, vocab]])
    prompt = random_prompt(6)
    expected = model.generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(spec.generate(prompt, max_new_tokens=10, do_sample=False), expected)
    SelfSpeculative(model, drafter=drafter)  # the same vocabulary again
    # a larger one would remember ids out of the first model's range, which its drafts would then propose
    with pytest.raises(ValueError, match=f"already drafts for a model of {vocab} tokens, and this model has 120"):
        SelfSpeculative(tiny_model("llama", vocab_size=120), drafter=drafter)


def test_bench_keeps_a_prompts_own_earlier_answers_out_of_the_memory():
    from selfspec.measure.bench import OwnAnswers, run_bench
    from selfspec.measure.contenders import generate_contender, selfspec_contender

    model = tiny_model("llama")
    prompts = [random_prompt(8, seed=1), random_prompt(8, seed=2)]
    suffix = selfspec_contender(model, "selfspec suffix", False, 1.0, drafter="suffix")
    memory = suffix.spec.drafter.cache
    answers = OwnAnswers([suffix])
    with answers.kept(suffix, 0):
        suffix.run(prompts[0], 10)
    with answers.kept(suffix, 1):
        suffix.run(prompts[1], 10)
    assert len(memory) == 2
    answers.forget(suffix, 0)  # before prompt 0 runs again: its own answer goes, prompt 1's stays
    assert [list(s) for s in memory.sequences.values()] == [suffix.run(prompts[1], 10)[0, 8:].tolist()][:1]
    fresh = selfspec_contender(model, "selfspec suffix", False, 1.0, drafter="suffix")
    rows = run_bench([generate_contender(model, "generate", False, 1.0), fresh], prompts, 10, repeats=2)
    # the warm-up's answer and the first repeat's went before each prompt ran again: the last answer to each is left
    assert rows[1]["matched"] is True and len(fresh.spec.drafter.cache) == 2


def test_chat_answers_are_the_assistant_turns_as_generated(tmp_path):
    import gzip
    import json

    from selfspec.chat import chat_answers

    rows = [
        {"messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4 w5"}]},
        {"messages": [{"role": "user", "content": "w6"}, {"role": "assistant", "content": "w7"},
                      {"role": "user", "content": "w8"}, {"role": "assistant", "content": "w9 w10"}]},
    ]  # fmt: skip
    path = tmp_path / "chat.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as file:
        file.write("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = chat_tokenizer()
    # each answer's tokens and the end of its turn, nothing of the prompts or the template after it
    assert chat_answers(path, tokenizer) == [[9, 10, 11, 2], [13, 2], [15, 16, 2]]
    assert chat_answers(path, tokenizer, max_tokens=3) == [[9, 10, 11, 2]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "w1"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="row 1 has no chat `messages`"):
        chat_answers(bad, tokenizer)
    bad.write_text("{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match="row 1 is not JSON"):
        chat_answers(bad, tokenizer)
    with pytest.raises(ValueError, match="max_tokens=0 must be a positive"):
        chat_answers(path, tokenizer, max_tokens=0)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        chat_answers(path, tokenizer)


def test_remembered_answers_are_drafted_from_within_the_bound_and_stay_exact():
    model = tiny_model("llama")
    prompt = random_prompt(9, seed=5)
    expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
    answer = expected[0, 9:]
    cold = SelfSpeculative(model, drafter=SuffixDrafter(max_cached_requests=0), position_cost=0.0)
    assert torch.equal(cold.generate(prompt, max_new_tokens=40, do_sample=False), expected)
    drafter = SuffixDrafter(max_cached_tokens=100)
    assert drafter.remember([answer, [1, 2, 3]]) == 43
    warm = SelfSpeculative(model, drafter=drafter, position_cost=0.0)
    assert torch.equal(warm.generate(prompt, max_new_tokens=40, do_sample=False), expected)
    # the remembered answer is drafted from: long accepted runs, more tokens per pass than without it
    assert warm.stats.accepted >= 30 and warm.stats.tokens_per_pass > cold.stats.tokens_per_pass
    assert drafter.remember([[7] * 60]) <= 100 and len(drafter.cache) == 2  # the least recently used went
    kept = [list(sequence) for sequence in drafter.cache.sequences.values()]
    assert drafter.remember([[7] * 101]) == 100  # longer than the bound: not kept, and nothing evicted for it
    assert [list(sequence) for sequence in drafter.cache.sequences.values()] == kept
    with pytest.raises(ValueError, match="a list of answers"):
        drafter.remember([5, 6, 7])
    for off in ({"max_cached_requests": 0}, {"max_cached_tokens": 0}):
        with pytest.raises(ValueError, match="cache is off"):
            SuffixDrafter(**off).remember([[1, 2]])


def test_the_texts_own_match_wins_unless_the_caches_is_cache_margin_longer():
    from selfspec.drafters.suffix import CACHE_MARGIN
    from selfspec.measure.replay import OneRow

    own = [50, 1, 2, 99, 1, 2]  # its end, 1 2, matches its own start for 2 tokens: 99 follows there

    def first_draft(cached):
        drafter = SuffixDrafter(max_spec_factor=4.0)
        drafter.remember([cached])
        drafter.begin(OneRow(own), None)
        assert drafter.available(OneRow(own))
        return drafter.draft(OneRow(own), 1, None, False).tokens[0, 0].item()

    assert CACHE_MARGIN == 4
    assert first_draft([1, 2, 99, 1, 2, 77]) == 99  # the cache matches 5 tokens: 3 more, the text's own wins
    assert first_draft([50, 1, 2, 99, 1, 2, 77]) == 77  # 6 tokens: 4 more, the cache's
    assert first_draft([3, 1, 2, 77]) == 99  # as long as the text's own: the text's


@pytest.mark.parametrize("make", [lambda: SuffixDrafter(num_speculative_tokens=5), lambda: NGramDrafter(5)])
def test_a_replay_counts_the_passes_of_a_fixed_gamma_run(make):
    from selfspec.measure.replay import record_answers, replay

    model = tiny_model("llama")
    repetitive = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6]])
    prompts = [random_prompt(12, seed=3), repetitive, random_prompt(9, seed=11), random_prompt(9, seed=11)]
    records = record_answers(model, prompts, 30, categories=["a", "b", "a", "a"])
    spec = SelfSpeculative(model, drafter=make(), num_draft_tokens=4, adaptive=False)
    tokens = passes = 0
    for prompt, record in zip(prompts, records, strict=True):
        output = spec.generate(prompt, max_new_tokens=30, do_sample=False)
        assert output[0, prompt.shape[1] :].tolist() == record.answer
        tokens, passes = tokens + spec.stats.new_tokens, passes + spec.stats.target_passes
    replayed = make()
    result = replay(replayed, records, 30, gamma=4)
    assert (result["tokens"], result["passes"]) == (tokens, passes)
    if isinstance(replayed, SuffixDrafter):  # the memory holds what a run leaves there: whole answers
        memory = [list(sequence) for sequence in replayed.cache.sequences.values()]
        assert memory == [list(sequence) for sequence in spec.drafter.cache.sequences.values()]
        assert sorted(memory) == sorted(record.answer for record in records)  # in least-recently-used order
    assert replay(make(), records, 5, gamma=4)["tokens"] == 5 * len(records)  # answers cut at max_new_tokens
    assert result["tokens_per_pass"] > 1.2 and set(result["by_category"]) == {"a", "b"}
    with pytest.raises(ValueError, match="model-free chain drafter"):
        replay(SuffixDrafter(tree_nodes=4), records, 30)
