"""Numerical robustness end to end, with tiny models on CPU.

- bfloat16 and float16 models, greedy and sampling, in every drafting mode (early exit, Medusa chain,
  Medusa tree);
- logits with -inf (a processor that bans half the vocabulary, `bad_words_ids`, top_k=1, a tiny top_p,
  a very low temperature) in every mode and in a batch of 3: no banned token ever comes out, greedy
  output equals `model.generate`, and top_k=1 / tiny top_p sampling equals greedy decoding;
- every distribution handed to the sampler (`selfspec.engine.verify.draw`) is finite, non-negative and not all zero;
- the same seed gives the same sampled output;
- clear errors for prompts and arguments that cannot be honoured (what test_generate_contract.py and
  test_wrapper.py do not already cover).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_medusa import TREE as MEDUSA_TREE
from test_medusa import FutureOracle, medusa_heads
from tiny_models import padded_prompts, random_prompt, tiny_config, tiny_model
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

from selfspec import SelfSpeculative, UnsupportedGenerationArgument

VOCAB = 96
PAD = 0
TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
MODES = ["early_exit", "medusa_chain", "medusa_tree"]
NEW_TOKENS = 24


def make_spec(model, mode: str, heads=None) -> SelfSpeculative:
    if mode == "early_exit":
        return SelfSpeculative(model, exit_layer=2, num_draft_tokens=3)
    heads = heads if heads is not None else medusa_heads(model, num_heads=3)
    if mode == "medusa_chain":
        return SelfSpeculative(model, heads=heads, num_draft_tokens=3)
    return SelfSpeculative(model, heads=heads, tree=TREE, adaptive=False)


class Lookahead(BaseStreamer):
    """Stands in for well-trained Medusa heads, so that drafts are often accepted. It follows the committed
    tokens (as the streamer: the prompt, then each commit, the pending token included) and proposes the
    target's own greedy continuation of them with the `banned` tokens masked: at rank 0, or just below a
    random top token at every third position, so that sibling branches are taken too."""

    def __init__(self, model, num_heads: int, banned: set[int]):
        self.model, self.num_heads, self.banned, self.sequence = model, num_heads, sorted(banned), None

    def put(self, value):
        value = value.reshape(1, -1)
        self.sequence = value if self.sequence is None else torch.cat([self.sequence, value], dim=1)

    def end(self):
        self.sequence = None  # the next call starts from its prompt

    def logits(self, hidden, adapter, count=None, vocab=None):
        ids, length = self.sequence, self.sequence.shape[1]
        for _ in range(self.num_heads):  # full passes, no cache: independent of selfspec's own
            scores = self.model(ids).logits[0, -1].float()
            scores[self.banned] = float("-inf")
            ids = torch.cat([ids, scores.argmax().reshape(1, 1)], dim=1)
        proposals = torch.randn(1, self.num_heads, VOCAB, generator=torch.Generator().manual_seed(length))
        for head, token in enumerate(ids[0, length:].tolist()):
            top = proposals[0, head].max()
            proposals[0, head, token] = top + 8.0 if (length + head) % 3 else top - 1e-3
        return proposals.to(hidden.dtype)


def speculative(model, mode: str, banned: set[int] = frozenset()) -> tuple[SelfSpeculative, dict]:
    """A spec for `mode` and the extra `generate` arguments it needs (one prompt at a time): Medusa heads
    answer with a `Lookahead` oracle, passed as the streamer."""
    spec = make_spec(model, mode)
    if mode == "early_exit":
        return spec, {}
    oracle = Lookahead(model, spec.heads.num_heads, banned)
    spec.heads.logits = oracle.logits
    return spec, {"streamer": oracle}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=2)


@pytest.fixture(scope="module")
def specs(model):
    heads = medusa_heads(model, num_heads=3)
    return {mode: make_spec(model, mode, heads) for mode in MODES}


@pytest.fixture
def sampler(monkeypatch):
    """Checks every distribution handed to the sampler (the rule's draws and sampled drafts); returns the list of
    their shapes."""
    from selfspec.engine import drafter, verify

    real, shapes = verify.draw, []

    def checked(distributions, generator=None):
        assert distributions.dtype == torch.float32, distributions.dtype
        assert bool(torch.isfinite(distributions).all()), "NaN or inf handed to the sampler"
        assert bool((distributions >= 0).all()), "negative probability handed to the sampler"
        assert bool((distributions.sum(dim=-1) > 0).all()), "all-zero distribution handed to the sampler"
        shapes.append(tuple(distributions.shape))
        return real(distributions, generator)

    monkeypatch.setattr(verify, "draw", checked)
    monkeypatch.setattr(drafter, "draw", checked)
    return shapes


def check_stats(spec: SelfSpeculative, batch: int = 1) -> None:
    stats = spec.stats
    assert stats.new_tokens == stats.accepted + stats.row_passes  # accepted drafts plus one per pass and row
    assert math.isfinite(stats.alpha) and 0.0 <= stats.alpha <= 1.0 + 1e-6
    if batch == 1:
        assert stats.row_passes == stats.target_passes


def seeded(spec_or_model, prompt, seed: int, **kwargs) -> torch.Tensor:
    torch.manual_seed(seed)
    return spec_or_model.generate(prompt, **kwargs)


# ------------------------------------------------------------------------------- low-precision models
@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def low_precision(request):
    return tiny_model("llama", seed=2).to(request.param)


@pytest.mark.parametrize("mode", MODES)
def test_low_precision_greedy_equals_generate(low_precision, mode):
    """Greedy output equals `model.generate` in the model's own dtype (the tiny models' logits are spread
    wide, so this does not hang on half-precision ties)."""
    model = low_precision
    spec, extra = speculative(model, mode)
    assert spec.adapter.dtype == model.dtype
    accepted = 0
    for length in (1, 7, 30):
        prompt = random_prompt(length, seed=length)
        expected = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        actual = spec.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, **extra)
        assert torch.equal(actual, expected), length
        check_stats(spec)
        accepted += spec.stats.accepted
    assert accepted > 0


@pytest.mark.parametrize("mode", MODES)
def test_low_precision_sampling_is_valid_and_reproducible(low_precision, mode, sampler):
    spec, prompt = make_spec(low_precision, mode), random_prompt(6, seed=3)
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.8, top_p=0.9)
    outputs = [seeded(spec, prompt, seed, **kwargs) for seed in (0, 0, 1, 2)]
    assert torch.equal(outputs[0], outputs[1])  # same seed, same tokens
    assert any(not torch.equal(outputs[0], other) for other in outputs[2:])  # and it does sample
    for out in outputs:
        assert out.shape == (1, 6 + NEW_TOKENS) and bool(((out >= 0) & (out < VOCAB)).all())
    check_stats(spec)
    assert len(sampler) > 0


# ------------------------------------------------------------------------------------- masked logits
class BanUpperHalf(LogitsProcessor):
    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, VOCAB // 2 :] = float("-inf")
        return scores


BAD_WORDS = list(range(3, VOCAB, 3))
MASKINGS = {
    # name: (generate arguments, tokens that must never be generated, sampling is greedy)
    "ban_upper_half": (
        dict(logits_processor=LogitsProcessorList([BanUpperHalf()])),
        set(range(VOCAB // 2, VOCAB)),
        False,
    ),
    "bad_words_ids": (dict(bad_words_ids=[[t] for t in BAD_WORDS]), set(BAD_WORDS), False),
    "top_k_1": (dict(top_k=1), set(), True),
    "tiny_top_p": (dict(top_p=1e-6), set(), True),
    "cold_and_banned": (
        dict(temperature=1e-3, logits_processor=LogitsProcessorList([BanUpperHalf()])),
        set(range(VOCAB // 2, VOCAB)),
        False,
    ),
}


@pytest.mark.parametrize("masking", MASKINGS)
@pytest.mark.parametrize("mode", MODES)
def test_masked_logits_in_every_mode(model, mode, masking, sampler):
    kwargs, banned, sampling_is_greedy = MASKINGS[masking]
    spec, extra = speculative(model, mode, banned)
    prompt = random_prompt(8, seed=21)
    greedy = model.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS, **kwargs)
    common = dict(max_new_tokens=NEW_TOKENS, **kwargs, **extra)
    assert torch.equal(spec.generate(prompt, do_sample=False, **common), greedy)
    check_stats(spec)
    assert spec.stats.accepted > 0  # drafts were kept: the accept path ran under the mask
    accepted = 0
    for seed in (0, 1):
        out = seeded(spec, prompt, seed, do_sample=True, **common)
        check_stats(spec)
        accepted += spec.stats.accepted
        assert out.shape == (1, 8 + NEW_TOKENS)
        assert not banned & set(out[0, 8:].tolist()), "a banned token was generated"
        if sampling_is_greedy:  # one token left per position: sampling must reproduce greedy decoding
            assert torch.equal(out, greedy)
    assert accepted > 0  # sampled drafts were kept under the mask too (a seed alone may keep none)
    if not sampling_is_greedy:
        assert not banned & set(greedy[0, 8:].tolist())
    assert len(sampler) > 0


@pytest.mark.parametrize("masking", MASKINGS)
@pytest.mark.parametrize("mode", ["early_exit", "medusa_chain"])  # trees take one prompt at a time
def test_masked_logits_in_a_batch_of_three(model, specs, mode, masking, sampler):
    kwargs, banned, sampling_is_greedy = MASKINGS[masking]
    spec = specs[mode]
    ids, mask = padded_prompts([4, 11, 1], seed=30)
    common = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD, **kwargs)
    greedy = model.generate(ids, do_sample=False, **common)
    assert torch.equal(spec.generate(ids, do_sample=False, **common), greedy)
    check_stats(spec, batch=3)
    out = seeded(spec, ids, 5, do_sample=True, **common)
    check_stats(spec, batch=3)
    assert out.shape == (3, ids.shape[1] + NEW_TOKENS)
    assert not banned & set(out[:, ids.shape[1] :].reshape(-1).tolist())
    assert torch.equal(out, seeded(spec, ids, 5, do_sample=True, **common))
    if sampling_is_greedy:
        assert torch.equal(out, greedy)
    assert len(sampler) > 0


# -------------------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("mode", MODES)
def test_same_seed_same_sample(specs, mode, sampler):
    spec, prompt = specs[mode], random_prompt(5, seed=40)
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=True, repetition_penalty=1.2, top_k=20)
    first = [seeded(spec, prompt, seed, **kwargs) for seed in range(3)]
    again = [seeded(spec, prompt, seed, **kwargs) for seed in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert len({tuple(out[0].tolist()) for out in first}) > 1  # different seeds, different samples
    if mode != "medusa_tree":  # and in a batch
        ids, mask = padded_prompts([3, 9, 6], seed=41)
        batch = [seeded(spec, ids, 7, attention_mask=mask, pad_token_id=PAD, **kwargs) for _ in range(2)]
        assert torch.equal(batch[0], batch[1])
    assert len(sampler) > 0


# ------------------------------------------------------------ masks that make some prefixes dead ends
class OddIsDeadEnd(LogitsProcessor):
    """Odd tokens are banned; after an odd token nothing is allowed (a dead state, as in grammar-constrained
    decoding). A pure function of (input_ids, scores): plain decoding never reaches the dead state."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, 1::2] = float("-inf")
        scores[input_ids[:, -1] % 2 == 1] = float("-inf")
        return scores


