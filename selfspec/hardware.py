"""What this machine's processor does natively, and the dtype in which speculation pays on it.

A CPU decodes a small model at the speed it reads the weights only where its matrix kernels handle the dtype
natively. bfloat16 halves the bytes read, but on a CPU without bf16 instructions (AVX512-BF16 or AMX-BF16 on
x86) its matrix products fall back to slow kernels whose cost grows with the positions of a pass: a verify pass
over 4 positions then costs 2.4 plain steps instead of about 1, and drafting loses. So the demo and `selfspec
bench` run a target that would be bfloat16 in float32 on such a CPU, and training uses bf16 autocast only where
it is native.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 flags (/proc/cpuinfo) of native bf16 matrix instructions
ARM_BF16_FLAGS = ("bf16",)  # aarch64's BFloat16 extension (`Features` in /proc/cpuinfo)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The processor's feature flags as Linux lists them (empty where /proc/cpuinfo is not there)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_bf16(device: str | torch.device = "cpu") -> tuple[bool, str]:
    """(whether `device` multiplies bfloat16 matrices natively, the reason in a few words)."""
    import torch  # here, not at the top: the command line reads this module for --help

    device = torch.device(device)
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported()
        return native, f"this GPU {'supports' if native else 'does not support'} bfloat16"
    if device.type != "cpu":
        return True, f"{device.type} devices are taken to support bfloat16"
    flags = cpu_flags()
    found = [flag for flag in BF16_FLAGS + (ARM_BF16_FLAGS if platform.machine() == "aarch64" else ()) if flag in flags]
    if found:
        return True, f"this CPU has native bf16 ({', '.join(found)})"
    if not flags:
        return False, "this CPU's features could not be read (no /proc/cpuinfo)"
    return False, "this CPU has no native bf16 (avx512_bf16, amx_bf16): bf16 matrix products take slow kernels"


def speculation_dtype(device: str | torch.device = "cpu") -> tuple[str, str]:
    """(dtype name, why) in which a target that runs in half precision where it can should run on `device`:
    bfloat16 where it is native (decoding reads half the bytes and a verify pass costs about a step), else float32
    (faster than bf16's fallback kernels over several positions, where a verify pass may still cost well over a
    step: 1.5-2.5 plain steps for 2-16 positions on an AVX2 Zen 3, which `spec.stats.verify_costs` shows)."""
    native, why = native_bf16(device)
    return ("bfloat16", why) if native else ("float32", why)
