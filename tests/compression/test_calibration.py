"""Calibration sources: a Hugging Face dataset is streamed and read only as far as the sequences need."""
from __future__ import annotations

import json

import pytest

from moesq_core.compression.calibration import CalibConfig, DocumentStream, build_calibration, read_documents

from conftest import CALIB

SPEC = "allenai/c4:en@train"  # the example of `calibrate --help`; served here by a local json dataset


@pytest.fixture
def local_hub_dataset(tmp_path, monkeypatch):
    """datasets.load_dataset for SPEC answered by the real "json" builder over two local files: the first
    holds every document of the embedded calibration sample, the second is not JSON, so a reader that goes
    past the first file (or does not stream: it loads both) fails. Returns (calls, documents in the first)."""
    datasets = pytest.importorskip("datasets")
    docs = read_documents(CALIB, max_chars=400_000)
    first, second = tmp_path / "part-0.jsonl", tmp_path / "part-1.jsonl"
    first.write_text("".join(json.dumps({"url": f"doc{i}", "text": d}) + "\n" for i, d in enumerate(docs)))
    second.write_text("not JSON: reading this file means the stream went past what calibration needs\n")
    real, calls = datasets.load_dataset, []

    def load_local(name, config=None, *, split, streaming=False):
        calls.append((name, config, split, streaming))
        return real("json", data_files=[str(first), str(second)], split=split, streaming=streaming)

    monkeypatch.setattr(datasets, "load_dataset", load_local)
    return calls, len(docs)


def test_a_hub_dataset_is_streamed_and_read_only_as_far_as_needed(micro_path, local_hub_dataset):
    from transformers import AutoTokenizer

    calls, n_docs = local_hub_dataset
    tok = AutoTokenizer.from_pretrained(micro_path)
    docs = read_documents(SPEC)
    assert isinstance(docs, DocumentStream) and calls == [("allenai/c4", "en", "train", True)]
    assert docs.read == 0  # nothing is fetched before calibration iterates
    cfg = CalibConfig(seq_len=32, n_train=4, n_val=2, n_init=4)
    calib = build_calibration(tok, docs, cfg)
    assert {k: tuple(v.shape) for k, v in calib.items()} == {"train": (4, 32), "val": (2, 32), "init": (4, 32)}
    assert 0 < docs.read < n_docs  # stopped inside the first file
    # the splits are disjoint and seeded: the same stream gives the same bytes
    again = build_calibration(tok, read_documents(SPEC), cfg)
    assert all(bool((again[k] == calib[k]).all()) for k in calib)
    # asking for more than the first file holds reads the second: the error names the dataset
    with pytest.raises(FileNotFoundError, match=r"dataset 'allenai/c4:en@train' could not be read"):
        build_calibration(tok, read_documents(SPEC), CalibConfig(seq_len=512, n_train=4096, n_val=2, n_init=4))


def test_calibrate_records_the_documents_a_stream_gave(micro_path, local_hub_dataset, tmp_path):
    from moesq_core.compression.config import RunConfig
    from moesq_core.compression.pipeline import calibrate
    from moesq_core.compression.workdir import WorkDir

    calls, n_docs = local_hub_dataset
    info = calibrate(WorkDir(tmp_path / "wd"), micro_path,
                     RunConfig(calib_source=SPEC, calib=CalibConfig(seq_len=32, n_train=4, n_val=2, n_init=4)))
    assert info["sequences"] == {"train": 4, "val": 2, "init": 4} and 0 < info["documents"] < n_docs
    assert calls[-1][-1] is True
