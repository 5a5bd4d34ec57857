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


@pytest.fixture(scope="module")
def local_datasets(tmp_path_factory):
    """One small dataset (its text in column "body", an "id" column beside it) as a `datasets.Dataset`, a dir
    `save_to_disk` wrote, a DatasetDict's, a dir of parquet files and a parquet file."""
    datasets = pytest.importorskip("datasets")
    d = tmp_path_factory.mktemp("datasets")
    docs = read_documents(CALIB, max_chars=40_000)
    ds = datasets.Dataset.from_dict({"id": list(range(len(docs))), "body": docs})
    ds.save_to_disk(str(d / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(d / "saved-dict"))
    ds.to_parquet(str(d / "parquet" / "data" / "train-00000.parquet"))
    return ds, d, docs


def test_hugging_face_datasets_are_calibration_sources(micro_path, local_datasets):
    from transformers import AutoTokenizer

    ds, d, docs = local_datasets
    tok = AutoTokenizer.from_pretrained(micro_path)
    cfg = CalibConfig(seq_len=32, n_train=4, n_val=2, n_init=4, text_column="body")
    want = build_calibration(tok, iter(docs), cfg)
    parquet = d / "parquet"
    for source in (ds, d / "saved", str(d / "saved-dict"), parquet, parquet / "data" / "train-00000.parquet"):
        stream = read_documents(source, text_column="body")
        counts: dict = {}
        got = build_calibration(tok, stream, cfg, counts)
        assert all(bool((got[k] == want[k]).all()) for k in want), source
        assert 0 < counts["documents"] == stream.read < len(docs)  # read only as far as the sequences need
    assert read_documents(ds).spec == f"datasets.Dataset (fingerprint {ds._fingerprint})"
    with pytest.raises(ValueError, match=r"has no column 'text'; its columns: id, body"):
        read_documents(d / "saved", text_column="text")


def test_a_hub_dataset_needs_no_org(local_hub_dataset):
    calls, _ = local_hub_dataset
    assert isinstance(read_documents("wikitext:wikitext-2-raw-v1@train"), DocumentStream)
    assert calls == [("wikitext", "wikitext-2-raw-v1", "train", True)]
    with pytest.raises(FileNotFoundError, match="no such file"):  # a missing file is not taken for a Hub name
        read_documents("calib-typo.txt.xz")


def test_calibrate_takes_a_dataset_dir_and_its_text_column(micro_path, local_datasets, tmp_path):
    from moesq_runner import moesq_here

    ds, d, docs = local_datasets
    args = ("calibrate", "--model", micro_path, "--seq-len", "32", "--n-train", "4", "--n-val", "2", "--n-init", "4")
    r = moesq_here(*args, "-w", tmp_path / "w", "--calib", d / "saved", "--text-column", "body", check=False)
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "w" / "manifest.json").read_text())
    assert m["config"]["calib"]["text_column"] == "body" and 0 < m["calibration"]["documents"] < len(docs)
    r = moesq_here(*args, "-w", tmp_path / "w2", "--calib", d / "saved", "--text-column", "content", check=False)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].endswith("its columns: id, body"), r.stderr


def test_compress_takes_a_dataset_object(micro_path, local_datasets, tmp_path):
    from moesq_core import CompressConfig, compress
    from moesq_core.compression.calibration import dataset_label
    from moesq_core.compression.pipeline import open_workdir
    from moesq_core.compression.workdir import WorkDirError

    ds, _, _ = local_datasets
    cfg = CompressConfig(init="rtn", calib={"seq_len": 32, "n_train": 2, "n_val": 2, "n_init": 4,
                                            "text_column": "body"})
    # the work dir compress(calib=ds) opens (its one-shot stage left out: test time for nothing new here)
    open_workdir(tmp_path / "w", micro_path, {**cfg.run_config().flat(), "calib_source": dataset_label(ds)},
                 dataset=ds)
    m = json.loads((tmp_path / "w" / "manifest.json").read_text())
    assert m["config"]["calib_source"] == f"datasets.Dataset (fingerprint {ds._fingerprint})"
    with pytest.raises(WorkDirError, match="calib_source"):  # other data: refused before any work
        compress(micro_path, cfg, tmp_path / "w", calib=ds.select(range(10)))
    with pytest.raises(ValueError, match="calib must be a datasets.Dataset"):
        compress(micro_path, cfg, tmp_path / "w", calib=["some text"])