def even_prompt() -> torch.Tensor:
    prompt = random_prompt(6, seed=1)
    prompt[0, -1] = 4  # the prompt may hold odd tokens, but not as its last one
    return prompt


@pytest.mark.parametrize("mode", ["early_exit", "medusa_chain"])
def test_chain_drafts_never_reach_dead_states(model, specs, mode, sampler):
    """A chain's drafts come from processed q, so they respect the mask: greedy equals generate, sampling
    runs and never emits an odd token, and the acceptance statistics stay finite."""
    spec, prompt = specs[mode], even_prompt()
    kwargs = dict(max_new_tokens=NEW_TOKENS, logits_processor=LogitsProcessorList([OddIsDeadEnd()]))
    assert torch.equal(spec.generate(prompt, do_sample=False, **kwargs), model.generate(prompt, **kwargs))
    check_stats(spec)
    out = seeded(spec, prompt, 0, do_sample=True, **kwargs)
    assert all(token % 2 == 0 for token in out[0, 6:].tolist())
    check_stats(spec)


def test_tree_sampling_survives_unreachable_dead_nodes(specs, sampler):
    spec = specs["medusa_tree"]
    kwargs = dict(max_new_tokens=NEW_TOKENS, logits_processor=LogitsProcessorList([OddIsDeadEnd()]))
    out = seeded(spec, even_prompt(), 0, do_sample=True, **kwargs)
    assert all(token % 2 == 0 for token in out[0, 6:].tolist())


