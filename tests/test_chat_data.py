"""training/make_chat_data.py and training/chat_data/: the instructions (seeded, prefix-stable, every kind), the
shrinking-batch decoder (greedy rows equal `model.generate`'s), and a run on a tiny target that resumes, stops
at its time limit and packs data that the training loader reads."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from selfspec.training.config import DataConfig
from selfspec.training.data import load_rows

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))
import make_chat_data  # noqa: E402
from chat_data import kinds  # noqa: E402
from chat_data.decode import decode  # noqa: E402

WORDS = [f"w{i}" for i in range(20)]
MATERIAL = kinds.Material  # the class, before a test replaces it with small_material
VOCAB = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", "<unk>", "user", "assistant", ":"] + WORDS)}


def small_material() -> kinds.Material:
    """Material without manual pages (rendering them takes a minute): docstrings, two catalogues, countries."""
    objects = [
        (f"mod.f{i}", f"Return thing {i}. " + "This function does something useful with its input. " * 8)
        for i in range(30)
    ]
    messages = {
        "de": [(f"english {i}", f"ein deutscher Satz Nummer {i} mit Wörtern") for i in range(40)],
        "fr": [("a", "une phrase française assez longue ici")],
    }
    return MATERIAL(objects=objects, messages=messages, man_pages=[], countries=["Chile", "Nepal", "Ghana"])


def test_instructions_are_seeded_prefix_stable_and_cover_every_kind():
    material = small_material()
    many = make_chat_data.build_instructions(600, seed=3, material=material)
    few = make_chat_data.build_instructions(50, seed=3, material=material)
    assert few == many[:50]
    assert make_chat_data.build_instructions(50, seed=4, material=material) != few
    assert {s.kind for s in many} == set(kinds.SHARES)
    texts = [s.text for s in many if s.text is not None]
    assert len(texts) == len(set(texts))
    assert all(s.text is None for s in many if s.kind == "magpie")
    assert [s.index for s in many if s.heldout] == list(range(9, 600, 10))
    assert 0.1 < sum(s.follow_up is not None for s in many) / 600 < 0.3
    translation = next(s.text for s in many if s.kind == "translation")
    assert "deutscher" in translation or "française" in translation


WIKI_PAGE = """<page><title>{title}</title><revision><text xml:space="preserve">{{{{Infobox|name={title}}}}}
'''{title}''' is a [[thing|kind of thing]] studied by [[people]] since 1900.<ref>Smith 2001</ref> {words}
== History ==
* a list item that is not prose at all but long enough to count as twenty words if it were prose ok
{words}
[[Category:Things]]</text></revision></page>
<page><title>Old {title}</title><revision><text>#REDIRECT [[{title}]]</text></revision></page>"""


def fake_prose_wheel(folder: Path) -> Path:
    """A zip holding the two files `material.wheel_prose` reads, in the wheel's paths: 3 news stories (one too
    short) and 4 encyclopedia articles (one too short), each with a redirect."""
    import bz2
    import zipfile

    from chat_data import material

    words = " ".join(f"word{i}" for i in range(160))
    stories = [f"Story {i} begins here. " + words for i in range(2)] + ["A short story."]
    pages = [WIKI_PAGE.format(title=f"Topic {i}", words=words if i < 3 else "few") for i in range(4)]
    wheel = folder / "gensim-4.4.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(material.NEWS_FILE, "\n".join(stories) + "\n")
        archive.writestr(material.WIKI_FILE, bz2.compress(("<mediawiki>" + "".join(pages) + "</mediawiki>").encode()))
    return wheel


