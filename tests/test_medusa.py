"""Medusa heads: independent parameters, zero-initialised start, exact chain generation, folder round trip."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHITECTURES, random_prompt, tiny_model
from transformers.generation.streamers import BaseStreamer

from selfspec import HeadsMismatchError, MedusaHeads, SelfSpeculative
from selfspec.adapter import ModelAdapter


def medusa_heads(model, num_heads=4, num_layers=2, own_lm_head=False, seed=0, scale=0.3) -> MedusaHeads:
    """Heads with non-zero weights, as after training, so the drafts are neither trivial nor the target's."""
    heads = MedusaHeads(ModelAdapter(model).fingerprint(), num_heads, num_layers=num_layers, own_lm_head=own_lm_head)
    heads.init_own_lm_heads(model.get_output_embeddings())
    torch.manual_seed(seed)
    with torch.no_grad():
        for block in heads.blocks:
            for layer in block:
                layer.linear.weight.normal_(0, scale)
    return heads


def test_every_head_and_block_has_its_own_parameters():
    model = tiny_model("llama")
    heads = MedusaHeads(ModelAdapter(model).fingerprint(), num_heads=3, num_layers=2, own_lm_head=True)
    parameters = list(heads.parameters())
    assert len(parameters) == 3 * 2 * 2 + 3  # weight and bias per block, one LM head per head
    assert len({p.data_ptr() for p in parameters}) == len(parameters)  # no storage shared
    with torch.no_grad():
        heads.blocks[0][0].linear.weight.fill_(1.0)
    assert all(not torch.equal(block[0].linear.weight, heads.blocks[0][0].linear.weight) for block in heads.blocks[1:])
    assert not torch.equal(heads.blocks[0][1].linear.weight, heads.blocks[0][0].linear.weight)


@pytest.mark.parametrize("own_lm_head", [False, True])
def test_untrained_heads_start_as_the_next_token_head(own_lm_head):
    model = tiny_model("gemma2")  # soft-capped logits: the heads must apply the same capping
    adapter = ModelAdapter(model)
    heads = MedusaHeads(adapter.fingerprint(), num_heads=3, own_lm_head=own_lm_head)
    heads.init_own_lm_heads(model.get_output_embeddings())
    prompt = random_prompt(6)
    logits, hidden = adapter.forward_with_hidden(prompt, torch.arange(6)[None], adapter.new_cache(), logits_to_keep=1)
    proposals = heads.logits(hidden[:, -1], adapter)  # [1, 3, V]
    for head in range(3):
        torch.testing.assert_close(proposals[:, head], logits[:, -1])


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model(request):
    return tiny_model(request.param)


def test_chain_greedy_matches_generate(model):
    heads = medusa_heads(model, num_heads=5)
    for gamma, prompt_length in [(1, 1), (2, 17), (3, 5), (5, 50), (4, 9)]:
        prompt = random_prompt(prompt_length, seed=gamma)
        expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
        spec = SelfSpeculative(model, heads=heads, num_draft_tokens=gamma)
        actual = spec.generate(prompt, max_new_tokens=40, do_sample=False)
        assert torch.equal(actual, expected), (model.config.model_type, gamma, prompt_length)
        assert spec.stats.new_tokens == spec.stats.accepted + spec.stats.target_passes


def test_round_trip_gives_identical_weights_and_generations(tmp_path):
    model = tiny_model("qwen2")
    heads = medusa_heads(model, num_heads=3, own_lm_head=True, seed=2)
    heads.save_pretrained(tmp_path / "medusa")
    spec = SelfSpeculative(model, heads=tmp_path / "medusa")
    assert isinstance(spec.heads, MedusaHeads) and spec.num_draft_tokens == 3 and spec.drafter.tree is None
    heads.tree = [[0], [1], [0, 0]]
    heads.save_pretrained(tmp_path / "medusa-tree")
    with_tree = SelfSpeculative(model, heads=tmp_path / "medusa-tree")
    assert with_tree.drafter.tree.paths == [(0,), (1,), (0, 0)]
    for name, tensor in heads.state_dict().items():
        assert torch.equal(spec.heads.state_dict()[name], tensor)
    prompt = random_prompt(7, seed=4)
    outputs = [s.generate(prompt, max_new_tokens=30) for s in (SelfSpeculative(model, heads=heads), spec)]
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], model.generate(prompt, max_new_tokens=30))


def test_medusa_argument_errors(tmp_path):
    model = tiny_model("llama")
    heads = medusa_heads(model, num_heads=3)
    with pytest.raises(ValueError, match="exit_layer does not apply"):
        SelfSpeculative(model, heads=heads, exit_layer=2)
    with pytest.raises(ValueError, match="from 1 to 3"):
        SelfSpeculative(model, heads=heads, num_draft_tokens=4)
    heads.save_pretrained(tmp_path / "medusa")
    with pytest.raises(HeadsMismatchError, match="vocab_size=96.*vocab_size=80"):
        SelfSpeculative(tiny_model("llama", vocab_size=80), heads=tmp_path / "medusa")


TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [1, 0, 0], [0, 0, 0, 0]]


