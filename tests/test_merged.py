"""Merged trees (selfspec/drafters/merged.py): a tree drafter and lookup verified together in one pass stay exact
(greedy token-identical to `model.generate` on several families, sampling distributed as the target's law), and
take what either part gets right."""

from __future__ import annotations

import pytest
import torch
from test_eagle import eagle_heads
from test_medusa import medusa_heads
from test_sampling_exactness import chi_square_pvalue, exact_law, sampled_counts
from test_sampling_exactness import model as sampling_model  # noqa: F401  (the 4-token model fixture)
from tiny_models import random_prompt, tiny_model

from selfspec import Draft, NGramDrafter, SelfSpeculative, SuffixDrafter, UnsupportedGenerationArgument
from selfspec.drafters.merged import MergedTreeDrafter, merge_paths, token_paths
from selfspec.engine.drafter import DrafterContractError
from selfspec.engine.tree import CandidateTree

EAGLE_TREE = {"nodes": 6, "top_k": 2, "depth": 3}


def repetitive_prompt(seed: int) -> torch.Tensor:
    """Text that repeats itself, so that lookup has matches that the target follows (a tiny random model
    continues a loop it has seen)."""
    prompt = random_prompt(10, seed=seed)
    return torch.cat([prompt, prompt, prompt[:, :3]], dim=1)


def test_merging_shares_prefixes_and_keeps_parents_first():
    eagle = CandidateTree.from_paths([[0], [1], [0, 0], [0, 1]])
    eagle_tokens = [7, 9, 4, 5]  # 7, 9, 7 4, 7 5
    assert token_paths(eagle, eagle_tokens) == [(7,), (9,), (7, 4), (7, 5)]
    lookup = [(7,), (7, 5), (7, 5, 2), (7, 5, 2, 8)]
    tree, tokens = merge_paths([token_paths(eagle, eagle_tokens), lookup])
    merged = token_paths(tree, tokens)
    assert sorted(merged) == sorted({*token_paths(eagle, eagle_tokens), *lookup})  # each path once
    assert tree.num_nodes == 6
    for index, path in enumerate(merged):  # a parent comes before its children
        assert len(path) == 1 or merged.index(path[:-1]) < index
    alone, alone_tokens = merge_paths([lookup])  # one part: its chain as it was
    assert token_paths(alone, alone_tokens) == lookup


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
def test_lookup_merged_into_an_eagle_tree_matches_generate_and_saves_passes(arch):
    model = tiny_model(arch)
    heads = eagle_heads(model)
    passes = {"tree": 0, "merged": 0}
    for seed in (3, 4):
        prompt = repetitive_prompt(seed)
        expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
        for name, options in (("tree", {}), ("merged", {"drafter": "hybrid", "prompt_lookup_num_tokens": 6})):
            spec = SelfSpeculative(model, heads=heads, tree=EAGLE_TREE, adaptive=False, **options)
            assert torch.equal(spec.generate(prompt, max_new_tokens=30, do_sample=False), expected), (arch, name)
            passes[name] += spec.stats.target_passes
    assert repr(spec.drafters) == "Drafters('ngram + eagle')"
    assert spec.drafter.tree.max_depth == 6  # the deepest part: lookup's chain
    assert passes["merged"] < passes["tree"], passes  # lookup's copies are taken where the head's guesses are not


def test_suffix_and_medusa_trees_merge_too():
    model = tiny_model("llama")
    heads = medusa_heads(model, num_heads=3)
    spec = SelfSpeculative(model, drafter=[SuffixDrafter(num_speculative_tokens=5, tree_nodes=4), "heads"],
                           heads=heads, tree=[[0], [1], [0, 0], [0, 0, 0]], adaptive=False)  # fmt: skip
    assert repr(spec.drafters) == "Drafters('suffix + medusa tree')"
    for seed in (5, 5, 6):  # the second call drafts from the first's answer too
        prompt = repetitive_prompt(seed)
        expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
        assert torch.equal(spec.generate(prompt, max_new_tokens=30, do_sample=False), expected), seed
    assert spec.stats.accepted > 0


