"""The target's linear layers in oneDNN's blocked weight layout, for passes over several positions (`PackedLinears`).

A verify pass is a product of a few rows (gamma + 1 positions, a tree's candidates) with every weight of the model.
For such products MKL's float32 kernels read a row-major weight at about half the speed of one row's product: on
the AMD EPYC (AVX2) this was measured on, SmolLM2-135M's linear layers and LM head took 50 ms for one row, 88 for
two and 103 for four, when each pass reads the weights from memory. oneDNN, with each weight reordered once into its
own blocked layout, took 60 ms for two rows and 69 for four (docs/benchmarks.md, "Packed weights for verify
passes"). So the adapter keeps such a copy of the target's float32 linear weights and, around a full pass over two
or more rows (positions times prompts: `ModelAdapter._forward`), points each `nn.Linear` of the target at it; a
one-position step of one prompt keeps torch's own product, as `model.generate` runs it (a batch's steps have a row
per prompt and use the packed copy). The results differ from MKL's only in float32 rounding,
as a pass over several positions already does from one-position steps.

The price is memory: a second copy of those weights (one, however many wrappers drive the model). `packed_by_default`
switches it on only for a float32 target on an x86 CPU whose copy takes at most a tenth of the machine's memory;
`SelfSpeculative(packed_weights=False)` keeps one copy. A weight changed after packing (in place, or replaced) is
packed again at its next use, so the products always follow the model's current weights.
"""

from __future__ import annotations

import os
import platform
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

MEMORY_SHARE = 0.1  # packed by default only where the copy takes at most this share of the machine's memory
X86 = ("x86_64", "amd64", "i686")


def packing_available() -> tuple[bool, str]:
    """(whether this torch build packs linear weights with oneDNN, the reason when it does not)."""
    if not torch.backends.mkldnn.is_available():
        return False, "this torch build has no oneDNN (mkldnn)"
    if not torch.backends.mkldnn.enabled:
        return False, "oneDNN is switched off (torch.backends.mkldnn.enabled is False)"
    try:
        torch.ops.mkldnn._linear_pointwise, torch.ops.mkldnn._reorder_linear_weight  # noqa: B018
    except (AttributeError, RuntimeError):
        return False, "this torch build lacks oneDNN's packed linear ops"
    return True, ""


def physical_memory() -> int | None:
    """Bytes of memory this machine has (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def packable(module: nn.Module) -> bool:
    """An `nn.Linear` itself (not a subclass: quantized or adapter layers compute otherwise) with float32 weights
    on a CPU, whose `forward` nothing else has replaced (accelerate's offloading hooks do). Weights made under
    `torch.inference_mode` are left alone: they keep no version counter, so a change to them could not be seen."""
    weight = getattr(module, "weight", None)
    return (
        type(module) is nn.Linear
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and not weight.is_inference()
        and "forward" not in module.__dict__
    )


def linear_bytes(model: nn.Module) -> int:
    """Bytes a packed copy of the model's packable linear weights takes."""
    return sum(m.weight.nelement() * m.weight.element_size() for m in model.modules() if packable(m))


def packed_by_default(model: nn.Module, memory: int | None = None) -> tuple[bool, str]:
    """(whether `SelfSpeculative` packs this model's linear weights unless told, the reason). `memory`: the
    machine's bytes (default: `physical_memory()`)."""
    weight = model.get_output_embeddings().weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return False, f"packed weights are for float32 targets on a CPU (this one: {weight.dtype} on {weight.device})"
    if platform.machine().lower() not in X86:
        return False, f"packed weights were measured on x86 CPUs only (this one: {platform.machine()})"
    available, why = packing_available()
    if not available:
        return False, why
    size, memory = linear_bytes(model), physical_memory() if memory is None else memory
    if not size:
        return False, "no linear layer of this model can be packed (see `packable`)"
    if memory is None or size > MEMORY_SHARE * memory:
        share = "unknown" if memory is None else f"{size / memory:.0%}"
        return False, f"a packed copy ({size / 2**20:,.0f} MiB) would take {share} of this machine's memory"
    return True, f"a packed copy of the linear weights: {size / 2**20:,.0f} MiB"


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] reordered into oneDNN's blocked layout (an opaque tensor for `packed_product` only)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with `packed = pack(weight)`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@dataclass
class _Packed:
    weight: torch.Tensor  # the parameter it was packed from, and its state then:
    version: int
    address: int
    packed: torch.Tensor


# nn.Linear -> its packed weight: one copy per layer, however many wrappers drive the model; weak, so it goes with it
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class PackedLinears:
    """A packed copy of a model's float32 `nn.Linear` weights, used inside `with packed(): ...` for products of two
    rows or more. Packing happens at a weight's first use; the copies are shared by every `PackedLinears` of the
    model."""

    def __init__(self, model: nn.Module):
        available, why = packing_available()
        if not available:
            raise RuntimeError(f"packed_weights: {why}.")
        self.modules = [m for m in model.modules() if packable(m)]
        if not self.modules:
            raise ValueError(
                f"packed_weights: {type(model).__name__} has no float32 nn.Linear on a CPU to pack (its dtype or "
                "device, or hooks that replaced the layers' forward)."
            )
        self._forwards = [(m, self._forward_of(m)) for m in self.modules]  # built once: a pass only assigns them

    @property
    def nbytes(self) -> int:
        """Bytes the packed copies of this model's layers made so far take."""
        entries = [_PACKED[m] for m in self.modules if m in _PACKED]
        return sum(entry.packed.nelement() * entry.packed.element_size() for entry in entries)

    def _weight(self, module: nn.Linear) -> torch.Tensor:
        """The packed copy of `module.weight`, packed again if the weight changed since."""
        weight = module.weight
        entry = _PACKED.get(module)
        state = (weight._version, weight.data_ptr())
        if entry is None or entry.weight is not weight or (entry.version, entry.address) != state:
            entry = _PACKED[module] = _Packed(weight, *state, pack(weight))
        return entry.packed

    def _forward_of(self, module: nn.Linear):
        def forward(x: torch.Tensor) -> torch.Tensor:
            rows, weight = x.numel() // max(x.shape[-1], 1), module.weight
            if (
                rows < 2  # one row: torch's product is as fast
                or weight.dtype != torch.float32  # the model was moved since (`packable`)
                or weight.device.type != "cpu"
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))  # autograd: torch's
            ):
                return F.linear(x, weight, module.bias)
            return packed_product(x, self._weight(module), module.bias)

        return forward

    @contextmanager
    def __call__(self):
        """Within the block, the model's packable linear layers multiply two rows or more with the packed weights
        (nothing else about the model changes; on leaving, every layer is as it was)."""
        pointed = []
        for module, forward in self._forwards:
            if "forward" not in module.__dict__:  # a forward set on the layer since (a hook's) stays in charge
                module.__dict__["forward"] = forward  # an instance attribute: nn.Module.__call__ finds it first
                pointed.append(module)
        try:
            yield
        finally:
            for module in pointed:
                module.__dict__.pop("forward", None)
