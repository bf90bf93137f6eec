"""Model-free drafters (n-gram lookup, suffix drafting) need only the model's forward and a cache that can be
cropped, so they run on causal LMs whose families selfspec does not drive layer by layer: greedy output stays
token-identical to `model.generate`, one prompt and a padded batch; a model whose cache cannot roll back, or heads
on such a model, are refused by name."""

from __future__ import annotations

import pytest
import torch
from tiny_models import padded_prompts, random_prompt
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from selfspec import SelfSpeculative, UnsupportedGenerationArgument, UnsupportedModelError

UNSUPPORTED = {  # families outside selfspec.families, tiny
    "phi": {},
    "opt": {"ffn_dim": 64, "word_embed_proj_dim": 32},
    "falcon": {},
    "gptj": {"n_embd": 32, "n_layer": 2, "n_head": 4, "rotary_dim": 4},
    # routed per token: a pad token routed elsewhere regroups the other tokens' expert products (rounding only)
    "qwen2_moe": {"num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32},
}  # fmt: skip


def tiny_whole_model(model_type: str, **config) -> torch.nn.Module:
    """A tiny `model_type` of `config` (96 tokens, 128 positions, pad 0 unless given, no end of sequence), its logits
    spread."""
    torch.manual_seed(0)
    defaults = {"vocab_size": 96, "max_position_embeddings": 128, "bos_token_id": 1, "eos_token_id": None}
    config = AutoConfig.for_model(model_type, **defaults | {"pad_token_id": 0} | config)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # spread the logits: a near-flat argmax would flip on rounding (a false failure)
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def unsupported_model(model_type: str) -> torch.nn.Module:
    return tiny_whole_model(
        model_type, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        **UNSUPPORTED[model_type],
    )  # fmt: skip


@pytest.mark.parametrize("model_type", sorted(UNSUPPORTED))
def test_model_free_drafters_run_exactly_on_other_families(model_type):
    model = unsupported_model(model_type)
    repetitive = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6]])
    for drafter in ("ngram", "suffix"):
        spec = SelfSpeculative(model, drafter=drafter)
        assert spec.adapter.whole_model_only
        for prompt in (random_prompt(10, seed=2), repetitive):
            expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
            assert torch.equal(spec.generate(prompt, max_new_tokens=30, do_sample=False), expected), drafter
        assert spec.stats.proposed > 0
    ids, mask = padded_prompts([4, 9, 6])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    actual = SelfSpeculative(model, drafter="suffix").generate(ids, attention_mask=mask, max_new_tokens=20)
    assert torch.equal(actual, expected)


def test_heads_and_early_exit_still_need_a_supported_family():
    model = unsupported_model("phi")
    with pytest.raises(UnsupportedModelError, match="phi"):
        SelfSpeculative(model, exit_layer=1)  # the untrained exit runs the first layers: the family must be known
    with pytest.raises(UnsupportedModelError, match="phi"):
        SelfSpeculative(model, drafter=["suffix", "heads"])


def test_a_cache_that_cannot_roll_back_is_refused_for_model_free_drafters_too(monkeypatch):
    from selfspec.adapter import core

    config = AutoConfig.for_model(
        "lfm2", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention"],
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedModelError, match=r"'lfm2' .*recurrent state"):  # refused by name
        SelfSpeculative(model, drafter="ngram")
    monkeypatch.setattr(core, "REFUSED_ARCHITECTURES", {})  # a recurrent family selfspec has not heard of
    spec = SelfSpeculative(model, drafter="ngram")
    with pytest.raises(UnsupportedModelError, match=r"cache has \w+ layers, which cannot drop rejected drafts"):
        spec.generate(random_prompt(6), max_new_tokens=4)


def test_a_model_that_keeps_no_kv_cache_is_refused_not_decoded_wrongly():
    """GPT-1 has no KV cache and RWKV keeps its recurrent state in an argument of its own: both forwards swallow the
    cache selfspec passes, so every later pass would see only its own tokens. RWKV is refused by name; any such
    model is refused once its prefill leaves the cache empty."""
    config = AutoConfig.for_model(
        "rwkv", vocab_size=96, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64,
        context_length=128,
    )  # fmt: skip
    with pytest.raises(UnsupportedModelError, match=r"'rwkv' .*recurrent state"):
        SelfSpeculative(AutoModelForCausalLM.from_config(config), drafter="ngram")
    config = AutoConfig.for_model("openai-gpt", vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=128)
    spec = SelfSpeculative(AutoModelForCausalLM.from_config(config).eval(), drafter="suffix")
    with pytest.raises(UnsupportedModelError, match="left the cache empty"):
        spec.generate(random_prompt(6), max_new_tokens=4)
    ids, mask = padded_prompts([4, 6], seed=1)  # a batch: the padding probe meets the empty cache first
    with pytest.raises(UnsupportedModelError, match="left the cache empty"):
        spec.generate(ids, attention_mask=mask, max_new_tokens=4)


