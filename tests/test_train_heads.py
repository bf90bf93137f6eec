"""training/train_heads.py end to end, the data pipeline and `selfspec profile`, on a tiny trained Llama.

The target is trained in the test on a synthetic language (a sparse Markov chain whose sentences are then
repeated word for word), so its layers have real structure: the repeat needs attention, the chain does
not. The launch tests share one uninterrupted run (W&B offline) and compare the other runs with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from selfspec import ExitHeads, SelfSpeculative, load_heads
from selfspec.adapter import ModelAdapter
from selfspec.measure.profile import evaluate, first_of_each_answer
from selfspec.training.config import DataConfig
from selfspec.training.data import copy_pool, copy_rows, load_rows

ROOT = Path(__file__).resolve().parents[1]
WORDS = [f"w{i}" for i in range(20)]
VOCAB = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", "<unk>", "user", "assistant", ":"] + WORDS)}
MAX_STEPS = 40


def sentence(rng: random.Random, successors: dict, length: int = 8) -> str:
    """A chain of `length` words, then the same words again."""
    word = rng.choice(WORDS)
    words = [word]
    for _ in range(length - 1):
        word = rng.choices(successors[word], weights=(0.7, 0.2, 0.1))[0]
        words.append(word)
    return " ".join(words + words)


def build_tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    return tokenizer


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """A tiny Llama trained 200 steps on the synthetic language, its tokenizer, and data files."""
    root = tmp_path_factory.mktemp("world")
    rng = random.Random(0)
    successors = {word: rng.sample(WORDS, 3) for word in WORDS}
    documents = [sentence(rng, successors) for _ in range(1200)]
    stream = torch.tensor([VOCAB[w] for doc in documents for w in doc.split() + ["</s>"]])
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        starts = torch.randint(0, len(stream) - 64, (16,), generator=generator)
        batch = torch.stack([stream[s : s + 64] for s in starts])
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(root / "target")
    build_tokenizer().save_pretrained(root / "target")
    data = root / "data"
    (data / "heldout").mkdir(parents=True)
    with open(data / "train.jsonl", "w") as f:
        for doc in (sentence(rng, successors) for _ in range(400)):
            f.write(json.dumps({"text": doc}) + "\n")
    for i in range(6):  # held-out "source files", one document each
        (data / "heldout" / f"file{i}.txt").write_text("\n".join(sentence(rng, successors) for _ in range(4)))
    return {"root": root, "target": root / "target", "data": data, "successors": successors}


def write_config(world: dict, name: str, **overrides) -> Path:
    config = {
        "output_dir": str(world["root"] / name / "run"),
        "heads_dir": str(world["root"] / name / "heads"),
        "target": {"name_or_path": str(world["target"])},
        "data": {
            "source": str(world["data"] / "train.jsonl"),
            "heldout_files": str(world["data"] / "heldout"),
            "seq_len": 32,
        },
        "heads": {"exit_layers": [1, 2, 3]},
        "train": {
            "max_steps": MAX_STEPS,
            "batch_size": 8,
            "lr": 3e-3,
            "warmup_steps": 5,
            "mixed_precision": "no",
            "num_threads": 1,
            "checkpoint_every": 4,
        },
        "eval": {"every": 20, "max_rows": 16, "timing_context": 16, "timing_repeats": 3, "max_gamma": 4},
        "logging": {"log_every": 5},
    }
    for key, value in overrides.items():
        section, leaf = key.split(".")
        config.setdefault(section, {})[leaf] = value
    path = world["root"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def free_port() -> int:
    with socket.socket() as probe:  # another test session may run at the same time: never assume 29500 is free
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(world: dict, config: Path, *extra: str, processes: str = "--cpu", background: bool = False):
    """`accelerate launch ... training/train_heads.py` in a session of its own (killable as a group): the
    Popen if `background`, else (return code, output), killing the whole group if it runs for 5 minutes."""
    env = dict(
        os.environ,
        HF_DATASETS_CACHE=str(world["root"] / "hf_datasets"),
        HF_HUB_OFFLINE="1",
        WANDB_MODE="offline",
        WANDB_DIR=str(world["root"]),
        WANDB_SILENT="true",
        OMP_NUM_THREADS="1",
    )
    accelerate = Path(sys.executable).with_name("accelerate")
    command = [str(accelerate), "launch", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    command += ["--main_process_port", str(free_port()), *processes.split()]
    command += ["training/train_heads.py", "--config", str(config), *extra]
    output = subprocess.DEVNULL if background else subprocess.PIPE
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, start_new_session=True, stdout=output, stderr=subprocess.STDOUT, text=True
    )
    if background:
        return process
    try:
        out, _ = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        out, _ = process.communicate(timeout=60)
        raise AssertionError(f"timed out: {out[-3000:]}") from None
    return process.returncode, out


def kill_tree(pid: int) -> None:
    """Kill the launcher and every process under it. A group kill is not enough: torch.distributed.run starts
    each worker in a session of its own, and a worker left alive holds the output pipe open."""
    import psutil

    launcher = psutil.Process(pid)
    for process in [*launcher.children(recursive=True), launcher]:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def summary(world: dict, name: str) -> dict:
    return json.loads((world["root"] / name / "run" / "training_summary.json").read_text())


def heads_state(world: dict, name: str) -> dict:
    from safetensors.torch import load_file

    return load_file(world["root"] / name / "heads" / "model.safetensors")


@pytest.fixture(scope="module")
def baseline(world) -> str:
    """One uninterrupted run with W&B offline, asked for with `--report_to wandb` (the default logs to no tracker)."""
    target_file = world["target"] / "model.safetensors"
    before = hashlib.sha256(target_file.read_bytes()).hexdigest()
    config = write_config(world, "baseline", **{"logging.project": "selfspec-test"})
    code, out = launch(world, config, "--report_to", "wandb")
    assert code == 0, out[-3000:]
    assert hashlib.sha256(target_file.read_bytes()).hexdigest() == before
    return "baseline"


def test_launch_trains_heads_that_load_and_generate_exactly(world, baseline):
    facts = summary(world, baseline)
    assert facts["steps"] == MAX_STEPS and facts["processes"] == 1
    assert facts["target_digest"] == facts["target_digest_before"]  # the frozen target, bit for bit
    assert [row["draft"] for row in facts["rows"]] == ["exit_1", "exit_2", "exit_3"]

    model = AutoModelForCausalLM.from_pretrained(world["target"]).eval()
    heads = load_heads(world["root"] / baseline / "heads", ModelAdapter(model))
    assert isinstance(heads, ExitHeads) and heads.exit_layers == [1, 2, 3]
    prompt = torch.tensor([[VOCAB[w] for w in "w3 w7 w1 w5".split()]])
    expected = model.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    for exit_layer in heads.exit_layers:
        spec = SelfSpeculative(model, heads=world["root"] / baseline / "heads", exit_layer=exit_layer)
        out = spec.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(out, expected), exit_layer

    card = (world["root"] / baseline / "heads" / "README.md").read_text()
    assert "| exit_3 " in card and "train_heads.py" in card
    assert (world["root"] / baseline / "run" / "alpha_by_depth.png").read_bytes()[:4] == b"\x89PNG"
    checkpoints = sorted(p.name for p in (world["root"] / baseline / "run" / "checkpoints").iterdir())
    assert checkpoints == [f"step_{MAX_STEPS - 4:06d}", f"step_{MAX_STEPS:06d}"]  # the last two are kept

    (run_log,) = (world["root"] / "wandb").glob("offline-run-*/run-*.wandb")
    logged = run_log.read_bytes()
    for key in (
        "eval/alpha/exit_1",
        "eval/alpha/exit_2",
        "eval/alpha/exit_3",
        "eval/top1/exit_1",
        "eval/c/exit_1",
        "eval/speedup/exit_3",
        "train/tokens_per_s",
        "alpha_by_depth",
    ):
        assert key.encode() in logged, key
    tables = [json.loads(path.read_text()) for path in run_log.parent.glob("files/media/table/*.table.json")]
    per_eval = [table for table in tables if "draft" in table["columns"]]  # one per evaluation: steps 0, 20, 40
    assert len(per_eval) == 3
    for table in per_eval:
        assert {"depth", "alpha", "untrained_alpha", "c", "speedup"} <= set(table["columns"])
        assert [row[table["columns"].index("depth")] for row in table["data"]] == [1, 2, 3]
    assert any({"lineKey", "lineVal"} <= set(table["columns"]) for table in tables)  # the line plot's series


def test_sigkill_then_resume_ends_like_an_uninterrupted_run(world, baseline):
    config = write_config(world, "killed")
    checkpoints = world["root"] / "killed" / "run" / "checkpoints"
    process = launch(world, config, "--report_to", "none", background=True)
    deadline = time.monotonic() + 240
    while not list(checkpoints.glob("step_*")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    saved = sorted(int(p.name[5:]) for p in checkpoints.glob("step_*"))
    assert saved and saved[-1] < MAX_STEPS, saved  # killed mid-run
    assert not (world["root"] / "killed" / "heads").exists()

    code, out = launch(world, config, "--report_to", "none", "--resume")
    assert code == 0, out[-3000:]
    assert f"resumed from {checkpoints / f'step_{saved[-1]:06d}'}" in out
    facts = summary(world, "killed")
    assert facts["steps"] == MAX_STEPS and len(facts["commands"]) == 2
    resumed, uninterrupted = heads_state(world, "killed"), heads_state(world, baseline)
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in uninterrupted)  # data order included
    model = AutoModelForCausalLM.from_pretrained(world["target"]).eval()
    spec = SelfSpeculative(model, heads=world["root"] / "killed" / "heads", exit_layer=2)
    prompt = torch.tensor([[VOCAB["w4"], VOCAB["w9"]]])
    expected = model.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(spec.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None), expected)


KILL_DURING_SECOND_CHECKPOINT = """
import os, signal, sys
sys.path.insert(0, "training")
import accelerate
original = accelerate.Accelerator.save_state
calls = []