def test_prose_instructions_come_from_the_wheels_news_and_articles(tmp_path):
    """The prose run reads news stories and encyclopedia articles from the wheel (markup, references, lists,
    headings and redirects left out; links shown by their text) and builds seeded, prefix-stable instructions
    of every prose kind from them."""
    from chat_data import material

    wheel = str(fake_prose_wheel(tmp_path))
    news, articles = material.wheel_prose(wheel)
    assert [story.split(".")[0] for story in news] == ["Story 0 begins here", "Story 1 begins here"]
    assert [title for title, _ in articles] == ["Topic 0", "Topic 1", "Topic 2"]
    text = articles[0][1]
    assert text.startswith("Topic 0 is a kind of thing studied by people since 1900. word0")
    for leftover in ("{{", "[[", "<ref", "Smith", "==", "list item", "Category", "''", "REDIRECT"):
        assert leftover not in text
    prose = kinds.Prose(wheel)
    many = make_chat_data.build_instructions(120, seed=1, material=prose)
    assert make_chat_data.build_instructions(30, seed=1, material=prose) == many[:30]
    assert {s.kind for s in many} == set(kinds.PROSE_SHARES)
    assert all(any(w in s.text for w in ("Story", "word1", "Topic")) for s in many)  # each carries material
    summary = next(s.text for s in many if s.kind == "wiki summary")
    assert 150 <= len(summary.split()) <= 820


def tiny_target(folder: Path, uniform: bool = False) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    if uniform:  # every token equally likely: sampled answers end (at </s>) after about 27 tokens
        torch.nn.init.zeros_(model.lm_head.weight)
    model.save_pretrained(folder)
    backend = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant : {% endif %}"
    )
    tokenizer.save_pretrained(folder)
    return folder