def test_tree_greedy_statistics_stay_finite_with_dead_nodes(model, specs):
    spec = specs["medusa_tree"]
    kwargs = dict(max_new_tokens=NEW_TOKENS, logits_processor=LogitsProcessorList([OddIsDeadEnd()]))
    assert torch.equal(spec.generate(even_prompt(), do_sample=False, **kwargs), model.generate(even_prompt(), **kwargs))
    check_stats(spec)


def test_tree_decoding_processes_only_the_prefixes_it_reaches(model, specs, sampler):
    """A `prefix_allowed_tokens_fn` that allows nothing after an odd token, which plain decoding never makes: the
    tree's walk asks the processors at the nodes it reaches only, so greedy equals generate and sampling runs,
    where processing every candidate path made transformers raise."""
    asked = []

    def allowed(batch_id, ids):
        asked.append(int(ids[-1]))
        return [] if int(ids[-1]) % 2 else list(range(0, VOCAB, 2))

    kwargs = dict(max_new_tokens=NEW_TOKENS, prefix_allowed_tokens_fn=allowed)
    expected = model.generate(even_prompt(), do_sample=False, **kwargs)
    assert torch.equal(specs["early_exit"].generate(even_prompt(), do_sample=False, **kwargs), expected)
    asked.clear()
    assert torch.equal(specs["medusa_tree"].generate(even_prompt(), do_sample=False, **kwargs), expected)
    assert asked and all(token % 2 == 0 for token in asked)
    out = seeded(specs["medusa_tree"], even_prompt(), 0, do_sample=True, **kwargs)
    assert all(token % 2 == 0 for token in out[0, 6:].tolist())
    check_stats(specs["medusa_tree"])


