"""Passes over several positions multiply with a packed copy of the linear weights (`selfspec.adapter.packed`): the
same logits up to float32 rounding, the packed product only where it applies, the layers as they were after every
pass, weights changed after packing followed, greedy output identical to `model.generate` with and without it,
and the default's rule."""

import pytest
import torch
from test_medusa import TREE, medusa_heads
from tiny_models import padded_prompts, random_prompt, tiny_model

from selfspec import SelfSpeculative
from selfspec.adapter import ModelAdapter, packed
from selfspec.adapter.packed import PackedLinears, packed_by_default

pytestmark = pytest.mark.skipif(not packed.packing_available()[0], reason="this torch build cannot pack weights")


def product_rows(monkeypatch) -> list[int]:
    """Records the rows of every packed product."""
    rows, real = [], packed.packed_product

    def spy(x, weight, bias):
        rows.append(x.numel() // x.shape[-1])
        return real(x, weight, bias)

    monkeypatch.setattr(packed, "packed_product", spy)
    return rows


def linear_layers(model) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def test_a_pass_over_several_positions_multiplies_packed_weights_and_one_position_does_not(monkeypatch):
    model = tiny_model("llama", seed=1)
    ours, theirs = ModelAdapter(model, packed_weights=True), ModelAdapter(model)
    assert len(ours.packed.modules) == len(linear_layers(model)) == 7 * model.config.num_hidden_layers + 1
    rows = product_rows(monkeypatch)
    prompt, drafts, step = torch.randint(2, 96, (1, 30)), torch.randint(2, 96, (1, 5)), torch.randint(2, 96, (1, 1))
    with torch.no_grad():
        logits = {}
        for name, adapter in (("packed", ours), ("plain", theirs)):
            cache = adapter.new_cache()
            adapter.forward(prompt, torch.arange(30)[None], cache)
            verified = adapter.forward(drafts, torch.arange(30, 35)[None], cache)
            stepped = adapter.forward(step, torch.tensor([[35]]), cache)
            logits[name] = verified, stepped
    layers = len(ours.packed.modules)
    assert rows == [30] * layers + [5] * layers  # the prompt and the verify pass; the one-position step: none
    assert torch.allclose(logits["packed"][0], logits["plain"][0], atol=1e-4, rtol=1e-5)
    assert torch.equal(logits["packed"][0].argmax(-1), logits["plain"][0].argmax(-1))
    assert torch.allclose(logits["packed"][1], logits["plain"][1], atol=1e-4, rtol=1e-5)
    assert ours.packed.nbytes >= sum(m.weight.nelement() * 4 for m in linear_layers(model))
    assert all("forward" not in m.__dict__ for m in linear_layers(model))  # the layers as they were


def test_the_layers_are_restored_when_a_pass_fails():
    model = tiny_model("llama", seed=1)
    adapter = ModelAdapter(model, packed_weights=True)
    with pytest.raises(IndexError), torch.no_grad():
        adapter.forward(torch.tensor([[3, 500]]), torch.tensor([[0, 1]]), adapter.new_cache())  # id out of range
    assert all("forward" not in m.__dict__ for m in linear_layers(model))


def test_weights_changed_after_packing_are_packed_again():
    model = tiny_model("qwen2", seed=2)  # biased projections too
    linears = PackedLinears(model)
    head = model.get_output_embeddings()
    x = torch.randn(3, model.config.hidden_size)
    with torch.no_grad(), linears():
        assert torch.allclose(head(x), torch.nn.functional.linear(x, head.weight), atol=1e-5)
        head.weight.mul_(2.0)  # in place
        assert torch.allclose(head(x), torch.nn.functional.linear(x, head.weight), atol=1e-5)
        head.weight = torch.nn.Parameter(torch.randn_like(head.weight))  # replaced
        assert torch.allclose(head(x), torch.nn.functional.linear(x, head.weight), atol=1e-5)
        projection = next(m for m in linear_layers(model) if m.bias is not None)
        projection.bias.add_(1.0)  # the bias is read as it is at each call
        y = torch.randn(4, projection.in_features)
        expected = torch.nn.functional.linear(y, projection.weight, projection.bias)
        assert torch.allclose(projection(y), expected, atol=1e-5)


def test_a_model_moved_to_another_dtype_after_packing_multiplies_with_torch(monkeypatch):
    model = tiny_model("llama", seed=1)
    spec = SelfSpeculative(model, exit_layer=2, num_draft_tokens=3, packed_weights=True)
    prompt = random_prompt(12, seed=4)
    spec.generate(prompt, max_new_tokens=4, do_sample=False)  # packed
    rows = product_rows(monkeypatch)
    model.to(torch.float64)
    expected = model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(spec.generate(prompt, max_new_tokens=12, do_sample=False), expected)
    assert rows == []  # float64 weights: torch's products throughout


def test_autograd_and_one_row_keep_torch_product(monkeypatch):
    model = tiny_model("llama", seed=1)
    linears = PackedLinears(model)
    rows = product_rows(monkeypatch)
    head = model.get_output_embeddings()
    x = torch.randn(4, model.config.hidden_size, requires_grad=True)
    with linears():
        head(x).sum().backward()  # through torch's product: gradients flow
        with torch.no_grad():
            head(torch.randn(1, model.config.hidden_size))  # one row
            head(torch.randn(2, model.config.hidden_size))  # two
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert rows == [2]


def test_layers_whose_forward_was_replaced_or_made_in_inference_mode_are_left_alone():
    model = tiny_model("llama", seed=1)
    hooked = model.get_output_embeddings()
    hooked.forward = lambda x: torch.nn.functional.linear(x, hooked.weight)  # as accelerate's hooks do
    with torch.inference_mode():
        unversioned = model.model.layers[0].mlp.down_proj
        unversioned.weight = torch.nn.Parameter(unversioned.weight.clone(), requires_grad=False)
    linears = PackedLinears(model)
    assert hooked not in linears.modules and unversioned not in linears.modules
    assert len(linears.modules) == len(linear_layers(model)) - 2
    late = model.model.layers[1].self_attn.q_proj  # a hook set after packing
    theirs = late.forward = lambda x: torch.nn.functional.linear(x, late.weight)
    with linears():
        assert late.__dict__["forward"] is theirs
    assert "forward" in hooked.__dict__ and late.__dict__["forward"] is theirs  # still theirs
    with torch.inference_mode():
        built_there = tiny_model("llama", seed=1)
    assert packed.linear_bytes(built_there) == 0
    assert packed_by_default(built_there, memory=2**40) == (False, "no linear layer of this model can be packed (see "
                                                            "`packable`)")  # fmt: skip
    assert SelfSpeculative(built_there, exit_layer=2).packed_weights is False
    with pytest.raises(ValueError, match="no float32 nn.Linear"):
        PackedLinears(built_there)


@pytest.mark.parametrize("packed_weights", [True, False])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])
def test_greedy_output_equals_generate_with_and_without_packed_weights(arch, packed_weights, monkeypatch):
    model = tiny_model(arch, attention="sdpa")
    rows = product_rows(monkeypatch)
    chain = SelfSpeculative(model, exit_layer=2, num_draft_tokens=4, adaptive=False, packed_weights=packed_weights)
    tree = SelfSpeculative(model, heads=medusa_heads(model), tree=TREE, adaptive=False, packed_weights=packed_weights)
    for length in (1, 17, 50):
        prompt = random_prompt(length, seed=length)
        expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
        assert torch.equal(chain.generate(prompt, max_new_tokens=30, do_sample=False), expected), (arch, length)
        assert torch.equal(tree.generate(prompt, max_new_tokens=30, do_sample=False), expected), (arch, length)
    padded, mask = padded_prompts([9, 13, 4], seed=2)
    expected = model.generate(padded, attention_mask=mask, max_new_tokens=20, do_sample=False)
    assert torch.equal(chain.generate(padded, attention_mask=mask, max_new_tokens=20, do_sample=False), expected)
    assert bool(rows) == packed_weights  # packed products ran exactly when asked for