def test_decode_greedy_rows_equal_generate_and_finished_rows_leave(tmp_path):
    model = LlamaForCausalLM.from_pretrained(tiny_target(tmp_path / "t")).eval()
    rows = [[1, 7, 8, 9, 10, 11], [1, 12, 13], [1, 14, 15, 16, 17], [1, 18]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = (torch.arange(width) >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
    expected = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None
    )[:, width:].tolist()
    stop = {expected[1][4]}  # the second row stops at its fifth token; the others go on without it
    got = decode(model, ids, mask, 12, stop)
    for row, (tokens, truncated) in zip(expected, got, strict=True):
        cut = next((k for k, token in enumerate(row) if token in stop), None)
        assert tokens == (row if cut is None else row[:cut])
        assert truncated == (cut is None)
    assert got[1] == (expected[1][:4], False)
    sampled = [decode(model, ids, mask, 8, set(), 0.7, torch.Generator().manual_seed(5)) for _ in range(2)]
    assert sampled[0] == sampled[1]


def run(tmp_path: Path, target: Path, *extra: str, monkeypatch) -> None:
    monkeypatch.setattr(make_chat_data.kinds, "Material", small_material)
    make_chat_data.main(
        ["--out_dir", str(tmp_path / "run"), "--target", str(target), "--count", "30", "--window", "10",
         "--max_new_tokens", "40", "--dtype", "float32", *extra]
    )  # fmt: skip


def test_a_run_resumes_stops_at_its_limit_and_packs_what_training_reads(tmp_path, monkeypatch, capsys):
    target = tiny_target(tmp_path / "target", uniform=True)
    run(tmp_path, target, "--time_limit", "0", monkeypatch=monkeypatch)  # one window, then the limit
    assert "time limit of 0.0 min reached" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "run" / "rows.jsonl").read_text().splitlines()]
    assert {r["index"] for r in rows if r["turns"] == 1} <= set(range(10))
    with (tmp_path / "run" / "rows.jsonl").open("a") as torn:  # a run killed in the middle of a write
        torn.write('{"index": 12, "kind": "ma')
    run(tmp_path, target, monkeypatch=monkeypatch)
    run(tmp_path, target, monkeypatch=monkeypatch)  # nothing left: the third run answers nothing
    assert "0 with work left" in capsys.readouterr().out.splitlines()[-1]
    rows = [json.loads(line) for line in (tmp_path / "run" / "rows.jsonl").read_text().splitlines()]  # all whole
    slots = make_chat_data.build_instructions(30, 0, small_material())
    answered = [r for r in rows if r["turns"] == 1]
    dropped = {r["index"] for r in map(json.loads, (tmp_path / "run" / "magpie.jsonl").read_text().splitlines())
               if r["text"] is None}  # fmt: skip
    assert sorted(r["index"] for r in answered) == [s.index for s in slots if s.index not in dropped]
    assert all(len(r["messages"]) == 2 and r["answer_tokens"] <= 40 for r in answered)
    greedy = [r for r in answered if not r["sampled"]]
    assert greedy and all(r["truncated"] for r in greedy)  # uniform logits: argmax is <pad>, never </s>
    second = [r for r in rows if r["turns"] == 2]
    assert second  # follow-ups to the sampled answers that ended
    for r in second:
        first = next(a for a in answered if a["index"] == r["index"])
        assert not first["truncated"] and r["messages"][:2] == first["messages"] and len(r["messages"]) == 4

    with pytest.raises(SystemExit, match="other settings"):
        run(tmp_path, target, "--seed", "1", monkeypatch=monkeypatch)

    make_chat_data.main(["--out_dir", str(tmp_path / "run"), "--pack", str(tmp_path / "packed")])
    packed = tmp_path / "packed"
    train = [json.loads(line) for line in gzip.open(packed / "train.jsonl.gz", "rt")]
    heldout = [json.loads(line) for line in gzip.open(packed / "heldout.jsonl.gz", "rt")]
    assert len(train) + len(heldout) == len(answered)
    assert all(r["index"] % 10 == 9 for r in heldout) and not any(r["index"] % 10 == 9 for r in train)
    assert sum(r["turns"] == 2 for r in train + heldout) == len(second)
    card = (packed / "README.md").read_text()
    assert f"its own answers to {len(answered)} instructions" in card and "| all |" in card
    assert (packed / "lengths.png").stat().st_size > 0
    first_bytes = (packed / "train.jsonl.gz").read_bytes()
    make_chat_data.main(["--out_dir", str(tmp_path / "run"), "--pack", str(packed)])
    assert (packed / "train.jsonl.gz").read_bytes() == first_bytes  # no timestamp: same rows, same bytes

    # another machine: an empty run folder continues from the packed run's own files
    run(tmp_path / "elsewhere", target, "--resume_from", str(packed), monkeypatch=monkeypatch)
    assert "continuing the run packed in" in capsys.readouterr().out
    assert (tmp_path / "elsewhere" / "run" / "rows.jsonl").read_bytes() == (
        tmp_path / "run" / "rows.jsonl"
    ).read_bytes()
    run(tmp_path / "elsewhere", target, "--resume_from", str(packed), monkeypatch=monkeypatch)  # a run there: kept
    out = capsys.readouterr().out
    assert "continuing the run packed in" not in out and "already holds the run packed in" in out
    # a restore killed before its last file (settings.json) left a torn rows.jsonl: the next one restores again
    (tmp_path / "torn" / "run").mkdir(parents=True)
    (tmp_path / "torn" / "run" / "rows.jsonl").write_bytes((tmp_path / "run" / "rows.jsonl").read_bytes()[:50])
    run(tmp_path / "torn", target, "--resume_from", str(packed), monkeypatch=monkeypatch)
    assert "continuing the run packed in" in capsys.readouterr().out
    assert (tmp_path / "torn" / "run" / "rows.jsonl").read_bytes() == (tmp_path / "run" / "rows.jsonl").read_bytes()
    with pytest.raises(SystemExit, match="no packed run there"):
        run(tmp_path / "third", target, "--resume_from", str(tmp_path), monkeypatch=monkeypatch)

    tokenizer = PreTrainedTokenizerFast.from_pretrained(target)
    config = DataConfig(source=str(packed / "*.jsonl.gz"), heldout_files=str(packed / "heldout.jsonl.gz"), seq_len=8)
    loaded = load_rows(config, tokenizer)
    assert loaded.summary["train_documents"] == len(train) and loaded.summary["heldout_documents"] == len(heldout)