def test_prophetnet_is_refused_by_name():
    """ProphetNet's decoder gives every token of a pass over its cache one position (and asserts on such passes):
    refused when the wrapper is built, not failing inside the first verify pass."""
    config = AutoConfig.for_model(
        "prophetnet", vocab_size=96, hidden_size=32, num_encoder_layers=1, num_decoder_layers=2,
        num_encoder_attention_heads=4, num_decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=128, pad_token_id=0,
    )  # fmt: skip
    with pytest.raises(UnsupportedModelError, match=r"'prophetnet' .*one token at a time"):
        SelfSpeculative(AutoModelForCausalLM.from_config(config).eval(), drafter="ngram")


def longrope_model(model_type: str, **extra) -> torch.nn.Module:
    """A tiny model of `model_type` with a longrope switch at position 24, its attention sharpened so that the
    frequencies (and Phi-MoE's mscale) past the switch change its answers."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4, "long_factor": [8.0, 16, 32, 64]}
    model = tiny_whole_model(
        model_type, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, original_max_position_embeddings=24, rope_parameters=rope | extra.pop("rope", {}),
        **extra,
    )  # fmt: skip
    with torch.no_grad():
        for layer in model.model.layers:
            for weight in layer.self_attn.parameters():
                weight.mul_(3.0)
    return model


def test_phimoe_recomputes_its_cache_at_the_longrope_switch_as_generate_does():
    """Phi-MoE's generate, like Phi3's, drops its cache when the sequence first holds original_max_position_embeddings
    + 1 tokens and recomputes every position, so the past keys take the long mscale too; selfspec reads that from
    the model's prepare_inputs_for_generation and does the same. Prompts end before the switch, on it and past it."""
    model = longrope_model(
        "phimoe", rope={"original_max_position_embeddings": 24, "short_mscale": 1.0, "long_mscale": 2.0},
        num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    for seed, length in [(0, 10), (1, 24), (2, 30)]:
        prompt = random_prompt(length, seed=seed)
        expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
        for drafter in ("ngram", "suffix"):
            actual = SelfSpeculative(model, drafter=drafter).generate(prompt, max_new_tokens=30, do_sample=False)
            assert torch.equal(actual, expected), (seed, length, drafter)


def test_a_generate_that_forgets_the_sequence_at_the_longrope_switch_is_refused_there():
    """Phi4-multimodal's generate (transformers 5.25) drops its cache when the sequence first holds
    original_max_position_embeddings + 1 tokens but passes the pending token alone, forgetting the sequence: a
    generation reaching that point is refused; one that stays before it, or starts past it, stays exact."""
    model = longrope_model("phi4_multimodal")
    spec = SelfSpeculative(model, drafter="ngram")
    with pytest.raises(UnsupportedGenerationArgument, match="drops its cache when the sequence first holds 25 tokens"):
        spec.generate(random_prompt(10, seed=0), max_new_tokens=16)
    for length, new in [(10, 15), (25, 20)]:  # the last pass holds 24 tokens; the prompt is past the switch
        prompt = random_prompt(length, seed=length)
        expected = model.generate(prompt, max_new_tokens=new, do_sample=False)
        assert torch.equal(spec.generate(prompt, max_new_tokens=new, do_sample=False), expected), length


def test_a_bert_style_causal_lm_that_attends_both_ways_is_refused():
    """A BERT-style causal LM loaded without is_decoder=True masks bidirectionally: in a pass over several drafts each
    position saw the ones after it, and padded batches left generate's output. It is refused; with is_decoder=True
    it is causal and exact."""
    for is_decoder in (False, True):
        torch.manual_seed(0)
        config = AutoConfig.for_model(
            "megatron-bert", vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=128, pad_token_id=0, is_decoder=is_decoder,
        )  # fmt: skip
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        if not is_decoder:
            with pytest.raises(UnsupportedModelError, match="is_decoder=False"):
                SelfSpeculative(model, drafter="ngram")
            # the bare encoder has no LM head for the probe to read: the existing check names that first
            with pytest.raises(UnsupportedModelError, match="has no language-model head"):
                SelfSpeculative(AutoModel.from_config(config), drafter="ngram")
            continue
        ids, mask = padded_prompts([7, 7, 2, 10], seed=9)
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
        actual = SelfSpeculative(model, drafter="ngram").generate(ids, attention_mask=mask, max_new_tokens=20)
        assert torch.equal(actual, expected)


def trocr_model(**config) -> torch.nn.Module:
    return tiny_whole_model(
        "trocr", d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64, **config
    )  # fmt: skip


def test_a_forward_that_ignores_logits_to_keep_is_read_at_its_last_position():
    """TrOCR's forward takes no `logits_to_keep` and returns every position's logits: the prefill's next token is
    read from the last position, not the first."""
    model = trocr_model()
    prompt = random_prompt(10, seed=2)
    expected = model.generate(prompt, max_new_tokens=20, do_sample=False)
    for drafter in ("ngram", "suffix"):
        actual = SelfSpeculative(model, drafter=drafter).generate(prompt, max_new_tokens=20, do_sample=False)
        assert torch.equal(actual, expected), drafter


def pad_followed(generated: torch.Tensor, pad: int) -> bool:
    """Whether a pad token is followed by another token in `generated` [1, T]."""
    return bool(((generated[0, :-1] == pad) & (generated[0, 1:] != pad)).any())


def test_a_pass_ends_at_a_token_the_forward_gives_no_position():
    """TrOCR's sinusoidal positions number the tokens of a pass by counting those that are not the pad token (which
    gets no position): one-token steps count a generated pad token, a pass over it and the drafts after it did not,
    so every later draft sat one position early and greedy output left generate's. The adapter reads that from the
    forward (two rows differing only in a masked pad token), and a verify pass now ends at such a token."""
    model = trocr_model(use_learned_position_embeddings=False, pad_token_id=2)
    with torch.no_grad():  # the pad token is predicted where token 26 was and reads as token 47: pads, then others
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.clone())  # untied from the input embedding
        head.weight[2] = head.weight[26] * 1.05
        model.get_input_embeddings().weight[2] = model.get_input_embeddings().weight[47]
    for seed in (0, 1):
        prompt = random_prompt(10, seed=seed)
        expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
        assert pad_followed(expected[:, 10:], pad=2)
        for drafter in ("ngram", "suffix"):
            spec = SelfSpeculative(model, drafter=drafter)
            assert torch.equal(spec.generate(prompt, max_new_tokens=30, do_sample=False), expected), (seed, drafter)
            assert spec.stats.accepted > 0
            assert spec.adapter.token_without_position == 2
    assert SelfSpeculative(trocr_model(pad_token_id=2), drafter="ngram").adapter.token_without_position is None