def test_the_default_rule(monkeypatch):
    model = tiny_model("llama", seed=1)
    size = packed.linear_bytes(model)
    assert size == sum(m.weight.nelement() * 4 for m in linear_layers(model))
    monkeypatch.setattr(packed.platform, "machine", lambda: "x86_64")
    assert packed_by_default(model, memory=10 * size)[0]
    on, why = packed_by_default(model, memory=10 * size - 1)
    assert not on and "of this machine's memory" in why
    monkeypatch.setattr(packed.platform, "machine", lambda: "aarch64")
    on, why = packed_by_default(model, memory=10 * size)
    assert not on and "aarch64" in why
    on, why = packed_by_default(tiny_model("llama", seed=1).to(torch.bfloat16), memory=10 * size)
    assert not on and "torch.bfloat16" in why


def test_selfspeculative_packs_by_the_rule_and_refuses_what_it_cannot_pack(monkeypatch):
    model = tiny_model("llama", seed=1)
    spec = SelfSpeculative(model, exit_layer=2)
    assert spec.packed_weights == packed_by_default(model)[0]
    assert (spec.adapter.packed is not None) == spec.packed_weights
    for machine in ("x86_64", "aarch64"):  # the rule on and off: the wrapper and a bare adapter follow it alike
        monkeypatch.setattr(packed.platform, "machine", lambda machine=machine: machine)
        on = packed_by_default(model)[0]
        assert on == (machine == "x86_64" and packed.packing_available()[0])
        assert SelfSpeculative(model, exit_layer=2).packed_weights is on
        assert (ModelAdapter(model, packed_weights=None).packed is not None) is on
    assert SelfSpeculative(model, drafter="ngram", compile=True).packed_weights is False
    assert SelfSpeculative(model, exit_layer=2, packed_weights=False).adapter.packed is None
    with pytest.raises(ValueError, match="no float32 nn.Linear"):
        SelfSpeculative(tiny_model("llama", seed=1).to(torch.bfloat16), exit_layer=2, packed_weights=True)
    with pytest.raises(ValueError, match="compile=True"):
        SelfSpeculative(model, drafter="ngram", compile=True, packed_weights=True)
    with pytest.raises(TypeError, match="packed_weights='yes'"):
        SelfSpeculative(model, exit_layer=2, packed_weights="yes")