def test_chat_rows_teach_the_answers_only_and_plain_text_every_token(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_target(tmp_path / "t"))
    turns = [("user", "w1 w2"), ("assistant", "w3 w4"), ("user", "w5"), ("assistant", "w6")]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]}))
    rows = load_rows(DataConfig(source=str(tmp_path / "chat.jsonl"), seq_len=15), tokenizer, split=False).heldout
    words = "user : w1 w2 assistant : w3 w4 user : w5 assistant : w6 </s>".split()
    assert rows["input_ids"] == [[VOCAB[w] for w in words]]
    # position t is learnt where token t+1 is part of an answer: w3 w4, then w6 and the end of the text
    learnt = [words[t + 1] for t, flag in enumerate(rows["loss_mask"][0]) if flag]
    assert learnt == ["w3", "w4", "w6", "</s>"]
    every = load_rows(DataConfig(source=str(tmp_path / "chat.jsonl"), seq_len=15, loss_on="all"), tokenizer, False)
    assert every.heldout["loss_mask"] == [[1] * 14 + [0]]

    (tmp_path / "text.jsonl").write_text(json.dumps({"text": "w1 w2 w3"}))
    text = load_rows(DataConfig(source=str(tmp_path / "text.jsonl"), seq_len=4), tokenizer, split=False).heldout
    assert text["loss_mask"] == [[1, 1, 1, 0]]

    tokenizer.chat_template = "{% for m in messages|reverse %}{{ m['content'] }} {% endfor %}"  # not prefixes
    with pytest.raises(ValueError, match="data.loss_on: all"):
        load_rows(DataConfig(source=str(tmp_path / "chat.jsonl"), seq_len=4), tokenizer, split=False)