@pytest.mark.parametrize("model_type", ["roberta", "xlm-roberta"])
def test_roberta_style_positions_follow_the_position_ids_selfspec_passes(model_type):
    """RoBERTa-style causal LMs number positions from the token ids (skipping the pad token) only when given no
    position_ids; generate passes them, and so does selfspec: exact with pad tokens generated, one prompt and a
    padded batch, and no pass is cut at them."""
    model = tiny_whole_model(
        model_type, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        is_decoder=True, pad_token_id=2,
    )  # fmt: skip
    prompt = random_prompt(10, seed=2)
    often = int(model.generate(prompt, max_new_tokens=30, do_sample=False)[0, 10:].bincount().argmax())
    with torch.no_grad():  # the pad token trades places with the one generated most (the LM head is tied to them)
        weight = model.get_input_embeddings().weight
        weight[[2, often]] = weight[[often, 2]].clone()
    spec = SelfSpeculative(model, drafter="ngram")
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
    assert pad_followed(expected[:, 10:], pad=2)
    assert torch.equal(spec.generate(prompt, max_new_tokens=30, do_sample=False), expected)
    ids, mask = padded_prompts([4, 9, 6], pad=2)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    assert any(pad_followed(row[None, 9:], pad=2) for row in expected)
    assert torch.equal(spec.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False), expected)
    assert spec.adapter.token_without_position is None