def save_then_die(self, output_dir=None, **kwargs):
    calls.append(output_dir)
    result = original(self, output_dir, **kwargs)
    if len(calls) == 2:  # the second checkpoint: half of one file written, then SIGKILL before the rename
        victim = os.path.join(output_dir, sorted(os.listdir(output_dir))[0])
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) // 2)
        os.kill(os.getpid(), signal.SIGKILL)
    return result

accelerate.Accelerator.save_state = save_then_die
import train_heads
train_heads.main(["--config", sys.argv[1], "--report_to", "none"])
"""


def test_sigkill_during_a_checkpoint_write_keeps_the_previous_one(world, baseline, monkeypatch):
    config = write_config(world, "killed_in_write")
    env = dict(os.environ, HF_DATASETS_CACHE=str(world["root"] / "hf_datasets"), OMP_NUM_THREADS="1")
    process = subprocess.run(
        [sys.executable, "-c", KILL_DURING_SECOND_CHECKPOINT, str(config)], cwd=ROOT, env=env, capture_output=True
    )
    assert process.returncode == -signal.SIGKILL, process.stderr[-3000:]
    checkpoints = world["root"] / "killed_in_write" / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["partial_step_000008", "step_000004"]
    monkeypatch.setenv("HF_DATASETS_CACHE", str(world["root"] / "hf_datasets"))
    train_in_process(config, "--resume")
    assert not (checkpoints / "partial_step_000008").exists()
    facts = summary(world, "killed_in_write")
    assert facts["steps"] == MAX_STEPS
    resumed, uninterrupted = heads_state(world, "killed_in_write"), heads_state(world, baseline)
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in uninterrupted)


def test_two_processes_train_what_one_process_trains(world, baseline):
    # accelerate 1.15 runs `--cpu --num_processes 2` as ONE process (several CPU processes only via mpirun);
    # the script refuses that instead of silently training alone.
    config = write_config(world, "two", **{"eval.every": MAX_STEPS})
    code, out = launch(world, config, "--report_to", "none", processes="--cpu --num_processes 2")
    assert code != 0 and "asked for 2 processes but started 1" in out
    # --multi_gpu on a machine without GPUs: torch.distributed.run, two CPU processes, gloo
    code, out = launch(world, config, "--report_to", "none", processes="--multi_gpu --num_processes 2")
    assert code == 0, out[-3000:]
    assert summary(world, "two")["processes"] == 2
    checkpoints = world["root"] / "two" / "run" / "checkpoints"  # no half-written folder left behind, ...
    assert sorted(path.name for path in checkpoints.iterdir()) == [f"step_{MAX_STEPS - 4:06d}", f"step_{MAX_STEPS:06d}"]
    for checkpoint in checkpoints.iterdir():  # ... and each process's random states in every checkpoint
        assert {"random_states_0.pkl", "random_states_1.pkl"} <= {path.name for path in checkpoint.iterdir()}
    two, one = heads_state(world, "two"), heads_state(world, baseline)
    for name in one:  # the same total batch: equal up to the order of the gradient all-reduce
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-5)


def test_profile_command_prints_untrained_and_trained_alpha(world, baseline, capsys):
    from selfspec.cli.main import main

    os.environ.setdefault("HF_DATASETS_CACHE", str(world["root"] / "hf_datasets"))
    output = world["root"] / "profile"
    args = ["profile", "--model", str(world["target"]), "--heads", str(world["root"] / baseline / "heads")]
    args += ["--data", str(world["data"] / "heldout"), "--seq_len", "32", "--max_rows", "8", "--output", str(output)]
    args += ["--timing_repeats", "3", "--timing_context", "16", "--max_gamma", "4", "--answer_tokens", "6"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    for column in ("untrained alpha", "trained alpha", "c", "predicted speedup", "exit_1", "exit_3"):
        assert column in printed
    assert "first 6 of each answer" not in printed  # plain text: no answers
    row = next(line for line in printed.splitlines() if line.startswith("| exit_3 "))
    cells = [cell.strip() for cell in row.strip("|").split("|")]  # draft, untrained alpha, top-1, trained alpha
    untrained, trained = float(cells[1]), float(cells[3])
    assert 0 < untrained < trained - 0.05 and trained <= 1  # the trained exit head is accepted more often
    assert (output / "alpha_by_depth.png").read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------------------------------------ data


def test_data_formats_render_and_pack(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    tokenizer = build_tokenizer()
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "a.txt").write_text("w1 w2 w3\nw4 w5")  # a source file: one document, newlines kept
    (folder / "b.txt").write_text("w6 w7")
    with open(tmp_path / "chat.jsonl", "w") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]}))
    pq.write_table(pa.table({"body": ["w8 w9", "w10"]}), tmp_path / "rows.parquet")

    (folder / "c.log").write_text("w0 w0 w0 w0")
    rows = load_rows(
        DataConfig(source=str(folder), exclude=f"{folder}/*.log,{folder}/none*", seq_len=4), tokenizer, split=False
    )
    ids = [VOCAB[w] for w in "w1 w2 w3 w4 w5 </s> w6 w7 </s>".split()]
    assert rows.heldout["input_ids"] == [ids[:4], ids[4:8]]  # packed across documents, remainder dropped
    chat = load_rows(DataConfig(source=str(tmp_path / "chat.jsonl"), seq_len=2), tokenizer, split=False)
    assert sum(chat.heldout["input_ids"], []) == [VOCAB[w] for w in "user : w1 assistant : w2".split()]
    parquet = load_rows(
        DataConfig(source=str(tmp_path / "rows.parquet"), text_field="body", seq_len=3), tokenizer, split=False
    )
    assert parquet.heldout["input_ids"] == [[VOCAB["w8"], VOCAB["w9"], VOCAB["</s>"]]]
    with pytest.raises(ValueError, match="rows.parquet, row 1: no text: neither a string `text`"):
        load_rows(DataConfig(source=str(tmp_path / "rows.parquet"), seq_len=3), tokenizer, split=False)
    with pytest.raises(FileNotFoundError, match="no file matches"):
        load_rows(DataConfig(source=str(tmp_path / "*.missing")), tokenizer)


def test_local_files_load_without_progress_bars(tmp_path, monkeypatch, capfd):
    """`datasets`' "Downloading data", "Generating train split" and map bars are noise for files on disk: none is
    printed, and its setting is as it was afterwards."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))  # a fresh cache: every step runs
    (tmp_path / "a.txt").write_text("w1 w2 w3 w4")
    with open(tmp_path / "b.jsonl", "w") as f:
        f.write(json.dumps({"text": "w5 w6"}) + "\n")
    disabled = datasets.are_progress_bars_disabled()
    rows = load_rows(DataConfig(source=f"{tmp_path}/a.txt,{tmp_path}/b.jsonl", seq_len=2), build_tokenizer(), False)
    assert len(rows.heldout) == 4
    assert capfd.readouterr().err == ""
    assert datasets.are_progress_bars_disabled() == disabled