def test_chat_rows_without_an_answer_are_refused_when_answers_are_learnt(tmp_path, monkeypatch):
    """Chat rows without an assistant turn under data.loss_on: answers had no position to learn: every step's loss
    was 0 and the heads stayed as they started, without a word. Refused when read, naming the source and the
    setting; with data.loss_on: all every token is learnt."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_target(tmp_path / "t"))
    source = tmp_path / "asked.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"w{i} w{i + 1} w{i + 2}"}]} for i in range(6)]
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = DataConfig(source=str(source), seq_len=4, heldout_fraction=0.5)
    with pytest.raises(ValueError, match=f"no token of the training rows from '{source}' is one to learn: with "
                       "data.loss_on: answers"):  # fmt: skip
        load_rows(config, tokenizer)
    with pytest.raises(ValueError, match="no token of the held-out rows .* set data.loss_on: all"):
        load_rows(config, tokenizer, split=False)
    every = load_rows(DataConfig(source=str(source), seq_len=4, heldout_fraction=0.5, loss_on="all"), tokenizer)
    assert all(any(mask) for mask in every.train["loss_mask"])


def test_resume_from_into_an_out_dir_holding_a_run_says_what_it_does(tmp_path, monkeypatch, capsys):
    """--resume_from P with an --out_dir that already held a run was ignored without a word: that run went on, P's
    rows unused. Another run there is refused, naming the settings that differ; the same run goes on from its own
    rows, saying so."""
    monkeypatch.setattr(make_chat_data.kinds, "Material", small_material)
    settings = {"count": 30, "seed": 0, "max_new_tokens": 40, "max_prompt_tokens": 1664, "prose_wheel": None}
    packed = tmp_path / "packed"
    (packed / "raw").mkdir(parents=True)
    (packed / "raw" / "settings.json.gz").write_bytes(gzip.compress(json.dumps({"target": "t", **settings}).encode()))
    (tmp_path / "run").mkdir()
    args = ["--out_dir", str(tmp_path / "run"), "--count", "30", "--max_new_tokens", "40", "--resume_from", str(packed)]
    args += ["--target", str(tmp_path / "no-model")]
    (tmp_path / "run" / "settings.json").write_text(json.dumps({"target": "t", **settings, "seed": 1}))
    with pytest.raises(SystemExit, match=r"--out_dir .*run already holds another run \(seed 0 in the pack, 1 in "
                       r"--out_dir\), which it would continue instead"):  # fmt: skip
        make_chat_data.main([*args, "--seed", "1"])
    (tmp_path / "run" / "settings.json").write_text(json.dumps({"target": "t", **settings}))
    with pytest.raises(OSError, match="neither a known target"):  # the same run: it goes on, to load the target
        make_chat_data.main(args)
    assert f"already holds the run packed in {packed}: continuing from the rows in" in capsys.readouterr().out


def test_a_prose_run_and_a_plain_run_do_not_resume_each_other(tmp_path):
    """The run folder records whether it is a prose run (by the wheel's project and version, the same on every
    platform); resuming it the other way is refused before any work."""
    wheel = fake_prose_wheel(tmp_path)
    (tmp_path / "run").mkdir()
    settings = {"count": 10, "seed": 0, "max_new_tokens": 384, "max_prompt_tokens": 1664, "prose_wheel": "gensim-4.4.0"}
    (tmp_path / "run" / "settings.json").write_text(json.dumps({"target": "t", **settings}))
    args = ["--out_dir", str(tmp_path / "run"), "--count", "10", "--target", str(tmp_path / "no-model")]
    with pytest.raises(SystemExit, match="holds a run with other settings"):
        make_chat_data.main(args)
    with pytest.raises(OSError, match="neither a known target"):  # the same settings pass: the target is loaded next
        make_chat_data.main([*args, "--prose_wheel", str(wheel)])


def test_copy_tasks_repeat_their_prompts_text_seeded_with_a_held_out_split(tmp_path):
    import make_copy_data

    source = tmp_path / "source.jsonl.gz"
    passage = " ".join(f"p{i}" for i in range(60))
    rows = [{"messages": [{"role": "user", "content": passage}, {"role": "assistant", "content": "a b"}]},
            {"messages": [{"role": "user", "content": "short words only here"}]}]  # fmt: skip
    with gzip.open(source, "wt") as file:
        file.write("".join(json.dumps(row) + "\n" for row in rows))

    def make(out):
        make_copy_data.main(["--out", str(out), "--count", "40", "--seed", "3", "--sources", str(source)])
        return [gzip.decompress((out / name).read_bytes()) for name in ("train.jsonl.gz", "heldout.jsonl.gz")]

    first = make(tmp_path / "a")
    assert first == make(tmp_path / "b")  # seeded: the same bytes
    train, held = ([json.loads(line) for line in data.decode().splitlines()] for data in first)
    assert (len(train), len(held)) == (36, 4) and [row["index"] for row in held] == [9, 19, 29, 39]
    words = set(passage.split()) | set("short words only here".split())
    for row in train + held:
        user, answer = row["messages"][0]["content"], row["messages"][1]["content"]
        assert answer in user and set(answer.split()) <= words  # the answer repeats the prompt's text
        if row["kind"] == "copy passage":
            assert answer in passage and len(answer.split()) >= 30
        assert all(m["content"] == answer for m in row["messages"][3::2])  # a second turn repeats it again
    assert {row["kind"] for row in train} == {"copy passage", "copy shuffled"}
    assert any(row["turns"] == 2 for row in train)
    assert "copy shuffled" in (tmp_path / "a" / "README.md").read_text()


def test_copy_tasks_refuse_a_folder_holding_other_data_unless_overwrite(tmp_path, capsys):
    """--out (by default the committed training/data/copy) was replaced whatever it held. A folder with other rows,
    or other files, is refused naming it; the same command again writes the same rows, saying so; --overwrite
    replaces the splits and card."""
    import make_copy_data

    source = tmp_path / "source.jsonl.gz"
    passage = " ".join(f"p{i}" for i in range(60))
    with gzip.open(source, "wt") as file:
        file.write(json.dumps({"messages": [{"role": "user", "content": passage}]}) + "\n")
    out = tmp_path / "copy"

    def make(*extra):
        make_copy_data.main(["--out", str(out), "--count", "20", "--sources", str(source), *extra])
        return {path.name: path.read_bytes() for path in out.iterdir()}

    first = make()
    assert make() == first and "already holds these rows" in capsys.readouterr().out
    for other in (["--seed", "1"], ["--count", "30"]):
        with pytest.raises(SystemExit, match=f"--out {out} is not empty and does not hold this run's rows in "
                           "train.jsonl.gz, heldout.jsonl.gz .* pass --overwrite"):  # fmt: skip
            make(*other)
        assert {path.name: path.read_bytes() for path in out.iterdir()} == first  # nothing written
    assert make("--seed", "1", "--overwrite") != first
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "mine.txt").write_text("kept")
    with pytest.raises(SystemExit, match=f"--out {notes} is not empty"):
        make_copy_data.main(["--out", str(notes), "--count", "20", "--sources", str(source)])
    assert [path.name for path in notes.iterdir()] == ["mine.txt"]


def test_pack_refuses_a_folder_holding_another_runs_data(tmp_path):
    """`--pack` into a folder packed from another run would replace its splits and its raw/ resume point (and leave
    that run's magpie.jsonl.gz beside this run's files where this run has none); into other data, its splits and
    card. Both are refused before anything is written; the same run packs again over its own pack."""

    def a_run(name: str, seed: int, magpie: bool) -> Path:
        out = tmp_path / name
        out.mkdir()
        settings = {"count": 10, "seed": seed, "max_new_tokens": 40, "max_prompt_tokens": 100, "prose_wheel": None}
        (out / "settings.json").write_text(json.dumps({"target": "t", **settings}) + "\n")
        messages = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": f"w{seed}"}]
        rows = [{"index": i, "kind": "qa", "sampled": False, "heldout": i == 9, "turns": 1, "prompt_tokens": 3,
                 "answer_tokens": 2, "truncated": False, "messages": messages} for i in (0, 9)]  # fmt: skip
        (out / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        if magpie:
            (out / "magpie.jsonl").write_text(json.dumps({"index": 3, "text": None}) + "\n")
        return out

    first, other, packed = a_run("first", 0, magpie=True), a_run("other", 1, magpie=False), tmp_path / "packed"
    make_chat_data.main(["--out_dir", str(first), "--pack", str(packed)])
    before = {path: path.read_bytes() for path in packed.rglob("*") if path.is_file()}
    with pytest.raises(SystemExit, match=rf"--pack {packed} holds the data of another run \(seed 0 there, 1 here\)"):
        make_chat_data.main(["--out_dir", str(other), "--pack", str(packed)])
    assert {path: path.read_bytes() for path in packed.rglob("*") if path.is_file()} == before
    make_chat_data.main(["--out_dir", str(first), "--pack", str(packed)])  # the same run: packed again
    assert {path: path.read_bytes() for path in packed.rglob("*") if path.is_file()} == before

    data = tmp_path / "data"  # e.g. make_copy_data's folder: splits and a card, no raw/
    data.mkdir()
    (data / "train.jsonl.gz").write_bytes(b"kept")
    with pytest.raises(SystemExit, match="holds data that no run packed"):
        make_chat_data.main(["--out_dir", str(first), "--pack", str(data)])
    assert sorted(path.name for path in data.iterdir()) == ["train.jsonl.gz"]
    make_chat_data.main(["--out_dir", str(first), "--pack", str(tmp_path / "empty")])  # a new folder: packed


@pytest.mark.parametrize(
    "option, value",
    [("--window", "0"), ("--batch_size", "-4"), ("--token_budget", "0"), ("--max_new_tokens", "0"),
     ("--max_prompt_tokens", "0"), ("--num_threads", "0"), ("--count", "-1")],
)  # fmt: skip
def test_counts_below_one_are_refused_before_the_target_loads(option, value, capsys):
    """--window 0 stopped in range() after the target had loaded; batch sizes below 1 became 1, --max_new_tokens 0
    wrote empty answers as data and --max_prompt_tokens 0 skipped every prompt: now argparse names the option."""
    with pytest.raises(SystemExit) as stopped:
        make_chat_data.parse_args(["--out_dir", "unused", option, value])
    assert stopped.value.code == 2 and f"argument {option}: must be 1 or more, got {value}" in capsys.readouterr().err