def test_chain_verification_processes_only_the_prefixes_plain_decoding_makes(model, sampler):
    """Model-free drafts are point masses that never meet the processors, so they propose odd tokens here; a
    chain's verify pass asks the processors after a draft only where plain decoding could have made it, so a
    `prefix_allowed_tokens_fn` that allows nothing after an odd token is never asked there (transformers raised)."""
    asked, proposed = [], []

    def allowed(batch_id, ids):
        asked.append(int(ids[-1]))
        return [] if int(ids[-1]) % 2 else list(range(0, VOCAB, 2))

    prompt = torch.tensor([[60, 30, 88, 31, 10, 20, 40, 50, 10, 20, 88, 31, 10, 20]])
    kwargs = dict(max_new_tokens=NEW_TOKENS, prefix_allowed_tokens_fn=allowed)
    expected = model.generate(prompt, do_sample=False, **kwargs)
    spec = SelfSpeculative(model, drafter="ngram", num_draft_tokens=3, adaptive=False)
    real = spec.drafters[0].draft

    def draft(*args, **kw):
        result = real(*args, **kw)
        proposed.extend(result.tokens.reshape(-1).tolist())
        return result

    spec.drafters[0].draft = draft
    asked.clear()
    assert torch.equal(spec.generate(prompt, do_sample=False, **kwargs), expected)
    assert any(token % 2 for token in proposed), proposed  # the case in question arose
    assert asked and all(token % 2 == 0 for token in asked[1:]), asked  # the first: the prompt's last token
    out = seeded(spec, prompt, 0, do_sample=True, **kwargs)
    assert all(token % 2 == 0 for token in out[0, prompt.shape[1] :].tolist())
    assert all(token % 2 == 0 for token in asked[1:]), asked


