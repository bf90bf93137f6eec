"""EAGLE heads (selfspec/heads/eagle.py, selfspec/drafters/eagle.py): training computes what drafting computes, and
drafting with them is exact on every family (greedy token-identical to `model.generate`, batch rows alone,
sampling distributed as the target's law), alone and in a hybrid with n-gram lookup."""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_batch import assert_rows_exact
from test_sampling_exactness import PROMPT, ROWS, VOCAB, NoRepeat, chi_square_pvalue, exact_law, sampled_counts
from tiny_models import ARCHITECTURES, NEW_ARCHITECTURES, random_prompt, tiny_model
from transformers import DynamicCache, LogitsProcessorList

from selfspec import SelfSpeculative
from selfspec.adapter import ModelAdapter, UnsupportedModelError, unrolled
from selfspec.drafters.eagle import append_right_aligned
from selfspec.heads import EagleHeads, HeadsMismatchError, load_heads
from selfspec.heads.eagle import needed_outputs, unrolled_mask
from selfspec.training.config import HeadsConfig
from selfspec.training.distill import DistillationObjective, target_pass


def eagle_heads(model, seed: int = 0, **settings) -> EagleHeads:
    torch.manual_seed(seed)
    return EagleHeads.from_config(HeadsConfig(kind="eagle", **settings), ModelAdapter(model)).eval()


@pytest.fixture(scope="module")
def trained():
    """A tiny Llama and an EAGLE head fitted to its greedy continuations of 32 prompts: drafts for those prompts
    are often accepted, so the accept, rollback and ragged-batch paths all run."""
    model = tiny_model("llama")
    heads = eagle_heads(model, unroll=2)
    prompts = torch.randint(3, 90, (32, 3), generator=torch.Generator().manual_seed(0))
    data = model.generate(prompts, max_new_tokens=24, do_sample=False)
    hidden_states, logits = target_pass(model, data)  # the target is frozen: one pass serves every step
    objective = DistillationObjective(heads.train(), ModelAdapter(model))
    optimizer = torch.optim.AdamW(heads.parameters(), lr=1e-2)
    for _ in range(40):
        objective(hidden_states, logits).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, heads.eval(), prompts


@pytest.mark.parametrize("arch", ARCHITECTURES + NEW_ARCHITECTURES)
def test_token_input_is_what_the_stack_feeds_layer_0(arch):
    """Training reads hidden_states[0]; drafting computes `ModelAdapter.embed`: they must agree (GPT-2 adds
    learned positions, Granite multiplies)."""
    model = tiny_model(arch)
    ids = random_prompt(9)
    hidden_states, _ = target_pass(model, ids)
    assert torch.equal(ModelAdapter(model).embed(ids, torch.arange(9)[None]), hidden_states[0])


UNROLLED = [("llama", None, "eagle"), ("gpt2", None, "eagle"), ("gemma2", [0, 2], "eagle3"), ("qwen2", [1], "eagle3")]


@pytest.mark.parametrize("chunk", [256, 4])
@pytest.mark.parametrize("arch,features,layout", UNROLLED)
def test_unrolled_training_computes_what_drafting_computes(arch, features, layout, chunk, monkeypatch):
    """Step j of the unrolled training pass, at entry i, equals drafting step by step: the true entries up to
    i - j in the head's cache, then j steps fed with the head's own outputs. With queries in chunks of 4, the
    block-sparse attention's slices cross chunk borders (`selfspec.adapter.unrolled`)."""
    monkeypatch.setattr(unrolled, "CHUNK", chunk)
    model = tiny_model(arch)
    heads = eagle_heads(model, feature_layers=features, unroll=3, layout=layout)
    with torch.no_grad():  # norms away from ones, so that leaving one out would show
        for name, parameter in heads.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(1))
    hidden_states, _ = target_pass(model, ids)
    with torch.no_grad():
        drafts = heads.distillation_drafts(ModelAdapter(model), hidden_states)
        features_ = heads.fused(heads._target_features(hidden_states)[:, :-1])
        states = hidden_states[0][:, 1:]
        for j, draft in enumerate(drafts):
            assert draft.offset == j + 1 and draft.weight == pytest.approx(0.8**j)
            for i in range(j, 11):
                anchor, cache = i - j, DynamicCache()
                positions = torch.arange(anchor + 1)[None].expand(2, -1)
                out = heads.step(features_[:, : anchor + 1], states[:, : anchor + 1], positions, None, cache)[:, -1:]
                for k in range(1, j + 1):
                    index = anchor + k
                    out = heads.step(out, states[:, index : index + 1], torch.full((2, 1), index), None, cache)
                torch.testing.assert_close(out[:, 0], draft.hidden[:, i - j], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHITECTURES + NEW_ARCHITECTURES)