def test_a_merged_tree_samples_as_the_target(sampling_model):  # noqa: F811
    heads = eagle_heads(sampling_model, seed=2)
    spec = SelfSpeculative(sampling_model, drafter="hybrid", heads=heads, prompt_lookup_num_tokens=2,
                           tree={"nodes": 3, "top_k": 2, "depth": 2}, adaptive=False)  # fmt: skip
    assert spec.drafter.tree.max_depth == 2  # so that the sampled calls verify trees, not the chains of a call's end
    counts = sampled_counts(spec, temperature=0.8)
    assert chi_square_pvalue(counts, exact_law(sampling_model, temperature=0.8)) > 1e-3


def test_merged_trees_refuse_what_they_cannot_verify():
    model = tiny_model("llama")
    heads = eagle_heads(model)
    with pytest.raises(ValueError, match="exit 2 runs the target's layers its own way"):
        SelfSpeculative(model, drafter=["heads", SuffixDrafter(tree_nodes=4)], exit_layer=2)
    with pytest.raises(ValueError, match="one of them a tree drafter"):
        MergedTreeDrafter([NGramDrafter(), SuffixDrafter()])
    with pytest.raises(ValueError, match="compile=True verifies chains; ngram \\+ eagle drafts a tree"):
        SelfSpeculative(model, drafter="hybrid", heads=heads, tree=EAGLE_TREE, compile=True)
    spec = SelfSpeculative(model, drafter="hybrid", heads=heads, tree=EAGLE_TREE, adaptive=False)
    prompts = torch.cat([random_prompt(8, seed=1), random_prompt(8, seed=2)])
    with pytest.raises(UnsupportedGenerationArgument, match="Tree verification runs one prompt at a time"):
        spec.generate(prompts, max_new_tokens=4, do_sample=False)


def test_suffix_memory_merged_into_an_eagle_tree_drafts_remembered_answers():
    """The bench's memory contenders: suffix drafting that remembers earlier answers, before the head by turns and
    merged into its tree; both exact, and the merged tree takes the remembered answer."""
    from selfspec.measure.contenders import memory_contenders

    model = tiny_model("llama")
    prompt = random_prompt(10, seed=7)
    expected = model.generate(prompt, max_new_tokens=24, do_sample=False)
    answer = expected[0, prompt.shape[1] :].tolist()
    contenders = memory_contenders(model, [answer], eagle_heads(model), None)
    assert [c.name for c in contenders] == ["selfspec suffix, memory 24 tokens",
                                            "selfspec hybrid suffix, memory 24 tokens + eagle",
                                            "selfspec merged suffix, memory 24 tokens + eagle tree"]  # fmt: skip
    merged = contenders[-1]
    assert torch.equal(merged.run(prompt, 24), expected)
    assert merged.spec.stats.accepted >= 12, merged.spec.stats  # most of the answer came from memory


def test_suffix_memory_merged_into_given_tree_shapes_alone_and_beside_lookup():
    """`selfspec bench --suffix_memory ... --merged_trees 3-3-1/6`: the remembering drafter's chain of 6 merged into
    the head's 3-3-1 tree, alone and with n-gram lookup's chain of 6 as a third part; exact, taking the remembered
    answer; their fixed copies remember apart; the bench keeps a prompt's own earlier answers out of a memory that
    is a part of a merged tree."""
    from selfspec.measure.bench import run_bench
    from selfspec.measure.contenders import fixed_tree_contenders, generate_contender, memory_contenders

    model = tiny_model("llama")
    prompt = random_prompt(10, seed=7)
    expected = model.generate(prompt, max_new_tokens=24, do_sample=False)
    answer = expected[0, prompt.shape[1] :].tolist()
    shape = ({"nodes": 3, "top_k": 3, "depth": 1}, 6)
    contenders = memory_contenders(model, [answer], eagle_heads(model), None, [shape])
    alone, beside = contenders[-2:]
    assert alone.name == "selfspec merged suffix 6, memory 24 tokens + eagle tree 3-3-1"
    assert beside.name == "selfspec merged ngram 6 + suffix 6, memory 24 tokens + eagle tree 3-3-1"
    assert [type(part).__name__ for part in beside.spec.drafter.parts] == ["NGramDrafter", "SuffixDrafter",
                                                                            "EagleDrafter"]  # fmt: skip
    for contender in (alone, beside):
        assert torch.equal(contender.run(prompt, 24), expected)
        assert contender.spec.stats.accepted >= 12, contender.spec.stats  # most of the answer came from memory
        (fixed,) = fixed_tree_contenders([contender])
        memories = [[p for p in c.spec.drafter.parts if isinstance(p, SuffixDrafter)][0] for c in (contender, fixed)]
        assert memories[0] is not memories[1] and len(memories[1].cache) == len(memories[0].cache)
    memory = memories[0].cache  # beside's: the remembered answer and the run above
    rows = run_bench([generate_contender(model, "generate", False, 1.0), beside], [prompt], 24, repeats=2)
    # the warm-up's answer and the first repeat's went before it ran again: left are the remembered answer, the run
    # above (outside the bench) and the last repeat's
    assert rows[1]["matched"] is True and len(memory) == 3, len(memory)