def test_drafting_asks_the_processors_nothing_after_a_drafted_end_of_sequence():
    """A drafter that processes its own proposals stops processing a row at an end of sequence it drafted:
    `generate` asks a `prefix_allowed_tokens_fn` nothing after one, and this one allows nothing there."""
    model, prompt, eos = tiny_model("llama"), random_prompt(6, seed=3), 93
    after_eos = []

    def allowed(batch_id, ids):
        after_eos.append(int(ids[-1]) == eos)
        return [] if int(ids[-1]) == eos else list(range(VOCAB))

    kwargs = dict(max_new_tokens=20, eos_token_id=eos, prefix_allowed_tokens_fn=allowed, do_sample=False)
    expected = model.generate(prompt, **kwargs)
    for exit_layer in (2, 3):
        after_eos.clear()
        spec = SelfSpeculative(model, exit_layer=exit_layer, num_draft_tokens=4)
        assert torch.equal(spec.generate(prompt, **kwargs), expected)
        assert after_eos and not any(after_eos)


def test_a_prefix_function_sees_each_rows_batch_index_in_a_batch(model):
    """Rows that gained different numbers of tokens are processed on their own: `prefix_allowed_tokens_fn` is
    still called with the row's index in the batch, as `model.generate` calls it."""

    def allowed(batch_id, ids):  # row 0 writes even tokens, row 1 odd ones
        return list(range(batch_id % 2, VOCAB, 2))

    ids, mask = padded_prompts([5, 9], seed=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, prefix_allowed_tokens_fn=allowed, pad_token_id=PAD)
    expected = model.generate(ids, do_sample=False, **kwargs)
    assert all(token % 2 for token in expected[1, ids.shape[1] :].tolist())
    for spec in (SelfSpeculative(model, exit_layer=2, num_draft_tokens=3), SelfSpeculative(model, drafter="ngram")):
        assert torch.equal(spec.generate(ids, do_sample=False, **kwargs), expected)


def test_tree_decoding_asks_nothing_past_the_end_or_the_budget(model):
    """The walk ends where `generate` does: with drafts that are always right (so trees are accepted deep), a
    `prefix_allowed_tokens_fn` is never asked after the end-of-sequence token, nor for a prefix past the token
    budget, and the output is `generate`'s."""
    prompt = even_prompt()
    reference = model.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS)[0, prompt.shape[1] :].tolist()
    at = next(i for i in range(4, NEW_TOKENS) if reference[i] not in reference[:i])  # a first occurrence
    eos, lengths = reference[at], []

    def allowed(batch_id, ids):
        lengths.append(len(ids))
        assert int(ids[-1]) != eos or len(ids) == prompt.shape[1], "asked after the end of sequence"
        return list(range(VOCAB))

    for budget in (3, NEW_TOKENS):  # the budget ends the output, then the end of sequence does
        kwargs = dict(max_new_tokens=budget, prefix_allowed_tokens_fn=allowed, eos_token_id=eos, do_sample=False)
        expected = model.generate(prompt, **kwargs)
        oracle = FutureOracle(reference, VOCAB, perfect=True)
        spec = SelfSpeculative(model, heads=medusa_heads(model, num_heads=4), tree=MEDUSA_TREE, adaptive=False)
        spec.heads.logits = oracle.logits
        lengths.clear()
        assert torch.equal(spec.generate(prompt, streamer=oracle, **kwargs), expected)
        assert spec.stats.accepted > 0
        assert max(lengths) <= prompt.shape[1] + min(budget, at + 1) - 1  # the last token is drawn after that one


