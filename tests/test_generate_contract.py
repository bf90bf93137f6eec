"""`SelfSpeculative.generate` takes `model.generate`'s arguments and returns what it returns."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import pytest
import torch
from tiny_models import ARCHITECTURES, random_prompt, tiny_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedTokenizerFast, TextStreamer
from transformers.generation.streamers import BaseStreamer

from selfspec import SelfSpeculative, UnsupportedGenerationArgument
from selfspec.measure.ties import compare_greedy

VOCAB = 96


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=1)


@pytest.fixture(scope="module")
def tokenizer():
    # "abcdef" is the probe transformers' stop-string matcher tokenizes to learn how tokens decode
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "abcdef": 3} | {f"w{i}": i for i in range(4, VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def both(model, prompt, **kwargs):
    expected = model.generate(prompt, **kwargs)
    actual = SelfSpeculative(model, exit_layer=1, num_draft_tokens=4).generate(prompt, **kwargs)
    return expected, actual


def test_eos_stops_where_generate_stops(model):
    prompt = random_prompt(6, seed=11)
    free = model.generate(prompt, max_new_tokens=40, do_sample=False)[0, 6:].tolist()
    for eos in ([free[12]], [free[25], free[7]]):  # one EOS id, then several
        expected, actual = both(model, prompt, max_new_tokens=40, do_sample=False, eos_token_id=eos)
        assert torch.equal(actual, expected)
        assert actual[0, -1].item() in eos and actual.shape[1] < 6 + 40


# {} and min_new_tokens without a maximum test the default max_length (20) on purpose: model.generate warns
# about exactly that (the default, and a minimum it cannot reach), and selfspec must stop where it stops.
@pytest.mark.filterwarnings("ignore:Using the model-agnostic default `max_length`:UserWarning")
@pytest.mark.filterwarnings("ignore:Unfeasible length constraints:UserWarning")
def test_length_arguments(model):
    prompt = random_prompt(7, seed=12)
    for kwargs in ({"max_length": 7 + 15}, {}, {"max_new_tokens": 1}, {"min_new_tokens": 30, "eos_token_id": 5}):
        expected, actual = both(model, prompt, do_sample=False, **kwargs)
        assert torch.equal(actual, expected), kwargs


def test_a_text_prompt_says_to_tokenize_first(model):
    spec = SelfSpeculative(model, exit_layer=1)
    with pytest.raises(TypeError, match="got str: tokenize it first"):
        spec.generate("w4 w5", max_new_tokens=4)
    with pytest.raises(TypeError, match="got list: tokenize it first"):
        spec.generate(input_ids=[[4, 5]], max_new_tokens=4)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_left_padded_prompt_with_attention_mask(arch):
    model = tiny_model(arch, seed=5)
    prompt = torch.cat([torch.zeros(1, 4, dtype=torch.long), random_prompt(9, seed=13)], dim=1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 9, dtype=torch.long)], dim=1)
    expected, actual = both(model, prompt, attention_mask=mask, max_new_tokens=30, do_sample=False)
    assert torch.equal(actual, expected)


def test_stop_strings(model, tokenizer):
    prompt = random_prompt(5, seed=14)
    free = model.generate(prompt, max_new_tokens=30, do_sample=False)[0, 5:].tolist()
    stop = tokenizer.convert_ids_to_tokens(free[9])
    expected, actual = both(model, prompt, max_new_tokens=30, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    assert torch.equal(actual, expected)
    assert actual.shape[1] < 5 + 30


def test_custom_logits_processor_and_stopping_criteria(model):
    class BanEvenTokens(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            scores[:, ::2] = float("-inf")
            return scores

    class StopAfterLength:
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 20, dtype=torch.bool)

    prompt = random_prompt(8, seed=15)
    kwargs = dict(max_new_tokens=30, do_sample=False, logits_processor=LogitsProcessorList([BanEvenTokens()]))
    expected, actual = both(model, prompt, stopping_criteria=[StopAfterLength()], **kwargs)
    assert torch.equal(actual, expected)
    assert actual.shape[1] == 20 and all(token % 2 == 1 for token in actual[0, 8:].tolist())


def test_return_dict_with_scores_and_logits(model):
    prompt = random_prompt(6, seed=16)
    kwargs = dict(
        max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_scores=True, output_logits=True
    )
    expected, actual = both(model, prompt, repetition_penalty=1.2, **kwargs)
    assert type(actual) is type(expected)
    assert torch.equal(actual.sequences, expected.sequences)
    assert len(actual.scores) == len(expected.scores) == 12
    for mine, theirs in zip(actual.scores + actual.logits, expected.scores + expected.logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def test_streamer_receives_committed_tokens_in_order(model, tokenizer):
    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    prompt = random_prompt(6, seed=17)
    streamer = Collect()
    out = SelfSpeculative(model, exit_layer=2, num_draft_tokens=5).generate(
        prompt, max_new_tokens=25, do_sample=False, streamer=streamer
    )
    assert streamer.ended and streamer.chunks[0] == prompt[0].tolist()
    assert sum(streamer.chunks[1:], []) == out[0, 6:].tolist()
    assert any(len(chunk) > 1 for chunk in streamer.chunks[1:])  # several tokens per iteration arrive together

    printed = []
    for generate in (model.generate, SelfSpeculative(model, exit_layer=2).generate):
        buffer = io.StringIO()
        with redirect_stdout(buffer):
            generate(prompt, max_new_tokens=25, do_sample=False, streamer=TextStreamer(tokenizer, skip_prompt=True))
        printed.append(buffer.getvalue())
    assert printed[0] == printed[1] and printed[0].strip()


@pytest.mark.parametrize(
    "kwargs,named",
    [
        ({"num_beams": 2}, "num_beams"),
        ({"num_return_sequences": 2, "do_sample": True}, "num_return_sequences"),
        ({"output_attentions": True, "return_dict_in_generate": True}, "output_attentions"),
        ({"prompt_lookup_num_tokens": 3}, "prompt_lookup_num_tokens"),
        ({"penalty_alpha": 0.6, "top_k": 4}, "penalty_alpha"),
        ({"use_cache": False}, "use_cache"),
        ({"cache_implementation": "static"}, "cache_implementation"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"inputs_embeds": torch.zeros(1, 2, 32)}, "inputs_embeds"),
    ],
)
def test_unsupported_arguments_raise_naming_them(model, kwargs, named):
    spec = SelfSpeculative(model)
    with pytest.raises(UnsupportedGenerationArgument, match=named):
        spec.generate(random_prompt(4), max_new_tokens=5, **kwargs)


def test_assistant_model_is_rejected(model):
    with pytest.raises(UnsupportedGenerationArgument, match="assistant_model"):
        SelfSpeculative(model).generate(random_prompt(4), max_new_tokens=5, assistant_model=model)


def test_bad_prompts_raise(model):
    spec = SelfSpeculative(model)
    with pytest.raises(ValueError, match="non-empty"):
        spec.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=5)
    with pytest.raises(ValueError, match="maximum of 512 positions"):
        spec.generate(random_prompt(10), max_new_tokens=600)


def test_stats_describe_the_call(model):
    spec = SelfSpeculative(model, exit_layer=2, num_draft_tokens=3)
    out = spec.generate(random_prompt(6, seed=18), max_new_tokens=30, do_sample=False)
    stats = spec.stats
    assert stats.new_tokens == out.shape[1] - 6 == 30
    assert stats.target_passes == stats.iterations + 1
    assert sum(stats.proposed_per_position) == stats.proposed and sum(stats.accepted_per_position) == stats.accepted
    # acceptances at draft position i+1 imply acceptance at position i
    assert all(a >= b for a, b in zip(stats.accepted_per_position, stats.accepted_per_position[1:], strict=False))
    assert stats.alpha_hat == stats.accepted / stats.proposed
    assert 0.0 <= stats.alpha <= 1.0
    # every committed token came from a verify pass: accepted drafts plus one per pass
    assert stats.new_tokens == stats.accepted + stats.target_passes
    assert stats.draft_seconds > 0 and stats.verify_seconds > 0
    assert stats.row_passes == stats.target_passes  # one prompt
    assert stats.tokens_per_pass == stats.new_tokens / stats.target_passes


def test_bfloat16_model_generates_on_cpu(model):
    bf16 = tiny_model("qwen2", seed=2).to(torch.bfloat16)
    spec = SelfSpeculative(bf16, exit_layer=2, num_draft_tokens=4)
    prompt = random_prompt(5)
    out = spec.generate(prompt, max_new_tokens=20, do_sample=False)
    assert out.shape == (1, 25) and spec.stats.new_tokens == 20
    assert spec.stats.new_tokens == spec.stats.accepted + spec.stats.target_passes
    reference = bf16.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False)
    assert compare_greedy(bf16, prompt, reference, out) is not False  # generate's, up to a bfloat16 tie