def test_the_bench_runs_unpacked_copies_of_packed_contenders():
    from selfspec.measure.contenders import generate_contender, selfspec_contender, unpacked_contenders

    model = tiny_model("llama", seed=1)
    contenders = [
        generate_contender(model, "generate", False, 1.0),
        selfspec_contender(model, "selfspec exit", False, 1.0, exit_layer=2, packed_weights=True),
        selfspec_contender(model, "selfspec plain loop", False, 1.0, num_draft_tokens=0, packed_weights=False),
    ]
    (unpacked,) = unpacked_contenders(contenders)
    assert unpacked.name == "selfspec exit (unpacked)"
    assert unpacked.spec.packed_weights is False and unpacked.spec.adapter.packed is None
    assert unpacked.options == {"exit_layer": 2, "packed_weights": False}
    prompt = random_prompt(12, seed=3)
    assert torch.equal(unpacked.run(prompt, 16), contenders[0].run(prompt, 16))


def test_wrappers_of_one_model_share_one_packed_copy():
    model = tiny_model("llama", seed=1)
    first, second = ModelAdapter(model, packed_weights=True), ModelAdapter(model, packed_weights=True)
    with torch.no_grad():
        first.forward(torch.randint(2, 96, (1, 6)), torch.arange(6)[None], first.new_cache())
        copies = [packed._PACKED[m].packed for m in first.packed.modules]
        second.forward(torch.randint(2, 96, (1, 6)), torch.arange(6)[None], second.new_cache())
    assert all(packed._PACKED[m].packed is copy for m, copy in zip(second.packed.modules, copies, strict=True))
    assert second.packed.nbytes == first.packed.nbytes >= packed.linear_bytes(model)