class Recording(NGramDrafter):
    """n-gram lookup that records `own` at every verdict, and can be told to have no proposal or to over-draft."""

    def __init__(self, ready: bool = True, extra: int = 0):
        super().__init__(prompt_lookup_num_tokens=3)
        self.ready, self.extra, self.owns = ready, extra, []

    def available(self, state):
        return super().available(state) and self.ready

    def draft(self, state, gamma, process, do_sample):
        draft = super().draft(state, gamma, process, do_sample)
        return Draft.point_mass(torch.cat([draft.tokens] + [draft.tokens[:, -1:]] * self.extra, dim=1))

    def accept(self, verified):
        self.owns.append(verified.own)


def test_parts_hear_own_only_where_they_drafted_and_may_not_draft_deeper():
    model = tiny_model("llama")
    heads = eagle_heads(model)
    prompt = repetitive_prompt(3)
    expected = model.generate(prompt, max_new_tokens=20, do_sample=False)
    idle, busy = Recording(ready=False), Recording()
    for part in (idle, busy):
        spec = SelfSpeculative(model, drafter=[part, "heads"], heads=heads, tree=EAGLE_TREE, adaptive=False)
        assert torch.equal(spec.generate(prompt, max_new_tokens=20, do_sample=False), expected)
    assert idle.owns and not any(idle.owns)  # never had a proposal: never told the draft was its own
    assert any(busy.owns)
    spec = SelfSpeculative(model, drafter=[Recording(extra=2), "heads"], heads=heads, tree=EAGLE_TREE, adaptive=False)
    with pytest.raises(DrafterContractError, match="ngram drafted 5 deep in a merged tree; it may draft 3"):
        spec.generate(prompt, max_new_tokens=20, do_sample=False)


@pytest.mark.parametrize("kept", [[[0]], [[0, 1]], [[0, 2]], [[0, 3, 5]]])
def test_keep_new_keeps_the_accepted_path_after_the_earlier_positions(kept):
    """A tree's verify pass wrote 6 positions after 4 earlier ones; the accepted path's entries follow the earlier
    ones in order, whether they moved (a later node) or stayed (the first nodes, cropped in place)."""
    from transformers import DynamicCache

    from selfspec.adapter import ModelAdapter

    cache, full = DynamicCache(), []
    for layer in range(2):
        keys, values = torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4)
        cache.update(keys.clone(), values.clone(), layer)
        full.append((keys, values))
    ModelAdapter.keep_new(cache, 6, torch.tensor(kept))
    order = [*range(4), *(4 + k for k in kept[0])]
    for layer, (keys, values) in zip(cache.layers, full, strict=True):
        assert torch.equal(layer.keys, keys[:, :, order]) and torch.equal(layer.values, values[:, :, order])
    assert cache.get_seq_length() == len(order)


def test_a_tree_shape_without_max_nodes_is_refused_where_trees_adapt():
    """Adaptive trees cost a tree's verify pass by its candidates: a tree drafter whose shape declares only max_depth
    (as custom ones could before) gets a clear error, alone or merged, and runs with adaptive=False."""

    class DepthOnly:
        max_depth = 2

    class CustomTree(NGramDrafter):
        tree = DepthOnly()

        @property
        def name(self) -> str:
            return "custom tree"

    model = tiny_model("llama")
    for drafter in (CustomTree(), [CustomTree(), "ngram"]):
        with pytest.raises(ValueError, match="declares no max_nodes"):
            SelfSpeculative(model, drafter=drafter)
        assert SelfSpeculative(model, drafter=drafter, adaptive=False).adaptive is False