def test_bad_rows_are_named_then_skipped_or_stop_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    tokenizer = build_tokenizer()
    lines = ['{"text": "w1 w2"}', "{broken", "", '{"title": "w3"}', "[1, 2]", '{"text": "w4 w5"}']
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"rows.jsonl, line 2: not JSON .*\(and 2 more\).*data.bad_rows: skip"):
        load_rows(DataConfig(source=str(tmp_path / "rows.jsonl"), seq_len=2), tokenizer, split=False)
    with pytest.warns(UserWarning, match=r"rows.jsonl: skipped 3 bad row\(s\), the first at line 2"):
        rows = load_rows(DataConfig(source=str(tmp_path / "rows.jsonl"), seq_len=2, bad_rows="skip"), tokenizer, False)
    assert sum(rows.heldout["input_ids"], []) == [VOCAB[w] for w in "w1 w2 </s> w4 w5 </s>".split()]
    with pytest.raises(ValueError, match="data.bad_rows must be one of"):
        DataConfig(bad_rows="ignore")


def test_heldout_split_by_file_and_by_seeded_fraction(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    tokenizer = build_tokenizer()
    for i in range(10):
        (tmp_path / f"doc{i}.txt").write_text(" ".join(WORDS[i : i + 4]))
    by_file = load_rows(
        DataConfig(source=f"{tmp_path}/*.txt", heldout_files=f"{tmp_path}/doc9.txt", seq_len=5), tokenizer
    )
    assert by_file.summary["train_documents"] == 9 and by_file.heldout["input_ids"] == [
        [VOCAB[w] for w in WORDS[9:13] + ["</s>"]]
    ]

    def heldout(seed: int) -> list:
        config = DataConfig(source=f"{tmp_path}/*.txt", heldout_fraction=0.3, seed=seed, seq_len=5)
        return load_rows(config, tokenizer).heldout["input_ids"]

    assert len(heldout(0)) == 3 and heldout(0) == heldout(0) and heldout(0) != heldout(1)


# ------------------------------------------------------------------------------- in-process training


@pytest.mark.parametrize("kind", ["exit", "medusa", "eagle"])
def test_trained_heads_raise_alpha_over_untrained_at_every_depth(world, kind, monkeypatch):
    from selfspec.heads import EagleHeads, MedusaHeads
    from selfspec.measure.profile import format_table, profile_heads
    from selfspec.training.config import EvalConfig, HeadsConfig
    from selfspec.training.data import row_tensor
    from selfspec.training.distill import DistillationObjective, target_pass

    monkeypatch.setenv("HF_DATASETS_CACHE", str(world["root"] / "hf_datasets"))
    model = AutoModelForCausalLM.from_pretrained(world["target"]).eval().requires_grad_(False)
    adapter = ModelAdapter(model)
    config = DataConfig(
        source=str(world["data"] / "train.jsonl"), heldout_files=str(world["data"] / "heldout"), seq_len=32
    )
    rows = load_rows(config, build_tokenizer())
    torch.manual_seed(0)
    if kind == "exit":
        heads = ExitHeads(adapter.fingerprint(), [1, 2, 3])
    elif kind == "medusa":
        heads = MedusaHeads(adapter.fingerprint(), num_heads=2)  # a third head (token t+4) barely learns here
    else:  # every unrolled step: the drafts 1, 2 and 3 ahead
        heads = EagleHeads.from_config(HeadsConfig(kind="eagle", layout="eagle3", feature_layers=[0, 1, 2]), adapter)
    objective = DistillationObjective(heads, adapter)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        index = torch.randint(len(rows.train), (8,), generator=generator).tolist()
        objective(*target_pass(model, row_tensor(rows.train, index))).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    heldout = row_tensor(rows.heldout, range(len(rows.heldout)))
    table = profile_heads(model, heads, heldout, EvalConfig(timing_context=16, timing_repeats=3, max_gamma=3))
    for row in table:  # the table shows only when the test fails (pytest -s does not print it either)
        assert row["alpha"] > row["untrained_alpha"] + 0.02, f"{kind} heads, 200 steps:\n{format_table(table)}"


def train_in_process(config: Path, *arguments: str) -> None:
    """training/train_heads.py's main() in this process (no launcher), W&B off."""
    from accelerate.state import AcceleratorState

    sys.path.insert(0, str(ROOT / "training"))
    try:
        import train_heads

        train_heads.main(["--config", str(config), "--report_to", "none", *arguments])
    finally:
        sys.path.remove(str(ROOT / "training"))
        AcceleratorState._reset_state(True)  # the next Accelerator starts afresh


def test_an_existing_heads_folder_is_replaced_only_with_overwrite(world, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(world["root"] / "hf_datasets"))
    config = write_config(world, "existing", **{"heads.exit_layers": [2], "train.max_steps": 2, "eval.every": 2})
    heads_dir = world["root"] / "existing" / "heads"
    heads_dir.mkdir(parents=True)
    (heads_dir / "config.json").write_text('{"kind": "exit"}')  # stands for shipped heads
    for arguments in ((), ("--resume",)):  # resuming a run that has no checkpoint replaces nothing either
        with pytest.raises(SystemExit, match=f"heads_dir {heads_dir} already exists.*pass --overwrite"):
            train_in_process(config, *arguments)
    assert not (world["root"] / "existing" / "run").exists()  # refused before any work
    assert (heads_dir / "config.json").read_text() == '{"kind": "exit"}'
    train_in_process(config, "--overwrite")
    heads = load_heads(heads_dir, ModelAdapter(AutoModelForCausalLM.from_pretrained(world["target"])))
    assert isinstance(heads, ExitHeads) and heads.exit_layers == [2]


def test_peft_target_trains_in_process_and_stays_frozen(world, tmp_path, monkeypatch):
    from peft import LoraConfig, PeftModel, get_peft_model

    monkeypatch.setenv("HF_DATASETS_CACHE", str(world["root"] / "hf_datasets"))
    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(world["target"])
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)  # non-zero: LoRA matters
    get_peft_model(base, lora).save_pretrained(tmp_path / "adapter")
    overrides = {"target.adapter_path": str(tmp_path / "adapter"), "heads.exit_layers": [2]}
    train_in_process(write_config(world, "peft", **overrides, **{"train.max_steps": 4, "eval.every": 4}))
    facts = summary(world, "peft")
    assert facts["steps"] == 4 and facts["target_digest"] == facts["target_digest_before"]
    target = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(world["target"]), tmp_path / "adapter")
    target.eval()
    prompt = torch.tensor([[VOCAB["w2"], VOCAB["w11"], VOCAB["w5"]]])
    expected = target.generate(input_ids=prompt, max_new_tokens=16, do_sample=False, eos_token_id=None)
    spec = SelfSpeculative(target, heads=world["root"] / "peft" / "heads")
    assert torch.equal(spec.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None), expected)