def test_block_sparse_unrolled_attention_equals_the_dense_mask(arch, monkeypatch):
    """The unrolled steps' block-sparse attention (queries in chunks of 3 here) gives the dense mask's outputs
    and gradients on every family; families whose layer does not attend with SDPA keep the dense mask."""
    model = tiny_model(arch)
    heads = eagle_heads(model, unroll=4)  # eval mode: no dropout (GPT-2's), gradients all the same
    hidden_states, _ = target_pass(model, torch.randint(3, 90, (2, 14), generator=torch.Generator().manual_seed(2)))

    def outputs_and_grads(sparse: bool):
        heads.zero_grad(set_to_none=True)
        context = heads.body.unrolled if sparse else contextlib.nullcontext
        monkeypatch.setattr(heads.body, "unrolled", context)
        calls = []
        monkeypatch.setattr(unrolled, "sdpa_attention_forward", lambda *a, **k: (calls.append(1), sdpa(*a, **k))[1])
        drafts = heads.distillation_drafts(ModelAdapter(model), hidden_states)
        outputs = [draft.hidden for draft in drafts]
        torch.stack([(out * torch.linspace(-1, 1, out.shape[-1])).sum() for out in outputs]).sum().backward()
        grads = {name: p.grad.clone() for name, p in heads.named_parameters() if p.grad is not None}
        return outputs, grads, len(calls)

    sdpa = unrolled.sdpa_attention_forward
    monkeypatch.setattr(unrolled, "CHUNK", 3)
    unrolled_method = heads.body.unrolled
    dense, dense_grads, _ = outputs_and_grads(False)
    monkeypatch.setattr(heads.body, "unrolled", unrolled_method)
    sparse, sparse_grads, calls = outputs_and_grads(True)
    attends_with_sdpa = heads.body.base.config._attn_implementation == "sdpa"
    assert calls == (4 * 5 if attends_with_sdpa else 0)  # 4 steps x 5 chunks of the 13 entries
    for a, b in zip(dense, sparse, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert dense_grads.keys() == sparse_grads.keys() and dense_grads
    for name, grad in dense_grads.items():
        torch.testing.assert_close(sparse_grads[name], grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHITECTURES + NEW_ARCHITECTURES)
def test_queries_nothing_reads_are_not_scored_and_what_is_read_is_unchanged(arch, monkeypatch):
    """With training's loss mask (`learn`), the block-sparse attention scores only the queries whose outputs a
    loss reads, directly or through later steps; the drafts at the taught positions and the gradient of a loss
    over them equal those of the full pass (chunks of 3), and every output stays finite."""
    model = tiny_model(arch)
    adapter = ModelAdapter(model)
    heads = eagle_heads(model, unroll=4)
    hidden_states, _ = target_pass(model, torch.randint(3, 90, (2, 20), generator=torch.Generator().manual_seed(3)))
    learn = torch.zeros(2, 20, dtype=torch.bool)
    learn[0, 13:16] = learn[1, 6:8] = True  # two short answers
    monkeypatch.setattr(unrolled, "CHUNK", 3)
    sdpa, scored = unrolled.sdpa_attention_forward, []

    def counted(module, query, *args, **kwargs):
        scored.append(query.shape[2])
        return sdpa(module, query, *args, **kwargs)

    monkeypatch.setattr(unrolled, "sdpa_attention_forward", counted)

    def run(mask):
        heads.zero_grad(set_to_none=True)
        drafts = heads.distillation_drafts(adapter, hidden_states, learn=mask)
        direction = torch.linspace(-1, 1, drafts[0].hidden.shape[-1])
        sum((d.hidden * direction).sum(-1)[d.teacher(learn)].sum() for d in drafts).backward()
        return drafts, {name: p.grad.clone() for name, p in heads.named_parameters() if p.grad is not None}

    full, full_grads = run(None)
    all_queries, scored[:] = sum(scored), []
    skipping, skipping_grads = run(learn)
    for a, b in zip(full, skipping, strict=True):
        taught = a.teacher(learn)
        assert taught.any() and torch.isfinite(b.hidden).all()
        torch.testing.assert_close(b.hidden[taught], a.hidden[taught], rtol=1e-5, atol=1e-5)
    assert full_grads.keys() == skipping_grads.keys() and full_grads
    for name, grad in full_grads.items():
        torch.testing.assert_close(skipping_grads[name], grad, rtol=1e-4, atol=1e-5)
    if heads.body.base.config._attn_implementation == "sdpa":
        assert all_queries == 4 * 19 and sum(scored) < all_queries / 2
    else:
        assert all_queries == sum(scored) == 0


def test_a_row_with_nothing_to_learn_keeps_every_weight_in_the_graph_and_autocast_dtypes_mix(monkeypatch):
    """A batch whose loss reads nothing still scores one query, so every weight gets a gradient (DDP expects
    them all); under bfloat16 autocast, with whole chunks skipped, the drafts come out finite (a skipped chunk's
    zeros take the scored chunks' dtype, whatever autocast made it)."""
    model = tiny_model("llama")
    adapter = ModelAdapter(model)
    heads = eagle_heads(model, feature_layers=[1], unroll=3, layout="eagle3")
    assert heads.fuse is None and heads.body.base.config._attn_implementation == "sdpa"
    monkeypatch.setattr(unrolled, "CHUNK", 3)
    ids = torch.randint(3, 90, (1, 16), generator=torch.Generator().manual_seed(5))
    hidden_states, logits = target_pass(model, ids)
    nothing = torch.zeros(1, 16, dtype=torch.bool)
    DistillationObjective(heads, adapter)(hidden_states, logits, nothing).sum().backward()
    assert all(p.grad is not None for p in heads.parameters())
    learn = nothing.clone()
    learn[0, 12:14] = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        drafts = heads.distillation_drafts(adapter, hidden_states, learn=learn)
    assert all(torch.isfinite(d.hidden).all() for d in drafts)


def test_the_needed_outputs_are_what_the_losses_read_through_the_chains():
    """`needed_outputs` equals the rule spelled out: step j's output at i is needed if its loss reads it, or
    if some later step k's query on its chain (index i + k - j) is needed (it reads step j + 1's entry i + 1,
    whose input is this output)."""
    generator = torch.Generator().manual_seed(4)
    for steps in (1, 2, 4):
        taught = torch.rand(3, 15, generator=generator) < 0.2
        needed = needed_outputs(taught, steps)
        expected = [taught.clone() for _ in range(steps)]
        for j in reversed(range(steps)):
            for k in range(j + 1, steps):
                for i in range(15 - (k - j)):
                    expected[j][:, i] |= expected[k][:, i + k - j]
        assert len(needed) == steps and all(torch.equal(a, b) for a, b in zip(needed, expected, strict=True))


@pytest.mark.parametrize("length,step,chunk", [(13, 3, 3), (9, 1, 4), (6, 5, 2), (8, 2, 8)])
def test_unrolled_key_ranges_cover_every_key_the_mask_allows(length, step, chunk):
    """Every key that `unrolled_mask` lets a query of a chunk see is inside that chunk's key ranges."""
    allowed = unrolled_mask(length, step, torch.float32, "cpu")[0, 0] == 0
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        inside = torch.zeros(allowed.shape[-1], dtype=torch.bool)
        for lo, hi in unrolled._key_ranges(start, end, step, length):
            inside[lo:hi] = True
        assert not (allowed[start:end] & ~inside).any()
        assert inside.sum() < allowed.shape[-1] or length <= chunk  # and it leaves keys out


NO_JOINED_INPUT = {"gpt2": "no linear q/k/v", "olmo2": "no input norm", "cohere2": "feeds more than the attention"}


@pytest.mark.parametrize("arch", ARCHITECTURES + NEW_ARCHITECTURES)
def test_greedy_matches_generate_on_every_family(arch):
    """Both layouts on every family (EAGLE-3's where its layer takes the joined input; the others are refused)."""
    model = tiny_model(arch)
    prompt = random_prompt(7, seed=2)
    expected = model.generate(prompt, max_new_tokens=20, do_sample=False)
    for layout, features in (("eagle", None), ("eagle3", [0, 1, 2])):
        if layout == "eagle3" and arch in NO_JOINED_INPUT:
            with pytest.raises(UnsupportedModelError, match=NO_JOINED_INPUT[arch]):
                eagle_heads(model, layout=layout, feature_layers=features)
            continue
        spec = SelfSpeculative(
            model, heads=eagle_heads(model, layout=layout, feature_layers=features), num_draft_tokens=3
        )
        assert torch.equal(spec.generate(prompt, max_new_tokens=20, do_sample=False), expected), layout
        assert spec.stats.proposed > 0 and spec.stats.drafted_by["eagle"]["iterations"] > 0


def test_trained_head_is_accepted_and_exact(trained):
    model, heads, prompts = trained
    accepted = 0
    for row in range(4):
        prompt = prompts[row : row + 1]
        expected = model.generate(prompt, max_new_tokens=24, do_sample=False)
        for gamma in (1, 3, 5):
            spec = SelfSpeculative(model, heads=heads, num_draft_tokens=gamma)
            assert torch.equal(spec.generate(prompt, max_new_tokens=24, do_sample=False), expected), (row, gamma)
            accepted += spec.stats.accepted
        adaptive = SelfSpeculative(model, heads=heads)
        assert torch.equal(adaptive.generate(prompt, max_new_tokens=24, do_sample=False), expected)
    assert accepted >= 20  # the head learned the continuations: rollback after partial acceptance ran


def test_batch_rows_are_exact(trained):
    model, heads, _ = trained
    for lengths, gamma in (([3, 9], 2), ([1, 14, 6, 6], 4), ([5, 2, 11, 1, 8, 3, 7, 4], 3)):
        assert_rows_exact(model, SelfSpeculative(model, heads=heads, num_draft_tokens=gamma), lengths)
    # rows that accept different counts and rows that finish early (EOS) leave the batch
    stats = assert_rows_exact(model, SelfSpeculative(model, heads=heads, num_draft_tokens=3), [4, 7, 2], eos_token_id=5)
    assert stats.proposed > 0


def test_hybrid_with_ngram_is_exact(trained):
    model, heads, prompts = trained
    prompt = torch.cat([prompts[0], prompts[0], prompts[1]])[None]  # repeats: n-gram lookup has matches
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
    spec = SelfSpeculative(model, heads=heads, drafter="hybrid")
    assert torch.equal(spec.generate(prompt, max_new_tokens=30, do_sample=False), expected)
    used = {name for name, counts in spec.stats.drafted_by.items() if counts["iterations"]}
    assert used == {"eagle", "ngram"}  # the head's backlog keeps up while n-gram lookup drafts


def test_sampling_is_distributed_as_the_target():
    """Batched sampling (25 rows accept on their own) from a 4-token model: the law of three tokens."""
    model = tiny_model("llama", seed=3, vocab_size=VOCAB, num_layers=3, hidden=16, logit_scale=20.0)
    heads = eagle_heads(model, seed=1, layout="eagle3", feature_layers=[0, 1])
    counts = sampled_counts(SelfSpeculative(model, heads=heads, num_draft_tokens=2), rows=ROWS, temperature=0.8)
    assert chi_square_pvalue(counts, exact_law(model, temperature=0.8)) > 1e-3


TREES = [
    {"nodes": 6, "top_k": 2, "depth": 3},
    {"nodes": 12, "top_k": 3, "depth": 5},
    {"nodes": 1, "top_k": 1, "depth": 1},
]


def test_dynamic_trees_are_exact_and_accept_more(trained):
    model, heads, prompts = trained
    passes = {}
    for row in range(3):
        prompt = prompts[row : row + 1]
        expected = model.generate(prompt, max_new_tokens=24, do_sample=False)
        for index, tree in enumerate(TREES):
            spec = SelfSpeculative(model, heads=heads, tree=tree, adaptive=False)
            assert torch.equal(spec.generate(prompt, max_new_tokens=24, do_sample=False), expected), (row, tree)
            passes[index] = passes.get(index, 0) + spec.stats.target_passes
    assert passes[1] < passes[2]  # a tree of 12 candidates needs fewer passes than a chain of one


@pytest.mark.parametrize("arch", ["gemma2", "qwen2", "gpt_neox", "gemma3_text"])
def test_dynamic_trees_on_other_families(arch):
    """Sliding windows and mixed attention types: the tree mask of the verify pass, and the head's own."""
    model = tiny_model(arch)
    prompt = random_prompt(12, seed=4)
    expected = model.generate(prompt, max_new_tokens=20, do_sample=False)
    spec = SelfSpeculative(model, heads=eagle_heads(model), tree={"nodes": 8, "top_k": 3, "depth": 3}, adaptive=False)
    assert torch.equal(spec.generate(prompt, max_new_tokens=20, do_sample=False), expected)


def test_dynamic_tree_sampling_is_distributed_as_the_target():
    """Deterministic top-k candidates chosen by cumulative draft probability: the tree rule stays exact."""
    model = tiny_model("llama", seed=3, vocab_size=VOCAB, num_layers=3, hidden=16, logit_scale=20.0)
    spec = SelfSpeculative(
        model, heads=eagle_heads(model, seed=2), tree={"nodes": 3, "top_k": 2, "depth": 2}, adaptive=False
    )
    counts = sampled_counts(spec, temperature=0.8)  # trees verify one prompt at a time
    assert chi_square_pvalue(counts, exact_law(model, temperature=0.8)) > 1e-3


def test_a_full_tree_samples_as_the_target_under_a_processor_that_reads_the_ids():
    """Every path is a candidate (4 tokens, top_k 4, depth 2), so each call's walk accepts two candidates, on any
    branch, and the target is processed at nodes of every branch with a processor that reads the ids (the last
    token may not come again): each node must be processed after its own path, not another branch's."""
    model = tiny_model("llama", seed=3, vocab_size=VOCAB, num_layers=3, hidden=16, logit_scale=20.0)
    tree = {"nodes": 20, "top_k": 4, "depth": 2}
    spec = SelfSpeculative(model, heads=eagle_heads(model, seed=2), tree=tree, adaptive=False)
    processing = {"do_sample": True, "temperature": 0.8, "logits_processor": LogitsProcessorList([NoRepeat()])}
    torch.manual_seed(0)
    counts = torch.zeros(VOCAB**3, dtype=torch.float64)
    for _ in range(200):
        out = spec.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=5, **processing)
        tokens = out[0, PROMPT.shape[1] - 1 :]  # the prompt's last token, then five new ones
        assert bool((tokens[1:] != tokens[:-1]).all()), tokens.tolist()  # at the root, at depths 1 and 2, after
        assert spec.stats.accepted == 2  # the first iteration's tree accepts two; the last token is a plain step
        t1, t2, t3 = tokens[1:4].tolist()
        counts[(t1 * VOCAB + t2) * VOCAB + t3] += 1
    pvalue = chi_square_pvalue(counts, exact_law(model, no_repeat=True, temperature=0.8))
    assert pvalue > 1e-3, f"sampled law differs from the target's (chi-square p = {pvalue:.2e})"


