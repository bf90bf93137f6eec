"""The two ways the chat-data pipeline decodes: transformers in this process (`decode.py`'s shrinking batches),
or vLLM's offline engine (continuous batching and paged attention: several times the answer tokens per second
on a CPU, where the transformers cache is copied at every step and long prompts dominate). Both take prompts
as token ids and yield (prompt indices, [(token ids, truncated)]) per finished batch."""

from __future__ import annotations

import os


class TransformersEngine:
    """The target loaded by selfspec (a known target's name or a model folder) on `device` (a CPU's threads, or a
    GPU), decoded by `decode.decode`."""

    name = "transformers"

    def __init__(
        self, target: str, dtype: str, num_threads: int, batch_size: int, token_budget: int, device: str = "cpu"
    ):
        import torch

        from selfspec.targets import load_model

        torch.set_num_threads(num_threads)
        self.model, self.tokenizer = load_model(target, dtype=dtype)
        self.model.to(device)
        self.device = torch.device(device)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.dtype = str(self.model.dtype).removeprefix("torch.")
        self.batch_size, self.token_budget = batch_size, token_budget

    def run(self, prompts: list[list[int]], temperature: float | None, max_new_tokens: int, seed: int):
        """Batches under the token budget, shortest prompts first, each yielded when it is done."""
        import torch

        from selfspec.measure.bench import left_pad

        from .decode import decode

        order = sorted(range(len(prompts)), key=lambda k: len(prompts[k]))
        start, stop_ids, pad = 0, {self.tokenizer.eos_token_id}, self.tokenizer.pad_token_id
        while start < len(order):
            rows = max(1, min(self.batch_size, self.token_budget // len(prompts[order[start]])))
            group = order[start : start + rows]
            while len(group) > 1 and len(group) * len(prompts[group[-1]]) > self.token_budget:
                group.pop()
            start += len(group)
            ids, mask = (t.to(self.device) for t in left_pad([torch.tensor([prompts[k]]) for k in group], pad))
            generator = torch.Generator(self.device).manual_seed(seed + group[0])
            yield group, decode(self.model, ids, mask, max_new_tokens, stop_ids, temperature, generator)


class VllmEngine:
    """vLLM's offline `LLM` on a model folder (vLLM reads transformers folders, not GGUF files: write one with
    `selfspec export --format hf`). It runs in vLLM's own environment, one process, on this CPU's threads."""

    name = "vllm"

    def __init__(self, target: str, dtype: str, num_threads: int, max_model_len: int, seed: int, chunk: int = 256):
        if not os.path.isdir(target):
            raise SystemExit(f"--engine vllm needs a model folder as --target (got {target!r})")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: the machine is shared
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("OMP_NUM_THREADS", str(num_threads))
        from vllm import LLM

        self.llm = LLM(model=target, dtype=dtype, max_model_len=max_model_len, enforce_eager=True, seed=seed)
        self.tokenizer = self.llm.get_tokenizer()
        self.dtype, self.chunk = dtype, chunk

    def run(self, prompts: list[list[int]], temperature: float | None, max_new_tokens: int, seed: int):
        """Chunks of `chunk` prompts, each decoded with continuous batching and yielded when it is done. vLLM's CPU
        build takes no seed per request ("CPU Generator does not use offset"): sampled answers follow the
        engine's seed (make_chat_data.py derives it from where a session starts) and the order of requests."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        eos = self.tokenizer.eos_token_id
        for start in range(0, len(prompts), self.chunk):
            group = list(range(start, min(start + self.chunk, len(prompts))))
            params = [
                SamplingParams(temperature=temperature or 0.0, max_tokens=max_new_tokens, stop_token_ids=[eos])
                for _ in group
            ]
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=prompts[k]) for k in group], params,
                                        use_tqdm=False)  # fmt: skip
            results = []
            for output in outputs:
                tokens = list(output.outputs[0].token_ids)
                if tokens and tokens[-1] == eos:
                    tokens = tokens[:-1]
                results.append((tokens, output.outputs[0].finish_reason == "length"))
            yield group, results
