"""The feature cache of training (selfspec/training/feature_cache.py) and the hidden-state entries each kind of
heads declares: stored once, read back the same, refused where it was made for something else."""

from __future__ import annotations

import shutil
from collections import namedtuple

import numpy as np
import pytest
import torch
from tiny_models import tiny_model

from selfspec.adapter import ModelAdapter
from selfspec.heads import EagleHeads, ExitHeads, MedusaHeads
from selfspec.training.config import HeadsConfig
from selfspec.training.distill import target_pass, target_states
from selfspec.training.feature_cache import CachedStates, FeatureCache, rows_digest


def all_kinds(adapter: ModelAdapter, eagle3: bool = True):
    torch.manual_seed(0)
    layers = adapter.fingerprint().num_hidden_layers
    yield ExitHeads(adapter.fingerprint(), [1, layers - 1])
    yield MedusaHeads(adapter.fingerprint(), 2)
    yield EagleHeads.from_config(HeadsConfig(kind="eagle", unroll=2), adapter)  # the last hidden state
    yield EagleHeads.from_config(HeadsConfig(kind="eagle", feature_layers=[0, 1], unroll=2), adapter)
    if eagle3:  # GPT-2's layer has no q/k/v projections for the token states to widen
        yield EagleHeads.from_config(HeadsConfig(kind="eagle", feature_layers=[1], unroll=2, layout="eagle3"), adapter)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_the_declared_entries_are_all_that_the_drafts_read(arch):
    """Each kind's distillation drafts from only its `hidden_entries` equal those from the whole forward."""
    model = tiny_model(arch)
    adapter = ModelAdapter(model)
    hidden_states, _ = target_pass(model, torch.randint(3, 90, (2, 10)))
    for heads in all_kinds(adapter, eagle3=arch != "gpt2"):
        heads.eval()  # no dropout (GPT-2's layer config has some): two passes must agree
        kept = CachedStates({e: hidden_states[e] for e in heads.hidden_entries()}, len(hidden_states))
        with torch.no_grad():
            full = heads.distillation_drafts(adapter, hidden_states)
            cached = heads.distillation_drafts(adapter, kept)
            assert [d.name for d in cached] == [d.name for d in full]
            for a, b in zip(full, cached, strict=True):
                assert torch.equal(a.head(a.hidden), b.head(b.hidden)), (type(heads).__name__, a.name)


def test_an_entry_left_out_is_named():
    states = CachedStates({0: torch.zeros(1), 4: torch.ones(1)}, 5)
    assert len(states) == 5 and torch.equal(states[-1], torch.ones(1))
    with pytest.raises(KeyError, match=r"hidden_states\[2\] is not in the feature cache \(it keeps entries \[0, 4\]\)"):
        states[2]
    with pytest.raises(TypeError, match="one entry at a time"):
        states[0:2]
    with pytest.raises(IndexError, match="out of range: a forward has 5 entries"):
        states[5]


def make_cache(directory, model, rows=4, seq_len=6, entries=(0, 1), dtype="float32", **digests):
    fingerprint = ModelAdapter(model).fingerprint()
    return FeatureCache(
        directory, num_rows=rows, seq_len=seq_len, hidden_size=fingerprint.hidden_size,
        num_layers=fingerprint.num_hidden_layers, entries=entries, dtype=dtype, out_dtype=torch.float32,
        digests={"target": "t", "rows": "r", **digests},
    )  # fmt: skip


def test_rows_are_forwarded_once_and_read_back_in_the_stored_dtype(tmp_path):
    model = tiny_model("llama")
    ids = torch.randint(3, 90, (4, 6), generator=torch.Generator().manual_seed(1))
    calls = []

    def forward(batch):
        calls.append(batch.clone())
        return target_states(model, batch)

    cache = make_cache(tmp_path / "cache", model)
    assert cache.entries == [0, 1, model.config.num_hidden_layers]  # the teacher's entry is always kept
    first = cache.hidden_states([2, 0], ids[[2, 0]], forward)
    again = cache.hidden_states([0, 3, 2], ids[[0, 3, 2]], forward)
    assert [c.tolist() for c in calls] == [ids[[2, 0]].tolist(), ids[[3]].tolist()]  # only the rows not yet stored
    assert (cache.hits, cache.misses, cache.filled_rows()) == (2, 3, 3)
    reference = target_states(model, ids)
    for entry in cache.entries:  # float32: the forward's values, bit for bit
        assert torch.equal(first[entry], reference[entry][[2, 0]])
        assert torch.equal(again[entry], reference[entry][[0, 3, 2]])
    with pytest.raises(KeyError):
        first[2]

    reopened = make_cache(tmp_path / "cache", model)  # a later session: the stored rows are still there
    calls.clear()
    assert torch.equal(reopened.hidden_states([3], ids[[3]], forward)[-1], reference[-1][[3]])
    assert calls == [] and reopened.filled_rows() == 3

    half = make_cache(tmp_path / "bf16", model, dtype="bfloat16")
    got = half.hidden_states([1], ids[[1]], forward)
    assert got[1].dtype == torch.float32 and half.states.dtype == torch.bfloat16
    assert torch.equal(got[1], reference[1][[1]].to(torch.bfloat16).float())
    with pytest.raises(ValueError, match=r"2 rows of 6 tokens expected, got ids of shape \(1, 6\)"):
        cache.hidden_states([0, 1], ids[[0]], forward)


def test_a_cache_made_for_something_else_is_refused_and_kept(tmp_path):
    model = tiny_model("llama")
    make_cache(tmp_path / "cache", model)
    meta = (tmp_path / "cache" / "meta.json").read_text()
    with pytest.raises(ValueError, match=r"made with other settings: target 't' there, 'u' here"):
        make_cache(tmp_path / "cache", model, target="u")
    with pytest.raises(ValueError, match=r"other settings: entries \[0, 1, 4\] there, \[0, 4\] here"):
        make_cache(tmp_path / "cache", model, entries=(0,))
    with pytest.raises(ValueError, match="other settings: dtype 'float32' there, 'bfloat16' here"):
        make_cache(tmp_path / "cache", model, dtype="bfloat16")
    assert (tmp_path / "cache" / "meta.json").read_text() == meta  # never rewritten
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="files but no meta.json: not a feature cache"):
        make_cache(tmp_path / "other", model)
    with pytest.raises(ValueError, match=r"entries \[7\] are outside 0\.\.4"):
        make_cache(tmp_path / "new", model, entries=(7,))
    with pytest.raises(ValueError, match="dtype must be one of"):
        make_cache(tmp_path / "new", model, dtype="int8")


def test_a_cache_larger_than_the_free_disk_is_refused(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 100, 100))
    with pytest.raises(ValueError, match=r"needs 0\.0 GiB for 4 rows and 0\.0 GiB are free"):
        make_cache(tmp_path / "cache", tiny_model("llama"))
    assert not (tmp_path / "cache" / "meta.json").exists()


def test_the_rows_digest_sees_order_and_values():
    rows = np.arange(12).reshape(3, 4)
    assert rows_digest(rows) == rows_digest(rows.copy()) == rows_digest(rows.astype(np.int32))
    assert rows_digest(rows[[1, 0, 2]]) != rows_digest(rows)
    changed = rows.copy()
    changed[2, 3] = 0
    assert rows_digest(changed) != rows_digest(rows)
    assert isinstance(rows_digest(rows), str) and len(rows_digest(rows)) == 64  # hex SHA-256, for meta.json