def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(world, monkeypatch):
    from selfspec.training.distill import DistillationObjective

    monkeypatch.setenv("HF_DATASETS_CACHE", str(world["root"] / "hf_datasets"))
    calls = {"n": 0}
    forward = DistillationObjective.forward

    def poisoned(self, *args, **kwargs):  # the 7th step's loss is NaN
        calls["n"] += 1
        loss = forward(self, *args, **kwargs)
        return loss * float("nan") if calls["n"] == 7 else loss

    monkeypatch.setattr(DistillationObjective, "forward", poisoned)
    config = write_config(world, "nan", **{"heads.exit_layers": [2], "train.max_steps": 12, "eval.every": 12})
    with pytest.raises(FloatingPointError, match=r"step 7: the loss is not finite.*Last good checkpoint: step 4"):
        train_in_process(config)
    checkpoints = world["root"] / "nan" / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000004"]  # nothing written after the NaN
    assert not (world["root"] / "nan" / "heads").exists()
    monkeypatch.setattr(DistillationObjective, "forward", forward)
    train_in_process(config, "--resume")  # the kept checkpoint resumes to the end
    assert summary(world, "nan")["steps"] == 12


def test_medusa_heads_train_and_generate_exactly(world, monkeypatch):
    from selfspec import MedusaHeads

    monkeypatch.setenv("HF_DATASETS_CACHE", str(world["root"] / "hf_datasets"))
    overrides = {"heads.kind": "medusa", "heads.num_heads": 3, "heads.own_lm_head": True}
    train_in_process(write_config(world, "medusa", **overrides, **{"train.max_steps": 6, "eval.every": 6}))
    facts = summary(world, "medusa")
    assert [row["draft"] for row in facts["rows"]] == ["medusa_0", "medusa_1", "medusa_2"]
    assert [row["gamma"] for row in facts["rows"]] == [1, 2, 3]  # the chain of the first gamma heads
    model = AutoModelForCausalLM.from_pretrained(world["target"]).eval()
    heads = load_heads(world["root"] / "medusa" / "heads", ModelAdapter(model))
    assert isinstance(heads, MedusaHeads) and heads.own_lm_head and heads.num_heads == 3
    prompt = torch.tensor([[VOCAB["w6"], VOCAB["w0"]]])
    expected = model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    for tree in (None, [[0], [1], [0, 0], [0, 0, 0]]):
        out = SelfSpeculative(model, heads=heads, tree=tree, adaptive=False).generate(
            prompt, max_new_tokens=20, do_sample=False, eos_token_id=None
        )
        assert torch.equal(out, expected), tree