def test_save_load_round_trip_drafts_the_same(trained, tmp_path):
    model, heads, prompts = trained
    heads.save_pretrained(tmp_path / "eagle")
    loaded = load_heads(tmp_path / "eagle", ModelAdapter(model))
    assert isinstance(loaded, EagleHeads) and loaded.unroll == 2 and loaded.features == heads.features
    for name, tensor in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    joined = eagle_heads(model, layout="eagle3", feature_layers=[0, 2])  # its norms live in the layer once
    joined.save_pretrained(tmp_path / "eagle3")
    again = load_heads(tmp_path / "eagle3", ModelAdapter(model))
    assert again.layout == "eagle3" and again.state_dict().keys() == joined.state_dict().keys()
    runs = []
    for candidate in (heads, tmp_path / "eagle"):
        spec = SelfSpeculative(model, heads=candidate, num_draft_tokens=3)
        runs.append((spec.generate(prompts[:1], max_new_tokens=20, do_sample=False), spec.stats.accepted))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    other = tiny_model("qwen2")
    with pytest.raises(HeadsMismatchError, match="model_type='llama'"):
        load_heads(tmp_path / "eagle", ModelAdapter(other))


def test_a_widened_head_drafts_as_its_start_until_trained(trained, tmp_path):
    """heads.intermediate_size above heads.init_from's: the start's weights in the leading blocks, the new units'
    outputs zero, so the wider head drafts exactly what the start does (and the trainer builds it that way)."""
    model, heads, prompts = trained
    width = heads.layer_config["intermediate_size"]
    wide = eagle_heads(model, seed=1, unroll=2, intermediate_size=3 * width)
    fresh_gate = wide.body.base.layers[0].mlp.gate_proj.weight[width:].clone()
    wide.widened_from(heads)
    mlp = wide.body.base.layers[0].mlp
    assert mlp.down_proj.weight.shape[1] == 3 * width and not mlp.down_proj.weight[:, width:].any()
    assert torch.equal(mlp.gate_proj.weight[width:], fresh_gate) and fresh_gate.abs().sum() > 0  # new inputs live
    runs = []
    for candidate in (heads, wide):
        spec = SelfSpeculative(model, heads=candidate, num_draft_tokens=3)
        runs.append((spec.generate(prompts[:2], max_new_tokens=16, do_sample=False), spec.stats.accepted))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1] > 0  # the same drafts, accepted alike
    with pytest.raises(HeadsMismatchError, match="can only grow its MLP"):
        heads.widened_from(wide)
    with pytest.raises(HeadsMismatchError, match="more than their MLP width"):
        eagle_heads(model, unroll=2, intermediate_size=3 * width, layout="eagle3").widened_from(heads)

    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
    from train_heads import build_heads

    from selfspec.training.config import TrainHeadsConfig

    heads.save_pretrained(tmp_path / "start")
    config = TrainHeadsConfig()
    config.heads = HeadsConfig(kind="eagle", unroll=2, intermediate_size=2 * width, init_from=str(tmp_path / "start"))
    built = build_heads(config, ModelAdapter(model))
    assert built.layer_config["intermediate_size"] == 2 * width
    up = built.body.base.layers[0].mlp.up_proj.weight
    assert torch.equal(up[:width], heads.body.base.layers[0].mlp.up_proj.weight)


