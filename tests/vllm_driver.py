"""Greedy generation with vLLM and an EAGLE-3 draft, recording what tests/test_vllm.py compares with selfspec.

It runs in a Python that has vLLM, not selfspec (vLLM pins a transformers below selfspec's range), so it imports
vLLM, torch and the standard library only:

    PYTHON_WITH_VLLM tests/vllm_driver.py REQUEST.json RESULT.json

REQUEST.json: {"engines": [{"model": a folder vLLM loads (a speculators draft folder, or the target's folder with
"speculative_config"), "speculative_config": a dict or absent}, ...], "prompts": [[token ids], ...], "max_tokens": n,
"dtype": "float32"}. The engines run one after the other in this process, the prompts one at a time (a batch of
one, as selfspec runs them), greedy.

RESULT.json: per engine, "seconds" (its start-up and generation) and per prompt its "output" (token ids), its
"steps" (each proposal, see `record_proposals`) and the spec-decode counters it added ("drafts", "draft_tokens",
"accepted", "accepted_per_position").
"""

from __future__ import annotations

import json
import os
import sys
import time

# vLLM's CPU build in this process (so that the proposer can be watched), on one thread, with a small KV cache
for name, value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
}.items():
    os.environ.setdefault(name, value)

import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM  # noqa: E402
from vllm.v1.spec_decode.eagle import EagleProposer  # noqa: E402

COUNTERS = {  # vLLM's spec-decode counters -> the result's names
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_position",
}


def record_proposals(steps: list) -> None:
    """Append each EAGLE-3 proposal to `steps`, one request at a time: {"pending": the token the drafts follow,
    "drafts": [ids], "top2": per draft position, the draft model's two best {"logits", "ids"}}. The
    proposer's `propose` returns the draft ids [batch, k] after the token just sampled; the draft model's
    `compute_logits` gives the logits [batch, vocabulary] of each draft position on the way."""
    propose, compute_logits, top2 = EagleProposer.propose, Eagle3LlamaForCausalLM.compute_logits, []

    def recorded_logits(self, hidden_states):
        logits = compute_logits(self, hidden_states)
        best = logits.float().topk(2, dim=-1)  # [batch, 2]
        top2.append([{"logits": v, "ids": i} for v, i in zip(best.values.tolist(), best.indices.tolist(), strict=True)])
        return logits

    def recorded(self, *args, **kwargs):
        top2.clear()
        drafts = propose(self, *args, **kwargs)
        pending = kwargs["next_token_ids"]
        for row in range(len(pending)):
            step = [position[row] for position in top2]
            steps.append({"pending": int(pending[row]), "drafts": drafts[row].tolist(), "top2": step})
        return drafts

    EagleProposer.propose = recorded
    Eagle3LlamaForCausalLM.compute_logits = recorded_logits


def counters(llm: LLM) -> dict:
    """The spec-decode counters so far, summed over their label sets (per position: a list by draft position)."""
    totals = {name: 0 for name in COUNTERS.values()} | {"accepted_per_position": []}
    for metric in llm.get_metrics():
        name = COUNTERS.get(metric.name)
        if name == "accepted_per_position":
            totals[name] = add(totals[name], metric.values)
        elif name is not None:
            totals[name] += metric.value
    return totals


def add(a: list[int], b: list[int], sign: int = 1) -> list[int]:
    """a + sign * b, position by position (a missing position counts 0)."""
    width = max(len(a), len(b))
    a, b = a + [0] * (width - len(a)), b + [0] * (width - len(b))
    return [x + sign * y for x, y in zip(a, b, strict=True)]


def run(model: str, speculative_config: dict | None, request: dict, steps: list) -> dict:
    """One engine: its outputs, proposals and counters per prompt, and its start-up and generation seconds."""
    started = time.perf_counter()
    llm = LLM(
        model=model,
        speculative_config=speculative_config,
        dtype=request["dtype"],
        max_model_len=1024,
        enforce_eager=True,
        enable_prefix_caching=False,  # every prompt computed from its first token, as selfspec computes it
        disable_log_stats=False,  # keeps the spec-decode counters that get_metrics reads
        seed=0,
    )
    loaded = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"])
    prompts, before = [], counters(llm)
    for ids in request["prompts"]:
        steps.clear()
        output = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
        after = counters(llm)
        counts = {name: after[name] - before[name] for name in ("drafts", "draft_tokens", "accepted")}
        counts["accepted_per_position"] = add(after["accepted_per_position"], before["accepted_per_position"], -1)
        prompts.append({"output": list(output.token_ids), "steps": list(steps), **counts})
        before = after
    del llm
    return {"prompts": prompts, "seconds": {"start": loaded - started, "generate": time.perf_counter() - loaded}}


def main(request_path: str, result_path: str) -> None:
    request = json.loads(open(request_path).read())
    torch.set_num_threads(1)
    steps: list = []
    record_proposals(steps)
    results = [run(engine["model"], engine.get("speculative_config"), request, steps) for engine in request["engines"]]
    with open(result_path, "w") as file:
        json.dump(results, file)


if __name__ == "__main__":
    main(*sys.argv[1:])