def test_eagle_head_trains_and_generates_exactly(world, monkeypatch):
    """An EAGLE-3 head trains and drafts exactly; with eval.save_heads the heads folder is also written at the
    evaluation before the end (step 3 of 6), holding the heads of that step (train.save_dtype: in bfloat16)."""
    from safetensors.torch import load_file

    from selfspec import EagleHeads

    sys.path.insert(0, str(ROOT / "training"))
    import train_heads

    sys.path.remove(str(ROOT / "training"))
    saved, save_heads = [], train_heads.Run.save_heads

    def save_and_read(run, rows, lora=None):
        save_heads(run, rows, lora)
        written = load_file(world["root"] / "eagle" / "heads" / "model.safetensors")
        live = {name: tensor.detach().clone() for name, tensor in run.heads.state_dict().items()}
        saved.append((run.progress.step, written, live))
        temperatures.append(run.accelerator.unwrap_model(run.objective).teacher_temperature)

    temperatures = []
    monkeypatch.setattr(train_heads.Run, "save_heads", save_and_read)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(world["root"] / "hf_datasets"))
    overrides = {"heads.kind": "eagle", "heads.layout": "eagle3", "heads.feature_layers": [0, 2], "heads.unroll": 2}
    steps = {"train.max_steps": 6, "eval.every": 3, "train.save_dtype": "bfloat16", "train.teacher_temperature": 0.5}
    train_in_process(write_config(world, "eagle", **overrides, **steps))
    assert [step for step, _, _ in saved] == [3, 6] and temperatures == [0.5, 0.5]  # the loss's teacher at T = 0.5
    for _, written, live in saved:  # each save holds the heads as they were at its step, in bfloat16
        assert written.keys() == live.keys() and {t.dtype for t in written.values()} == {torch.bfloat16}
        assert all(torch.equal(written[n], live[n].to(torch.bfloat16)) for n in live)
    assert any(not torch.equal(saved[0][1][name], saved[1][1][name]) for name in saved[0][1])  # trained on
    facts = summary(world, "eagle")
    assert [row["draft"] for row in facts["rows"]] == ["eagle_0", "eagle_1"]
    model = AutoModelForCausalLM.from_pretrained(world["target"]).eval()
    heads = load_heads(world["root"] / "eagle" / "heads", ModelAdapter(model))
    assert isinstance(heads, EagleHeads) and heads.layout == "eagle3" and heads.feature_layers == [0, 2]
    assert "EAGLE head" in (world["root"] / "eagle" / "heads" / "README.md").read_text()
    prompt = torch.tensor([[VOCAB["w6"], VOCAB["w0"]]])
    expected = model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = SelfSpeculative(model, heads=heads).generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert torch.equal(out, expected)


def test_copy_rows_repeat_random_segments_of_random_lengths():
    assert copy_pool(10, [0, 1, 2]).tolist() == list(range(3, 10))
    assert copy_pool(10, [2], torch.tensor([2, 5, 7])).tolist() == [5, 7]  # a draft vocabulary's tokens
    with pytest.raises(ValueError, match="copy rows need at least 2 non-special tokens"):
        copy_pool(3, [0, 1])
    pool = copy_pool(1000, [0, 1, 2])
    ids, mask = copy_rows(pool, rows=64, segment=12, repeats=3, seed=7)
    assert ids.shape == mask.shape == (64, 36) and torch.isin(ids, pool).all()
    periods = (~mask).sum(1)  # the loss starts where the first copy ends
    assert set(periods.tolist()) == set(range(3, 13))  # a quarter of the longest segment up to it
    for row, period in zip(ids, periods.tolist(), strict=True):
        assert torch.equal(row[period:], row[:-period])  # repeated to fill the row
        assert len(row[:period].unique()) > period // 2  # random tokens (repeats within a segment are rare)
    assert torch.equal(copy_rows(pool, 64, 12, 3, seed=7)[0], ids)
    assert not torch.equal(copy_rows(pool, 64, 12, 3, seed=8)[0], ids)