def test_a_batch_is_refused_where_the_forward_numbers_positions_by_cache_slot():
    """BART's and TrOCR's decoders take no position_ids: they number positions by cache slot, so the padding slots
    a batch gains when its rows accept different numbers of drafts would move them. Batches are refused; one prompt
    stays exact."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "bart", vocab_size=96, d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64,
        encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    for model in (AutoModelForCausalLM.from_config(config).eval(), trocr_model()):
        spec = SelfSpeculative(model, drafter="ngram")
        repetitive = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6]])
        with pytest.raises(UnsupportedGenerationArgument, match="takes no position_ids"):
            spec.generate(torch.cat([repetitive, random_prompt(16, seed=3)]), max_new_tokens=30)
        expected = model.generate(repetitive, max_new_tokens=30, do_sample=False)
        assert torch.equal(spec.generate(repetitive, max_new_tokens=30, do_sample=False), expected)


@pytest.mark.parametrize(
    "model_type,config",
    [("bloom", {"hidden_size": 32, "n_layer": 2, "n_head": 4}),
     ("mpt", {"d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 128, "use_cache": True})],
)  # fmt: skip
def test_batches_stay_exact_where_the_forward_places_tokens_by_the_mask(model_type, config):
    """BLOOM's and MPT's forwards take no position_ids either, but their ALiBi follows the attention mask, so the
    left padding a row gains when it accepts fewer drafts than another moves nothing: their batches run, exact."""
    model = tiny_whole_model(model_type, **config)
    spec = SelfSpeculative(model, drafter="ngram")
    repetitive = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6]])
    batches = [(torch.cat([repetitive, random_prompt(16, seed=3)]), None), padded_prompts([4, 9, 6], seed=1)]
    for ids, mask in batches:
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
        assert torch.equal(spec.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False), expected)
    assert spec.stats.accepted > 0


def git_model() -> torch.nn.Module:
    """A tiny GIT (an image-captioning causal LM, run on text alone) of 17 image-patch entries (16 patches, CLS)."""
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
              "image_size": 32, "patch_size": 8}  # fmt: skip
    return tiny_whole_model(
        "git", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vision_config=vision
    )


def test_a_batch_is_refused_where_a_pass_over_the_cache_sees_what_the_mask_hides():
    """GIT's forward prepends its image-patch entries to a 2D mask once the cache holds anything, image or not, so the
    mask slides off the positions it names: its own padded batches leave its one-prompt output, and the padding slots
    selfspec inserts between rows that accept different numbers of drafts would be seen. Batches are refused, padded
    or not; one prompt stays exact, a left-padded one too (generate reads its mask the same way)."""
    model = git_model()
    ids, mask = padded_prompts([16, 5], seed=2)
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    alone = model.generate(ids[1:, -5:], max_new_tokens=24, do_sample=False)
    assert not torch.equal(batched[1, -24:], alone[0, -24:])  # the reference itself depends on the batch
    spec = SelfSpeculative(model, drafter="ngram")
    repetitive = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6]])
    for batch, batch_mask in [(ids, mask), (torch.cat([repetitive, random_prompt(16, seed=3)]), None)]:
        with pytest.raises(UnsupportedGenerationArgument, match=r"GitForCausalLM \(git\) lets a pass over its cache"):
            spec.generate(batch, attention_mask=batch_mask, max_new_tokens=24)
    # the tokens this model heads for from most prompts, ahead of a prompt: n-gram drafts of them are accepted
    echo = torch.tensor([[13, 36, 86, 76, 48, 5, 46, 23, 32, 3, 48, 48, 85, 49, 50, 34, 71, 19]])
    for prompt, prompt_mask in [(echo, None), (random_prompt(10, seed=2), None), (ids[1:], mask[1:])]:
        expected = model.generate(prompt, attention_mask=prompt_mask, max_new_tokens=24, do_sample=False)
        actual = spec.generate(prompt, attention_mask=prompt_mask, max_new_tokens=24, do_sample=False)
        assert torch.equal(actual, expected)
        if prompt is echo:
            assert spec.stats.accepted > 0


def test_a_model_whose_generate_feeds_other_tokens_is_refused_when_the_wrapper_is_built():
    """XLM's generate appends a mask token to every pass and predicts at it, and its forward takes the whole sequence,
    slicing off what its cache holds (a pass over the new tokens alone failed inside its attention): refused, by what
    its `prepare_inputs_for_generation` does, when the wrapper is built."""
    model = tiny_whole_model("xlm", emb_dim=32, n_layers=2, n_heads=4)
    for drafter in ("ngram", "suffix"):
        with pytest.raises(UnsupportedModelError, match=r"XLMWithLMHeadModel \(xlm\): its generate feeds the forward"):
            SelfSpeculative(model, drafter=drafter)
