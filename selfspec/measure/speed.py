"""`selfspec speed`: the one-line calls side by side, on the same prompts, interleaved prompt by prompt:
`model.generate`, `SelfSpeculative(model)` and, with a bundle, `SelfSpeculative(model, heads=BUNDLE)`. It prints the
start-up (wrapping and the first call), the speedup of each over `model.generate` (tokens/s ratio, and the median of
per-prompt ratios), per category for Spec-Bench questions, and the greedy check; `--output` keeps a JSON record and a
PNG of the speedup per category."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from .prompts import ChatPrompt
from .ties import TIE, compare_greedy


def timed(run, inputs) -> tuple[torch.Tensor, float]:
    started = time.perf_counter()
    out = run(inputs)
    return out, time.perf_counter() - started


def measure_speed(model, tokenizer, prompts: list[str], bundle, max_new_tokens: int, temperature: float | None):
    """{contender: {"seconds", "tokens", "ratios", "categories", "greedy"}} and the start-up seconds per wrapper."""
    from ..speculative import SelfSpeculative

    sampling = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0} if temperature else {}
    options = {"max_new_tokens": max_new_tokens, "do_sample": False, **sampling}
    encoded = [tokenizer(p, return_tensors="pt", add_special_tokens=not isinstance(p, ChatPrompt)) for p in prompts]
    wrappers, startup = {"SelfSpeculative(model)": {}}, {}
    if bundle is not None:
        wrappers[f"SelfSpeculative(model, heads={str(bundle)!r})"] = {"heads": bundle}
    runs = {"model.generate": lambda inputs: model.generate(**inputs, **options)}
    for name, arguments in wrappers.items():
        started = time.perf_counter()
        spec = SelfSpeculative(model, **arguments)
        wrapped = time.perf_counter() - started
        spec.generate(**encoded[0], max_new_tokens=2)  # the first call measures v
        startup[name] = (wrapped, time.perf_counter() - started - wrapped)
        runs[name] = lambda inputs, spec=spec: spec.generate(**inputs, **options)
    results = {name: {"seconds": 0.0, "tokens": 0, "ratios": [], "categories": {}, "greedy": []} for name in runs}
    for prompt, inputs in zip(prompts, encoded, strict=True):
        ids = inputs["input_ids"]
        reference, base = None, None
        for name, run in runs.items():
            out, seconds = timed(run, inputs)
            result = results[name]
            result["seconds"] += seconds
            result["tokens"] += out.shape[1] - ids.shape[1]
            if reference is None:
                reference, base = out, seconds / max(1, out.shape[1] - ids.shape[1])
                continue
            ratio = base / (seconds / max(1, out.shape[1] - ids.shape[1]))  # per-token time ratio on this prompt
            result["ratios"].append(ratio)
            result["categories"].setdefault(getattr(prompt, "category", "all"), []).append(ratio)
            if not sampling:
                result["greedy"].append(compare_greedy(model, ids, reference, out))
    return results, startup


def speed_table(results: dict, startup: dict, temperature: float | None) -> str:
    plain = results["model.generate"]
    mode = f"T={temperature}" if temperature else "greedy"
    lines = [f"| contender ({mode}) | tokens/s | speedup | median per prompt | greedy check |", "|---|---|---|---|---|"]
    for name, result in results.items():
        rate = result["tokens"] / result["seconds"]
        if name == "model.generate":
            lines.append(f"| {name} | {rate:.1f} | 1.00x | - | - |")
            continue
        speedup = rate / (plain["tokens"] / plain["seconds"])
        checks = result["greedy"]
        check = "-" if not checks else (
            f"{sum(c is True for c in checks)} identical, {sum(c is TIE for c in checks)} tie, "
            f"{sum(c is False for c in checks)} other"
        )  # fmt: skip
        lines.append(f"| {name} | {rate:.1f} | {speedup:.2f}x | {statistics.median(result['ratios']):.2f}x | {check} |")
    lines.append("")
    for name, (wrapped, first) in startup.items():
        lines.append(f"start-up of {name}: wrapping {wrapped:.1f} s, first call (2 tokens, v measured) {first:.1f} s")
    categories = {c for result in results.values() for c in result["categories"]}
    if len(categories) > 1:
        lines += ["", "median speedup per category: " + ", ".join(sorted(categories))]
        for name, result in list(results.items())[1:]:
            medians = [f"{statistics.median(result['categories'][c]):.2f}x" for c in sorted(categories)]
            lines.append(f"  {name}: {', '.join(medians)}")
    return "\n".join(lines)


def save_speed(results: dict, startup: dict, output: Path, command: str) -> None:
    """results.json (the figures and the command) and speedup_by_category.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output.mkdir(parents=True, exist_ok=True)
    record = {"command": command, "startup": startup}
    record["contenders"] = {
        name: {**{k: v for k, v in result.items() if k != "greedy"}, "greedy": [str(c) for c in result["greedy"]]}
        for name, result in results.items()
    }
    (output / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    contenders = list(results.items())[1:]
    categories = sorted({c for _, result in contenders for c in result["categories"]})
    figure, axes = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(contenders)
    for index, (name, result) in enumerate(contenders):
        medians = [statistics.median(result["categories"].get(c, [float("nan")])) for c in categories]
        axes.bar([x + index * width for x in range(len(categories))], medians, width, label=name)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks([x + width * (len(contenders) - 1) / 2 for x in range(len(categories))], categories)
    axes.set_ylabel("speedup over model.generate")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(output / "speedup_by_category.png", dpi=120)