def test_copy_rows_teach_an_eagle_head_to_copy(world, monkeypatch):
    """train.copy_rows: beside the data's rows each step learns from random segments repeated; the run reports
    the heads' top-1 on held-out copy rows at each evaluation, and the head follows the target on copies better
    than one trained as long without them."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(world["root"] / "hf_datasets"))
    overrides = {"heads.kind": "eagle", "heads.layout": "eagle3", "heads.feature_layers": [0, 2], "heads.unroll": 2}
    steps = {"train.max_steps": 30, "eval.every": 15}
    copies = {"train.copy_rows": 8, "train.copy_segment": 8, "train.copy_repeats": 3}
    train_in_process(write_config(world, "copying", **overrides, **steps, **copies))
    train_in_process(write_config(world, "not-copying", **overrides, **steps))
    records = [json.loads(line) for line in (world["root"] / "copying" / "run" / "metrics.jsonl").open()]
    assert [record["step"] for record in records] == [0, 15, 30]
    model = AutoModelForCausalLM.from_pretrained(world["target"]).eval()
    adapter = ModelAdapter(model)
    pool = copy_pool(len(VOCAB), AutoTokenizer.from_pretrained(world["target"]).all_special_ids)
    rows, masks = copy_rows(pool, 8, 8, 3, seed=-1)  # the run's held-out copy rows
    copied = {}
    for name in ("copying", "not-copying"):
        heads = load_heads(world["root"] / name / "heads", adapter)
        copied[name] = evaluate(model, adapter, {"h": heads}, rows, 8, masks=masks)["h"]
    for draft in ("eagle_0", "eagle_1"):  # the record is rounded to 5 decimals
        reported = records[-1][f"eval/copy_top1/{draft}"]
        assert reported == pytest.approx(copied["copying"][draft]["top1"], abs=1e-5)
        assert copied["copying"][draft]["top1"] > copied["not-copying"][draft]["top1"] + 0.1
    assert records[-1]["eval/copy_top1/eagle_0"] > records[0]["eval/copy_top1/eagle_0"] + 0.1


def test_the_first_tokens_of_each_answer_are_scored_apart(world, monkeypatch, capsys):
    """eval.answer_tokens: each held-out evaluation also scores the first N positions of each answer alone (what
    a benchmark of N new tokens drafts), into metrics.jsonl and the card, from the same forward."""
    marks = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1], [0, 1, 0, 0, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    cut = [[0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 1], [0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0]]  # a run at a row's start: left out
    assert first_of_each_answer(marks, 2).int().tolist() == cut
    whole = marks.clone()
    whole[0, :3] = False  # the runs that start within their rows, whole
    assert torch.equal(first_of_each_answer(marks, 11), whole) and not first_of_each_answer(marks, 0).any()
    assert not first_of_each_answer(torch.ones(2, 11, dtype=torch.bool), 4).any()  # plain text: one run per row

    sys.path.insert(0, str(ROOT / "training"))
    import train_heads

    sys.path.remove(str(ROOT / "training"))
    runs, save_heads = [], train_heads.Run.save_heads

    def save_and_keep(run, rows, lora=None):
        save_heads(run, rows, lora)
        runs.append(run)

    monkeypatch.setattr(train_heads.Run, "save_heads", save_and_keep)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(world["root"] / "hf_datasets"))
    rng = random.Random(5)  # held-out chats: the loss (and the evaluation) on the assistant's answers alone
    chats = world["root"] / "chats.jsonl"
    with open(chats, "w") as f:
        for _ in range(24):
            turns = [("user", sentence(rng, world["successors"], 2)), ("assistant", sentence(rng, world["successors"]))]
            f.write(json.dumps({"messages": [{"role": role, "content": text} for role, text in turns]}) + "\n")
    overrides = {"heads.kind": "eagle", "heads.layout": "eagle3", "heads.feature_layers": [0, 2], "heads.unroll": 2}
    overrides.update({"data.heldout_files": str(chats), "train.max_steps": 4, "eval.answer_tokens": 5})
    train_in_process(write_config(world, "first", **overrides))
    record = [json.loads(line) for line in (world["root"] / "first" / "run" / "metrics.jsonl").open()][-1]
    rows, masks = runs[-1].eval_rows, runs[-1].eval_masks
    first = first_of_each_answer(masks, 5)
    assert 0 < first.sum() < masks.sum()  # a real cut of the held-out positions
    model = AutoModelForCausalLM.from_pretrained(world["target"]).eval()
    adapter = ModelAdapter(model)
    heads = load_heads(world["root"] / "first" / "heads", adapter)
    scores = evaluate(model, adapter, {"all": heads, "first": heads}, rows, 4, masks={"all": masks, "first": first})
    for draft in ("eagle_0", "eagle_1"):  # the record is rounded to 5 decimals
        assert record[f"eval/top1/{draft}"] == pytest.approx(scores["all"][draft]["top1"], abs=1e-5)
        assert record[f"eval/first_top1/{draft}"] == pytest.approx(scores["first"][draft]["top1"], abs=1e-5)
        assert record[f"eval/first_chain/{draft}"] == pytest.approx(scores["first"][draft]["chain"], abs=1e-5)
    assert scores["first"]["eagle_1"]["chain"] != scores["all"]["eagle_1"]["chain"]
    assert "top-1, first 5 of each answer" in (world["root"] / "first" / "heads" / "README.md").read_text()
    from selfspec.cli.main import main  # selfspec profile on the same rows prints the same figures

    args = ["profile", "--model", str(world["target"]), "--heads", str(world["root"] / "first" / "heads")]
    args += ["--data", str(chats), "--seq_len", "32", "--max_rows", "16", "--answer_tokens", "5"]
    capsys.readouterr()
    assert main(args + ["--timing_repeats", "3", "--timing_context", "16", "--max_gamma", "4", "--output",
                        str(world["root"] / "first" / "profile")]) == 0  # fmt: skip
    lines = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    column = [cell.strip() for cell in lines[0]].index("top-1, first 5 of each answer")
    printed = {cells[1].strip(): float(cells[column]) for cells in lines[2:]}
    assert printed == {d: pytest.approx(scores["first"][d]["top1"], abs=6e-4) for d in ("eagle_0", "eagle_1")}


def test_draft_lora_trains_with_the_heads_and_its_gain_goes_in_the_card(world, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(world["root"] / "hf_datasets"))
    steps = {"train.max_steps": 8, "eval.every": 8, "heads.exit_layers": [1, 2]}
    train_in_process(write_config(world, "lora_base", **steps))
    baseline = world["root"] / "lora_base" / "heads"
    overrides = {"lora.r": 4, "lora.alpha": 8.0, "lora.baseline_heads": str(baseline)}
    train_in_process(write_config(world, "lora", **steps, **overrides))
    facts = summary(world, "lora")
    assert facts["steps"] == 8 and facts["target_digest"] == facts["target_digest_before"]
    model = AutoModelForCausalLM.from_pretrained(world["target"]).eval()
    heads = load_heads(world["root"] / "lora" / "heads", ModelAdapter(model))
    assert heads.draft_lora is not None and heads.draft_lora.r == 4
    assert heads.draft_lora.lora_B.weight.abs().sum() > 0  # B starts at zero: training moved it
    card = (world["root"] / "lora" / "heads" / "README.md").read_text()
    assert "## Draft-only LoRA on the LM head" in card and "heads trained without adapter" in card
    table = [line for line in card.splitlines() if line.startswith("| exit_")]
    on, off, without = (float(cell) for cell in table[-1].split("|")[2:5])  # the exit_2 row of the LoRA table
    assert 0 < off <= 1 and on != off
    trained = {row["draft"]: row["alpha"] for row in facts["rows"]}  # the heads' own last evaluation, ...
    base = {row["draft"]: row["alpha"] for row in summary(world, "lora_base")["rows"]}  # ... and the baseline's
    assert on == pytest.approx(trained["exit_2"], abs=5e-4) and without == pytest.approx(base["exit_2"], abs=5e-4)
    prompt = torch.tensor([[VOCAB["w3"], VOCAB["w8"]]])
    expected = model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = SelfSpeculative(model, heads=heads).generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert torch.equal(out, expected)


def test_draft_lora_baseline_must_match_the_heads(world, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(world["root"] / "hf_datasets"))
    medusa = {"heads.kind": "medusa", "heads.num_heads": 2, "train.max_steps": 2, "eval.every": 2}
    train_in_process(write_config(world, "lora_medusa_base", **medusa))
    wrong = {"lora.r": 2, "lora.baseline_heads": str(world["root"] / "lora_medusa_base" / "heads")}
    with pytest.raises(ValueError, match=r"has the drafts \['medusa_0', 'medusa_1'\]; these heads have \['exit_2'\]"):
        train_in_process(write_config(world, "lora_wrong", **{"heads.exit_layers": [2]}, **wrong))


@pytest.mark.parametrize("native", [True, False])
def test_mixed_precision_follows_the_cpu_and_bf16_without_native_kernels_warns(monkeypatch, native):
    from selfspec import hardware

    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"} if native else {"avx2"}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    sys.path.insert(0, str(ROOT / "training"))
    try:
        import common
    finally:
        sys.path.remove(str(ROOT / "training"))
    assert common.resolve_mixed_precision("auto") == ("bf16" if native else "no")
    assert common.resolve_mixed_precision("no") == "no"
    if native:
        assert common.resolve_mixed_precision("bf16") == "bf16"
    else:
        with pytest.warns(UserWarning, match="bf16.*no native bf16.*train.mixed_precision=auto"):
            assert common.resolve_mixed_precision("bf16") == "bf16"
    shipped = [
        yaml.safe_load(path.read_text())["train"]["mixed_precision"] for path in (ROOT / "configs").glob("*.yaml")
    ]
    assert set(shipped) == {"auto"}


def test_training_can_start_from_trained_heads_and_refuses_ones_of_another_shape(world, monkeypatch):
    """heads.init_from: a run starts from a heads folder's weights (its untrained row is their alpha), and a
    folder of another kind or shape is refused before training, by name."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(world["root"] / "hf_datasets"))
    first = write_config(world, "start", **{"heads.exit_layers": [2], "train.max_steps": 6, "eval.every": 6})
    train_in_process(first)
    start = world["root"] / "start" / "heads"
    config = write_config(world, "again", **{"heads.exit_layers": [2], "train.max_steps": 2, "eval.every": 2,
                                             "heads.init_from": str(start), "train.lr": 1e-9})  # fmt: skip
    train_in_process(config)
    card = (world["root"] / "again" / "heads" / "README.md").read_text()
    assert "start alpha" in card and "untrained alpha" not in card  # the baseline is the start, not fresh heads
    adapter = ModelAdapter(AutoModelForCausalLM.from_pretrained(world["target"]))
    before, after = load_heads(start, adapter), load_heads(world["root"] / "again" / "heads", adapter)
    for (name, a), (_, b) in zip(before.state_dict().items(), after.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)  # lr 1e-9: the start's weights, kept
    other = write_config(world, "other", **{"heads.exit_layers": [1, 3], "heads.init_from": str(start)})
    with pytest.raises(ValueError, match="does not fit the heads this config builds"):
        train_in_process(other)
    medusa = write_config(world, "kind", **{"heads.kind": "medusa", "heads.init_from": str(start)})
    with pytest.raises(ValueError, match="holds exit heads; the config trains medusa heads"):
        train_in_process(medusa)