def test_draft_lora_changes_the_drafts_not_the_output(trained, tmp_path):
    """A draft-only LoRA on the shared LM head (selfspec.heads.lora) works with an EAGLE head: drafts move, output does
    not, and it is saved and loaded with the head."""
    model, heads, prompts = trained
    adapted = EagleHeads(
        heads.fingerprint, heads.layer_config, None, heads.unroll, draft_lora={"r": 4, "lora_alpha": 8}
    )
    adapted.load_state_dict(heads.state_dict(), strict=False)
    with torch.no_grad():
        adapted.draft_lora.lora_B.weight.normal_(0, 0.5)
    adapted.eval()
    outputs = torch.randn(1, 3, heads.fingerprint.hidden_size)
    adapter = ModelAdapter(model)
    assert not torch.allclose(adapted.logits(outputs, adapter), heads.logits(outputs, adapter))
    prompt = prompts[:1]
    expected = model.generate(prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(
        SelfSpeculative(model, heads=adapted).generate(prompt, max_new_tokens=20, do_sample=False), expected
    )
    adapted.save_pretrained(tmp_path / "lora")
    loaded = load_heads(tmp_path / "lora", adapter)
    assert loaded.draft_lora is not None and torch.equal(
        loaded.logits(outputs, adapter), adapted.logits(outputs, adapter)
    )


def test_settings_errors_name_the_problem():
    model = tiny_model("llama")  # 4 layers: features from layers 0..2; the last one is read as "final"
    with pytest.raises(ValueError, match=r"feature_layers=\[3\] must list decoder layers 0..2"):
        eagle_heads(model, feature_layers=[3])
    heads = eagle_heads(model)
    with pytest.raises(ValueError, match="exit_layer does not apply to an EAGLE head"):
        SelfSpeculative(model, heads=heads, exit_layer=2)
    with pytest.raises(ValueError, match="an EAGLE head drafts dynamic trees, given as a dict"):
        SelfSpeculative(model, heads=heads, tree=[[0], [1]])
    with pytest.raises(ValueError, match="expected the keys nodes, top_k and depth"):
        SelfSpeculative(model, heads=heads, tree={"budget": 8})
    with pytest.raises(ValueError, match="must be at least 1"):
        SelfSpeculative(model, heads=heads, tree={"nodes": 0})
    with pytest.raises(ValueError, match=f"top_k 200 exceeds the model's {model.config.vocab_size} tokens"):
        SelfSpeculative(model, heads=heads, tree={"nodes": 8, "top_k": 200, "depth": 2})
    with pytest.raises(ValueError, match="heads.unroll must be at least 1"):
        HeadsConfig(kind="eagle", unroll=0)
    with pytest.raises(ValueError, match="heads.layout must be one of eagle, eagle3"):
        HeadsConfig(kind="eagle", layout="medusa")


@pytest.mark.parametrize("field", ["nodes", "top_k", "depth"])
@pytest.mark.parametrize("value", [4.0, True, "4"])
def test_a_tree_setting_that_is_no_whole_number_is_refused_by_name(field, value):
    """Not at the first tree (a slice, torch's topk or range failing mid-generate), nor as "no max_nodes" or "expected
    the keys" (the keys are right): the wrapper names the setting, with or without adaptive trees."""
    model = tiny_model("llama")
    tree = {"nodes": 8, "top_k": 3, "depth": 4, field: value}
    message = rf"tree={{.*}}: {field} must be a whole number of at least 1, got {value!r}"
    for adaptive in (False, True):
        with pytest.raises(ValueError, match=message):
            SelfSpeculative(model, heads=eagle_heads(model), tree=tree, adaptive=adaptive)


def test_append_right_aligned_keeps_each_rows_last_entries_in_order():
    old = torch.tensor([[[1.0], [2.0], [3.0]], [[4.0], [5.0], [6.0]]])  # [2, 3, 1]
    new = torch.tensor([[[7.0], [8.0]], [[9.0], [10.0]]])
    joined, counts = append_right_aligned(old, torch.tensor([2, 0]), new, torch.tensor([1, 2]))
    assert counts.tolist() == [3, 2]
    assert joined[0, -3:, 0].tolist() == [2.0, 3.0, 7.0]
    assert joined[1, -2:, 0].tolist() == [9.0, 10.0]