class FutureOracle(BaseStreamer):
    """Stands in for well-trained heads: it watches the committed tokens (as a streamer) and proposes the
    reference continuation, at rank 0 or 1 depending on the position, or not at all every fifth one, so
    that deep paths, sibling branches and rejections all happen."""

    def __init__(self, continuation: list[int], vocab_size: int, perfect: bool = False):
        self.continuation, self.vocab_size, self.committed = continuation, vocab_size, -1
        self.perfect = perfect  # always the right token at rank 0: an ideal draft

    def put(self, value):
        # the first call carries the prompt; later ones the committed tokens, the pending one included
        self.committed = 0 if self.committed < 0 else self.committed + value.numel()

    def end(self):
        pass

    def logits(self, hidden, adapter, count=None, vocab=None):
        generator = torch.Generator().manual_seed(self.committed)
        num_heads = 4
        proposals = torch.randn(1, num_heads, self.vocab_size, generator=generator)
        for head in range(num_heads):
            index = self.committed + head  # the token after the pending one, then further
            if index >= len(self.continuation) or (index % 5 == 4 and not self.perfect):
                continue
            token = self.continuation[index]
            top = proposals[0, head].max()
            # rank 0, or rank 1 (or lower)
            proposals[0, head, token] = top + 1 if index % 3 or self.perfect else top - 1e-3
        return proposals.to(hidden.device)


def test_tree_greedy_matches_generate(model):
    heads = medusa_heads(model, num_heads=4)
    for prompt_length in (1, 9, 50):
        prompt = random_prompt(prompt_length, seed=prompt_length)
        expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
        oracle = FutureOracle(expected[0, prompt_length:].tolist(), model.config.vocab_size)
        spec = SelfSpeculative(model, heads=heads, tree=TREE, adaptive=False)
        spec.heads.logits = oracle.logits
        actual = spec.generate(prompt, max_new_tokens=40, do_sample=False, streamer=oracle)
        assert torch.equal(actual, expected), (model.config.model_type, prompt_length)
        stats = spec.stats
        assert stats.new_tokens == stats.accepted + stats.target_passes
        assert stats.accepted_per_position[2] > 0 and stats.accepted < stats.proposed  # deep paths and rejections
    # real (random) heads on the same tree: also exact
    actual = SelfSpeculative(model, heads=heads, tree=TREE, adaptive=False).generate(
        prompt, max_new_tokens=40, do_sample=False
    )
    assert torch.equal(actual, expected)


def test_tree_with_left_padding_and_processors():
    model = tiny_model("gemma2")
    heads = medusa_heads(model, num_heads=4)
    prompt = torch.cat([torch.zeros(1, 3, dtype=torch.long), random_prompt(12, seed=3)], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 12, dtype=torch.long)], dim=1)
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, repetition_penalty=1.3)
    expected = model.generate(prompt, **kwargs)
    oracle = FutureOracle(expected[0, 15:].tolist(), model.config.vocab_size)
    spec = SelfSpeculative(model, heads=heads, tree=TREE, adaptive=False)
    spec.heads.logits = oracle.logits
    assert torch.equal(spec.generate(prompt, streamer=oracle, **kwargs), expected)


@pytest.mark.parametrize(
    "tree,message",
    [
        ([[0], [0]], "twice"),
        ([[0, 1]], "no parent"),
        ([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]], "only 4 heads"),
        ([[-1]], "non-negative"),
        ([[0], [96]], "rank 96, but the model has 96 tokens"),  # failed in generate, in torch's topk
        ({"nodes": 8, "top_k": 3, "depth": 4}, "paths of sibling ranks"),  # an EAGLE shape: "Tree path 'nodes'"
    ],
)
def test_bad_trees_are_refused(tree, message):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=message):
        SelfSpeculative(model, heads=medusa_heads(model, num_heads=4), tree=tree)
    with pytest.raises(ValueError, match="needs Medusa or EAGLE heads"):
        SelfSpeculative(model, tree=[[0]])


def test_an_empty_tree_forces_a_chain_over_the_heads_default_tree():
    model = tiny_model("llama")
    heads = medusa_heads(model, num_heads=3)
    heads.tree = [[0], [1], [0, 0]]
    assert SelfSpeculative(model, heads=heads).drafter.tree is not None
    chain = SelfSpeculative(model, heads=heads, tree=[])
    assert chain.drafter.tree is None
    prompt = random_prompt(5, seed=8)
    expected = model.generate(prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(chain.generate(prompt, max_new_tokens=20, do_sample=False), expected)
    assert chain.stats.proposed > 0  # drafted as a chain
    with pytest.raises(ValueError, match="at least one path"):
        from selfspec.engine.tree import CandidateTree

        CandidateTree.from_paths([])


def test_a_tree_is_built_once_per_list_of_paths():
    """Dynamic and merged trees recur in a few shapes: the same ranks, as lists or tuples, give the very same tree;
    bad paths raise each time (an error is not remembered as a tree)."""
    from selfspec.engine.tree import CandidateTree

    first = CandidateTree.from_paths([[0], [1], [0, 0]])
    assert CandidateTree.from_paths([(0,), (1,), (0, 0)]) is first
    assert CandidateTree.from_paths([[0], [1]]) is not first
    assert first.parent.tolist() == [0, 0, 0, 1] and first.prefixes == [[], [1], [2], [1, 3]]
    for _ in range(2):
        with pytest.raises(ValueError, match="lists a path twice"):
            CandidateTree.from_paths([[0], [0]])
    with pytest.raises(ValueError, match=r"Tree path \[-1\]"):
        CandidateTree.from_paths([[-1]])
    with pytest.raises(ValueError, match="integer ranks"):  # equal to a cached tree's ranks, and still checked
        CandidateTree.from_paths([[0.0], [1], [0, 0]])
    with pytest.raises(ValueError, match="non-negative integer ranks"):
        CandidateTree.from_paths([3])