def test_init_from_heads_with_a_draft_lora(world):
    """heads.init_from a folder whose heads carry a draft LoRA: its adapter is taken with the heads where the config
    asks for one (it was built after the start was loaded, so every such start was refused); a config without one
    is told so; a fresh adapter goes on heads that had none."""
    sys.path.insert(0, str(ROOT / "training"))
    import train_heads

    sys.path.remove(str(ROOT / "training"))
    from selfspec.training.config import TrainHeadsConfig, load_config

    adapter = ModelAdapter(AutoModelForCausalLM.from_pretrained(world["target"]))
    lora = ["--lora.r=4", "--lora.alpha=8.0"]

    def built(*overrides):
        return train_heads.build_heads(load_config(TrainHeadsConfig, write_config(world, "init"), overrides), adapter)

    start = built(*lora)
    with torch.no_grad():
        for tensor in start.state_dict().values():
            tensor.normal_()  # trained weights, adapter factors included (a fresh LoRA's B is zero)
    start.save_pretrained(world["root"] / "start_lora")
    again = built(*lora, f"--heads.init_from={world['root'] / 'start_lora'}")
    for (name, a), (_, b) in zip(start.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match=r"has a draft LoRA \(r=4\) and these heads none: set lora.r"):
        built(f"--heads.init_from={world['root'] / 'start_lora'}")
    with pytest.raises(ValueError, match=r"the start's draft LoRA has r=4, lora_alpha=8.0.* lora_alpha=32"):
        built("--lora.r=4", f"--heads.init_from={world['root'] / 'start_lora'}")  # alpha's default: another scale
    plain = built()
    plain.save_pretrained(world["root"] / "start_plain")
    fresh = built(*lora, f"--heads.init_from={world['root'] / 'start_plain'}")
    assert fresh.draft_lora is not None
    for name, tensor in plain.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_a_feature_cache_forwards_each_row_once_and_trains_what_the_forward_trains(world, baseline, monkeypatch):
    """train.feature_cache: over 1.5 epochs the target's forward runs once per training row, and (float32, so
    the stored states are the forward's) the heads equal the uncached run's bit for bit; a second run on the
    full cache forwards nothing; heads that read other entries are refused that cache."""
    sys.path.insert(0, str(ROOT / "training"))
    import train_heads

    sys.path.remove(str(ROOT / "training"))
    forwarded, forward = [], train_heads.target_states

    def counted(model, ids):
        forwarded.append(len(ids))
        return forward(model, ids)

    monkeypatch.setattr(train_heads, "target_states", counted)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(world["root"] / "hf_datasets"))
    cache = world["root"] / "feature_cache"
    train_in_process(write_config(world, "cached", **{"train.feature_cache": str(cache)}))
    rows = summary(world, "cached")["data"]["train_rows"]
    assert MAX_STEPS * 8 > rows and sum(forwarded) == rows  # every row once, though some were visited twice
    cached, uncached = heads_state(world, "cached"), heads_state(world, baseline)
    assert all(torch.equal(cached[name], uncached[name]) for name in uncached)

    forwarded.clear()
    train_in_process(write_config(world, "cached_again", **{"train.feature_cache": str(cache)}))
    assert forwarded == []
    again = heads_state(world, "cached_again")
    assert all(torch.equal(again[name], uncached[name]) for name in uncached)
    other = write_config(world, "cached_other", **{"train.feature_cache": str(cache), "heads.exit_layers": [1, 2]})
    with pytest.raises(ValueError, match=r"other settings: entries \[1, 2, 3, 4\] there, \[1, 2, 4\] here"):
        train_in_process(other)


# --- resuming across sessions -------------------------------------------------------------------------------------

SHORT = {"heads.exit_layers": [2], "train.max_steps": 8, "eval.every": 8}


class SessionEnded(Exception):
    """Stands for a session's end right after a checkpoint."""


def end_session_after_checkpoint(monkeypatch, step: int):
    """The next in-process run stops right after writing the checkpoint of `step`; returns the undo."""
    sys.path.insert(0, str(ROOT / "training"))
    import train_heads

    sys.path.remove(str(ROOT / "training"))
    original = train_heads.save_checkpoint

    def save_then_stop(accelerator, config, at):
        path = original(accelerator, config, at)
        if at == step:
            raise SessionEnded(at)
        return path

    monkeypatch.setattr(train_heads, "save_checkpoint", save_then_stop)
    return lambda: monkeypatch.setattr(train_heads, "save_checkpoint", original)


