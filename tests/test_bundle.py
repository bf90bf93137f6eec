"""A target's bundle (heads, draft vocabulary, memory, recorded drafting) taken whole; the read-only suffix memory;
selfspec inside `model.generate` (custom_generate, a bundle folder, pipelines)."""

import json
import random

import pytest
import torch
from test_eagle import eagle_heads
from tiny_models import chat_tokenizer, padded_prompts, random_prompt, tiny_model
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, pipeline

from selfspec import SelfSpeculative
from selfspec.adapter import ModelAdapter
from selfspec.bundle import Bundle, BundleError
from selfspec.drafters.memory import SuffixMemory
from selfspec.drafters.suffix import SuffixDrafter, SuffixIndex
from selfspec.heads import HeadsMismatchError


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_memory_finds_what_the_index_finds():
    """The sorted read-only index answers every look-up as the dictionary index does: the same match length and
    the same occurrences, most recent first."""
    rng = random.Random(0)
    answers = [[rng.randrange(6) for _ in range(rng.randrange(0, 30))] for _ in range(200)]
    index = SuffixIndex()
    for answer in answers:
        if answer:
            index.add(answer)
    memory = SuffixMemory.from_answers(answers)
    for _ in range(2000):
        context = [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
        max_match, max_candidates = rng.randrange(1, 10), rng.randrange(1, 20)
        expected = index.candidates(context, max_match, max_candidates)
        found = memory.candidates(context, max_match, max_candidates)
        assert found[0] == expected[0]
        assert [(list(s), at) for s, at, _ in found[1]] == [(list(s), at) for s, at, _ in expected[1]]


def test_memory_round_trips_and_refuses_what_is_not_one(tmp_path):
    memory = SuffixMemory.from_answers([[5, 6, 7], [], [70000, 1]])
    memory.save(tmp_path / "memory.safetensors")
    loaded = SuffixMemory.load(tmp_path / "memory.safetensors")
    assert len(loaded) == 3 and loaded.tokens == 5 and loaded.largest_token() == 70000
    assert loaded.candidates([5, 6], 4, 4)[0] == 2
    with pytest.raises(FileNotFoundError, match="No suffix memory"):
        SuffixMemory.load(tmp_path / "missing.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="not a safetensors suffix memory"):
        SuffixMemory.load(tmp_path / "bad.safetensors")


def test_suffix_drafting_from_memory_is_exact_and_drafts(model):
    prompt = random_prompt(6, seed=3)
    expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
    memory = SuffixMemory.from_answers([expected[0, 4:].tolist()])  # the answer, as if generated before
    spec = SelfSpeculative(model, drafter=SuffixDrafter(memory=memory, max_cached_requests=0))
    assert torch.equal(spec.generate(prompt, max_new_tokens=40, do_sample=False), expected)
    assert spec.stats.accepted >= 20
    forgetful = SelfSpeculative(model, drafter=SuffixDrafter(max_cached_requests=0))
    forgetful.generate(prompt, max_new_tokens=40, do_sample=False)
    assert spec.stats.target_passes < forgetful.stats.target_passes


def make_bundle(model, folder, drafting=None):
    heads = eagle_heads(model)
    heads.save_pretrained(folder / "eagle-head")
    (folder / "draft_vocab.json").write_text(json.dumps(list(range(2, 60))))
    prompt = random_prompt(6, seed=3)
    SuffixMemory.from_answers([model.generate(prompt, max_new_tokens=30)[0, 6:].tolist()]).save(
        folder / "memory.safetensors"
    )
    default = {"drafter": ["ngram", "suffix", "heads"], "tree": {"nodes": 3, "top_k": 3, "depth": 1}}
    bundle = Bundle(
        path=folder,
        target=ModelAdapter(model).fingerprint().to_dict(),
        heads="eagle-head",
        draft_vocab="draft_vocab.json",
        memory="memory.safetensors",
        suffix={"num_speculative_tokens": 6},
        drafting=drafting or {"default": default, "bfloat16": {"drafter": ["suffix", "heads"]}},
        chosen_by="a test",
    )
    bundle.save()
    return folder


def test_a_bundle_is_taken_whole_and_arguments_override_it(model, tmp_path):
    folder = make_bundle(model, tmp_path / "tiny-bundle")
    spec = SelfSpeculative(model, heads=folder)
    assert repr(spec.drafters) == "Drafters('ngram + suffix + eagle')"  # one tree of the three (float32: default)
    assert spec.drafters[0].parts[1].memory.tokens == 30
    prompt = random_prompt(6, seed=3)
    assert torch.equal(spec.generate(prompt, max_new_tokens=30), model.generate(prompt, max_new_tokens=30))
    assert spec.stats.accepted > 0
    assert repr(SelfSpeculative(model.to(torch.bfloat16), heads=folder).drafters) == "Drafters('suffix', 'eagle')"
    model.to(torch.float32)
    ngram = SelfSpeculative(model, heads=folder, drafter="ngram")  # a drafter given replaces the recorded drafting
    assert repr(ngram.drafters) == "Drafters('ngram')"
    chain = SelfSpeculative(model, heads=folder, tree={})  # any other argument only itself
    assert repr(chain.drafters) == "Drafters('ngram', 'suffix', 'eagle')"


def test_a_bundle_that_cannot_be_used_is_named(model, tmp_path):
    folder = make_bundle(model, tmp_path / "tiny-bundle")
    (folder / "memory.safetensors").unlink()
    with pytest.raises(BundleError, match="names memory.safetensors, which it does not hold"):
        SelfSpeculative(model, heads=folder)
    other = tiny_model("llama", num_layers=2)
    folder = make_bundle(model, tmp_path / "another")
    with pytest.raises(HeadsMismatchError, match="num_hidden_layers"):
        SelfSpeculative(other, heads=folder)
    config = json.loads((folder / "bundle.json").read_text())
    (folder / "bundle.json").write_text(json.dumps({**config, "drafting": {"default": {"drafters": ["ngram"]}}}))
    with pytest.raises(BundleError, match="drafting 'default' must be an object of drafter, tree"):
        SelfSpeculative(model, heads=folder)
    (folder / "bundle.json").write_text(json.dumps({**config, "speed": 2}))
    with pytest.raises(BundleError, match="unknown fields: speed"):
        SelfSpeculative(model, heads=folder)


def test_model_generate_runs_selfspec_with_custom_generate(model):
    """model.generate(custom_generate=spec) gives what model.generate and spec.generate give: greedy, under a
    processor of the caller's, a padded batch, and seeded sampling (the same draws as spec.generate)."""
    spec = SelfSpeculative(model)
    prompt = torch.cat([random_prompt(6)] * 2, dim=1)
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=30, do_sample=False, custom_generate=spec), expected)
    assert spec.stats.new_tokens == 30
    penalty = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)])
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False, logits_processor=penalty)
    hooked = model.generate(prompt, max_new_tokens=30, do_sample=False, logits_processor=penalty, custom_generate=spec)
    assert torch.equal(hooked, expected)
    assert not torch.equal(expected, model.generate(prompt, max_new_tokens=30, do_sample=False))  # it did something
    ids, mask = padded_prompts([5, 9, 7])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    assert torch.equal(
        model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, custom_generate=spec), expected
    )
    sampling = {"max_new_tokens": 30, "do_sample": True, "temperature": 0.8, "top_k": 20}
    torch.manual_seed(7)  # fresh wrappers: a suffix drafter remembers earlier answers, which changes its drafts
    direct = SelfSpeculative(model, num_draft_tokens=3, adaptive=False).generate(prompt, **sampling)
    torch.manual_seed(7)
    fixed = SelfSpeculative(model, num_draft_tokens=3, adaptive=False)
    hooked = model.generate(prompt, custom_generate=fixed, **sampling)
    assert torch.equal(hooked, direct)
    with pytest.raises(ValueError, match="wraps another model"):
        tiny_model("llama", seed=1).generate(prompt, max_new_tokens=5, custom_generate=spec)


def test_a_bundle_folder_is_a_custom_generate_folder_and_pipelines_take_it(model, tmp_path):
    folder = make_bundle(model, tmp_path / "tiny-bundle")
    assert (folder / "custom_generate" / "requirements.txt").read_text() == "selfspec\n"
    prompt = random_prompt(6, seed=3)
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
    out = model.generate(
        prompt, max_new_tokens=30, do_sample=False, custom_generate=str(folder), trust_remote_code=True, bundle=folder
    )
    assert torch.equal(out, expected)
    with pytest.raises(FileNotFoundError, match="pass the bundle's folder to generate as bundle=FOLDER"):
        model.generate(prompt, max_new_tokens=5, custom_generate=str(folder), trust_remote_code=True)
    tokenizer = chat_tokenizer()
    small = tiny_model("llama", vocab_size=len(tokenizer))
    generator = pipeline("text-generation", model=small, tokenizer=tokenizer)
    text = "w1 w2 w3 w1 w2 w3 w1"
    plain = generator(text, max_new_tokens=20, do_sample=False)
    assert generator(text, max_new_tokens=20, do_sample=False, custom_generate=SelfSpeculative(small)) == plain