# ------------------------------------------------------------------------------------------- errors
def test_malformed_prompts_raise(specs):
    spec = specs["early_exit"]
    with pytest.raises(ValueError, match="non-empty"):
        spec.generate(torch.zeros(0, 5, dtype=torch.long), max_new_tokens=3)  # no rows
    with pytest.raises(ValueError, match=r"\[batch, length\]"):
        spec.generate(torch.tensor([5, 6, 7]), max_new_tokens=3)  # 1-D
    with pytest.raises(ValueError, match="input_ids"):
        spec.generate(max_new_tokens=3)
    with pytest.raises(ValueError, match="left padding"):
        spec.generate(torch.tensor([[5, 6, 7]]), attention_mask=torch.tensor([[1, 1, 0]]), max_new_tokens=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        spec.generate(random_prompt(4), max_new_tokens=0)
    with pytest.raises(ValueError, match="tokenizer"):
        spec.generate(random_prompt(4), max_new_tokens=3, stop_strings=["w5"])


@pytest.fixture(scope="module")
def short_gpt2():
    """GPT-2 with 24 learned positions: feeding position 24 would fail with an index error."""
    config = tiny_config("gpt2")
    config.n_positions = 24
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


@pytest.mark.parametrize("mode", MODES)
def test_maximum_positions_boundary(short_gpt2, mode, sampler):
    spec, prompt = make_spec(short_gpt2, mode), random_prompt(10, seed=50)
    # up to the maximum: generates exactly, in every mode (drafts never run past the budget)
    expected = short_gpt2.generate(prompt, max_new_tokens=14, do_sample=False)
    assert torch.equal(spec.generate(prompt, max_new_tokens=14, do_sample=False), expected)
    assert seeded(spec, prompt, 0, max_new_tokens=14, do_sample=True).shape == (1, 24)
    # one past it, however it is asked for
    for kwargs in (dict(max_new_tokens=15), dict(max_length=25)):
        with pytest.raises(ValueError, match="maximum of 24 positions"):
            spec.generate(prompt, **kwargs)
    with pytest.raises(ValueError, match="maximum of 24 positions"):
        spec.generate(random_prompt(24, seed=51), max_new_tokens=1)  # the prompt alone fills it


UNSUPPORTED = [
    ({"num_beam_groups": 2, "num_beams": 2}, "num_beams"),
    ({"diversity_penalty": 0.5}, "diversity_penalty"),
    ({"dola_layers": "high"}, "dola_layers"),
    ({"output_hidden_states": True, "return_dict_in_generate": True}, "output_hidden_states"),
    ({"guidance_scale": 2.0}, "guidance_scale"),
    ({"token_healing": True}, "token_healing"),
    ({"prefill_chunk_size": 2}, "prefill_chunk_size"),
    ({"assistant_early_exit": 1}, "assistant_early_exit"),
    ({"force_words_ids": [[5]]}, "force_words_ids"),
    ({"watermarking_config": {"bias": 2.0}}, "watermarking_config"),
    ({"synced_gpus": True}, "synced_gpus"),
    ({"negative_prompt_ids": torch.tensor([[5, 6]])}, "negative_prompt_ids"),
    ({"custom_generate": "some/repo"}, "custom_generate"),
    ({"past_key_values": object()}, "past_key_values"),
    ({"generation_config": GenerationConfig(num_beams=2, max_new_tokens=5)}, "num_beams"),
]


@pytest.mark.parametrize("kwargs,named", UNSUPPORTED, ids=[named for _, named in UNSUPPORTED])
def test_more_unsupported_arguments_raise_naming_them(specs, kwargs, named):
    kwargs = {"max_new_tokens": 5} | kwargs if "generation_config" not in kwargs else kwargs
    with pytest.raises(UnsupportedGenerationArgument, match=named):
        specs["early_exit"].generate(random_prompt(4), **kwargs)


def test_off_values_pass_and_embeddings_alone_are_named(model, specs):
    prompt = random_prompt(4)
    expected = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert torch.equal(specs["early_exit"].generate(prompt, max_new_tokens=5, synced_gpus=False), expected)
    with pytest.raises(UnsupportedGenerationArgument, match="`inputs_embeds` is not supported"):
        specs["early_exit"].generate(inputs_embeds=torch.zeros(1, 4, model.config.hidden_size), max_new_tokens=5)


def test_unsupported_default_in_the_models_generation_config_raises():
    model = tiny_model("llama", seed=2)
    model.generation_config.num_beams = 2  # merged into every call, as model.generate merges it
    with pytest.raises(UnsupportedGenerationArgument, match="num_beams"):
        SelfSpeculative(model).generate(random_prompt(4), max_new_tokens=5)
    # the call's own argument overrides the default, as in model.generate
    out = SelfSpeculative(model).generate(random_prompt(4), max_new_tokens=5, num_beams=1)
    assert out.shape == (1, 9)