def interrupted(world, monkeypatch, name: str, **overrides) -> Path:
    """A run of SHORT (and `overrides`) whose session ended after the checkpoint of step 4; returns its config."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(world["root"] / "hf_datasets"))
    config = write_config(world, name, **{**SHORT, **overrides})
    undo = end_session_after_checkpoint(monkeypatch, 4)
    with pytest.raises(SessionEnded):
        train_in_process(config)
    undo()
    return config


def test_a_resumed_run_trains_with_the_lr_it_is_given(world, monkeypatch):
    """After a non-finite loss the message says: lower train.lr, then --resume. The checkpoint's optimizer state
    brought back the old lr (the run said the config changed, and trained as before)."""
    from selfspec.training.config import TrainHeadsConfig, load_config

    config = interrupted(world, monkeypatch, "new_lr")
    sys.path.insert(0, str(ROOT / "training"))
    try:
        from common import learning_rate_factor
    finally:
        sys.path.remove(str(ROOT / "training"))
    used, step = [], torch.optim.AdamW.step

    def recording(self, *args, **kwargs):
        used.append([(group["lr"], group["betas"], group["weight_decay"]) for group in self.param_groups])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording)
    given = ["--train.lr", "1e-4", "--train.beta2", "0.99", "--train.weight_decay", "0.05"]
    train_in_process(config, "--resume", *given)
    tc = load_config(TrainHeadsConfig, config, given).train
    assert [[lr for lr, _, _ in groups] for groups in used] == [
        pytest.approx([1e-4 * learning_rate_factor(s, tc)] * 2) for s in range(4, 8)
    ]  # both groups: the matrices and the rest
    assert {(betas, decay) for groups in used for _, betas, decay in groups} == {
        ((tc.beta1, 0.99), 0.05),
        ((tc.beta1, 0.99), 0.0),
    }


def test_resume_does_not_replace_another_existing_heads_folder(world, monkeypatch):
    config = interrupted(world, monkeypatch, "moved")
    committed = world["root"] / "committed_heads"
    committed.mkdir()
    (committed / "config.json").write_text('{"kind": "exit"}')  # stands for shipped heads
    with pytest.raises(SystemExit, match=f"heads_dir {committed} already exists"):
        train_in_process(config, "--resume", "--heads_dir", str(committed))
    assert sorted(p.name for p in committed.iterdir()) == ["config.json"]
    train_in_process(config, "--resume")  # the heads_dir it started with: fine


def test_resume_with_a_draft_lora_dropout_ends_like_an_uninterrupted_run(world, monkeypatch):
    """Each session times the heads first; a copy in training mode drew LoRA dropout from the restored RNG."""
    lora = {"lora.r": 4, "lora.dropout": 0.2}
    monkeypatch.setenv("HF_DATASETS_CACHE", str(world["root"] / "hf_datasets"))
    train_in_process(write_config(world, "dropout_whole", **SHORT, **lora))
    train_in_process(interrupted(world, monkeypatch, "dropout_resumed", **lora), "--resume")
    whole, resumed = heads_state(world, "dropout_whole"), heads_state(world, "dropout_resumed")
    assert whole.keys() == resumed.keys() and all(torch.equal(resumed[name], whole[name]) for name in whole)


def test_resuming_a_finished_run_leaves_its_heads_and_metrics_alone(world, monkeypatch, capsys):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(world["root"] / "hf_datasets"))
    config = write_config(world, "finished", **SHORT)
    train_in_process(config)
    heads_dir, metrics = world["root"] / "finished" / "heads", world["root"] / "finished" / "run" / "metrics.jsonl"
    card = (heads_dir / "README.md").read_text() + "\nEdited after training (selfspec tune, say).\n"
    (heads_dir / "README.md").write_text(card)
    lines = metrics.read_text()
    train_in_process(config, "--resume")  # the same command again in the next session
    assert (heads_dir / "README.md").read_text() == card
    assert metrics.read_text() == lines
    assert "nothing to do" in capsys.readouterr().out


def test_resume_skips_a_checkpoint_missing_a_file_and_refuses_when_none_is_whole(world, monkeypatch, capsys):
    """A checkpoint folder that lost a file (deleted, copied in part) ended --resume in a traceback from
    `load_state` after the target had loaded; the run now resumes from the checkpoint before it and says so, and
    one with no whole checkpoint is refused, naming the missing files, before the target loads."""
    sys.path.insert(0, str(ROOT / "training"))
    import train_heads

    sys.path.remove(str(ROOT / "training"))
    config = interrupted(world, monkeypatch, "lost_file", **{"train.checkpoint_every": 2})
    checkpoints = world["root"] / "lost_file" / "run" / "checkpoints"
    (checkpoints / "step_000004" / "optimizer.bin").unlink()
    capsys.readouterr()
    undo = end_session_after_checkpoint(monkeypatch, 4)
    with pytest.raises(SessionEnded):
        train_in_process(config, "--resume")
    undo()
    out = capsys.readouterr().out
    assert f"{checkpoints / 'step_000004'} lacks optimizer.bin: resuming from {checkpoints / 'step_000002'}" in out
    assert f"resumed from {checkpoints / 'step_000002'} at step 2" in out
    assert (checkpoints / "step_000004" / "optimizer.bin").exists()  # written again, whole
    for checkpoint in checkpoints.iterdir():
        (checkpoint / "custom_checkpoint_0.pkl").unlink()
    monkeypatch.setattr(train_heads, "load_target", lambda *args: pytest.fail("the target loaded"))
    with pytest.raises(SystemExit, match=r"no checkpoint in .* has every part \(.*step_000004 lacks custom_checkpoint"):
        train_in_process(config, "--resume")
    assert sorted(path.name for path in checkpoints.iterdir()) == ["step_000002", "step_000004"]  # nothing removed


def test_resuming_with_other_heads_names_the_changed_keys(world, monkeypatch):
    config = interrupted(world, monkeypatch, "reshaped")
    with pytest.raises(ValueError, match=r"config changed since: heads\.exit_layers"):
        train_in_process(config, "--resume", "--heads.exit_layers", "[1,2]")


def test_resuming_on_other_training_rows_is_refused_unless_the_data_config_changed(world, monkeypatch, capsys):
    """The data files made again between sessions (same config) would reorder the rows under a resumed run; a run
    told of new data (a data.* key changed) goes on and says so."""
    own = world["root"] / "rows_data"
    own.mkdir()
    lines = (world["data"] / "train.jsonl").read_text().splitlines(keepends=True)
    (own / "train.jsonl").write_text("".join(lines))
    config = interrupted(world, monkeypatch, "rows", **{"data.source": str(own / "train.jsonl")})
    (own / "train.jsonl").write_text("".join(reversed(lines)))  # the same rows, made again in another order
    with pytest.raises(ValueError, match="the training rows differ from those the run in .* started with, and the"):
        train_in_process(config, "--resume")
    (own / "other.jsonl").write_text("".join(reversed(lines)))
    train_in_process(config, "--resume", "--data.source", str(own / "other.jsonl"))
    assert "the training rows differ from those the run started with (data.source changed)" in capsys.readouterr().out


def test_a_model_folder_as_heads_dir_is_refused_before_training(world, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(world["root"] / "hf_datasets"))
    config = write_config(world, "into_model", **{"heads.exit_layers": [2], "train.max_steps": 2, "eval.every": 2})
    for extra in ((), ("--overwrite",)):
        with pytest.raises(SystemExit, match=f"{world['target']} holds a config.json that is not a heads folder's"):
            train_in_process(config, "--heads_dir", str(world["target"]), *extra)
    assert not (world["root"] / "into_model" / "run").exists()  # refused before any work


def test_the_rows_digest_is_read_in_slices_and_equals_the_whole_columns():
    import datasets as hf_datasets
    import numpy as np

    from selfspec.training.feature_cache import rows_digest, rows_digest_of

    ids = np.arange(7 * 5).reshape(7, 5)
    rows = hf_datasets.Dataset.from_dict({"input_ids": ids.tolist()})
    assert rows_digest_of(rows, chunk=3) == rows_digest_of(rows) == rows_digest(ids)
    assert rows_digest_of(rows.select([1, 0, *range(2, 7)]), chunk=3) != rows_digest(ids)  # the order counts
