"""Calibration data: read documents (text, xz/gz text, JSONL, a Hugging Face dataset: a `datasets.Dataset`, a
local dataset dir (`save_to_disk`'s, or parquet files) or a Hub name when online), tokenize, pack into fixed-length
sequences, and make seeded disjoint splits (train / val / init).

A Hub dataset is streamed: only the documents the requested sequences need are downloaded and read."""
from __future__ import annotations

import gzip
import json
import lzma
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class CalibConfig:
    # config files: an unknown key is an error (moesq_core.compression.config)
    __pydantic_config__ = {"extra": "forbid"}

    seq_len: int = 512  # tokens per calibration sequence
    n_train: int = 128  # refinement sequences
    n_val: int = 16  # held-out sequences (refinement's best-epoch selection)
    n_init: int = 64  # SGPTQ / one-shot methods' sequences
    seed: int = 0  # seed of the splits
    text_column: str | None = None  # the dataset column (JSONL field) holding the text (default: "text", else
    # a dataset's first text column)

    def __post_init__(self):
        for name, what in (("seq_len", "tokens per sequence"), ("n_train", "refinement sequences"),
                           ("n_val", "held-out sequences"), ("n_init", "one-shot sequences")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive number of {what}, got {v!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer from 0 to 2**64 - 1 (torch's seeds), got {self.seed!r}")
        if self.text_column is not None and (not isinstance(self.text_column, str) or not self.text_column):
            raise ValueError(f"text_column must be a column name, got {self.text_column!r}")

    def to_dict(self) -> dict:
        """Without text_column when it is unset: work dirs calibrated before it existed keep their identity."""
        d = asdict(self)
        if d["text_column"] is None:
            del d["text_column"]
        return d


def open_text(path: Path):
    if path.suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _read_file(p: Path, max_chars: int | None, text_column: str | None = None) -> list[str]:
    """Documents of one text or JSONL file; a file that is not (compressed) UTF-8 text is named in the error."""
    field = text_column or "text"
    try:
        with open_text(p) as fh:
            if ".jsonl" in p.name or ".json" in p.name:
                docs = []
                for i, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            docs.append(json.loads(line)[field])
                        except (json.JSONDecodeError, KeyError, TypeError):
                            raise ValueError(f"{p}:{i}: expected a JSON object with a {field!r} field per line") \
                                from None
            else:
                text = fh.read(max_chars) if max_chars else fh.read()
                docs = [d.strip() for d in text.split("\n\n") if d.strip()]
    except UnicodeDecodeError as e:
        raise ValueError(f"calibration file {p} is not UTF-8 text (undecodable byte at offset {e.start}); "
                         "pass a .txt/.txt.xz/.jsonl file") from None
    except (lzma.LZMAError, gzip.BadGzipFile, EOFError, OSError) as e:
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError)):
            raise
        raise ValueError(f"calibration file {p} could not be decompressed ({type(e).__name__}: {e})") from None
    if not docs:
        raise ValueError(f"calibration file {p} contains no text")
    if any("\x00" in d for d in docs):
        raise ValueError(f"calibration file {p} is binary (contains NUL bytes), not text; "
                         "pass a .txt/.txt.xz/.jsonl file")
    return docs


_TEXT_SUFFIXES = (".txt", ".jsonl", ".json")
_FILE_SUFFIXES = (*_TEXT_SUFFIXES, ".xz", ".gz", ".parquet")  # a name ending so is a (missing) file, not a Hub id
_HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?(:[\w.-]+)?(@[\w.:%\[\]-]+)?")


def is_hub_dataset_name(source: str) -> bool:
    """`name[:config][@split]` or `org/name[:config][@split]` that is no local path (nor the name of a file)."""
    return (not Path(source).expanduser().exists() and not source.startswith((".", "/", "~"))
            and _HUB_NAME.fullmatch(source) is not None
            and not source.partition(":")[0].partition("@")[0].lower().endswith(_FILE_SUFFIXES))


def is_dataset(obj) -> bool:
    """A `datasets.Dataset` (or DatasetDict), without importing datasets when the caller has not."""
    mod = type(obj).__module__
    return mod.startswith("datasets.") and type(obj).__name__ in ("Dataset", "DatasetDict")


def dataset_label(ds) -> str:
    """How a run records a `datasets.Dataset` it calibrated on: its fingerprint (the same data, loaded again or
    rebuilt the same way, has the same one)."""
    return f"datasets.Dataset (fingerprint {ds._fingerprint})"


def _saved_dataset(p: Path) -> bool:
    """A dir `save_to_disk` wrote (a Dataset's or a DatasetDict's)."""
    return (p / "dataset_dict.json").is_file() or ((p / "state.json").is_file() and (p / "dataset_info.json").is_file())


def _parquet_files(p: Path) -> list[Path]:
    return [p] if p.is_file() else sorted(f for f in p.rglob("*.parquet") if f.is_file())


def _needs_datasets(what: str):
    try:
        import datasets
    except ImportError:
        raise FileNotFoundError(f"{what} is a Hugging Face dataset, which needs the 'datasets' package: "
                                "pip install -e \".[datasets]\" (or pass a local text/JSONL file)") from None
    return datasets


def _one_split(ds, source: str):
    """A Dataset from a Dataset or DatasetDict (its "train" split, else its only one)."""
    if type(ds).__name__ == "DatasetDict":
        if "train" in ds or len(ds) == 1:
            return ds["train" if "train" in ds else next(iter(ds))]
        raise ValueError(f"{source}: a dataset with the splits {', '.join(ds)} and no 'train'; pass one split "
                         "(dataset[\"validation\"], or save_to_disk one split)")
    return ds


def _local_dataset(p: Path, source: str, text_column: str | None) -> DocumentStream:
    datasets = _needs_datasets(str(source))
    try:
        if _saved_dataset(p):
            ds = datasets.load_from_disk(str(p))
        else:
            ds = datasets.load_dataset("parquet", data_files=[str(f) for f in _parquet_files(p)], split="train")
    except Exception as e:
        raise ValueError(f"calibration dataset {source} could not be read ({type(e).__name__}: {e})") from None
    return DocumentStream(_one_split(ds, str(source)), str(source), text_column)


def read_documents(source, max_chars: int | None = None, text_column: str | None = None) -> list[str] | DocumentStream:
    """Documents from a text file (blank-line separated; .xz/.gz ok), a JSONL file (a "text" field per line, or
    `text_column`), a directory of those (a list); or a Hugging Face dataset (a DocumentStream, read only as far
    as it is iterated, of its `text_column`, else "text", else its first text column): a `datasets.Dataset`, a
    dir `save_to_disk` wrote, parquet files (a file, or a dir holding them), or a Hub name `[org/]name[:config]
    [@split]` (needs network)."""
    if is_dataset(source):
        ds = _one_split(source, "the dataset")
        return DocumentStream(ds, dataset_label(ds), text_column)
    p = Path(source).expanduser()
    if p.is_dir() and (_saved_dataset(p) or (_parquet_files(p) and not any(
            f.is_file() and any(s in f.name for s in _TEXT_SUFFIXES) for f in p.iterdir()))):
        return _local_dataset(p, source, text_column)
    if p.is_dir():
        docs: list[str] = []
        for f in sorted(p.iterdir()):
            if f.is_file() and any(s in f.name for s in _TEXT_SUFFIXES):
                docs += read_documents(f, text_column=text_column)
        if not docs:
            raise ValueError(f"{source}: no .txt/.jsonl files with text found (nor a saved dataset or parquet files)")
        return docs
    if p.is_file() and p.suffix == ".parquet":
        return _local_dataset(p, source, text_column)
    if p.is_file():
        return _read_file(p, max_chars, text_column)
    if is_hub_dataset_name(str(source)):
        return _hf_dataset(str(source), text_column)
    raise FileNotFoundError(f"calibration source {source!r}: no such file or directory")


class DocumentStream:
    """The documents of a Hugging Face dataset (its `text_column`, else "text", else its first text column),
    read only as far as they are iterated; `read` counts the documents iterated so far. An error while fetching
    is a FileNotFoundError naming the dataset; a `text_column` it lacks is a ValueError naming its columns."""

    def __init__(self, rows: Iterable[dict], spec: str, text_column: str | None = None):
        self.rows, self.spec, self.text_column, self.read = rows, spec, text_column, 0
        columns = getattr(rows, "column_names", None)  # known before reading (not for every streamed dataset)
        if text_column is not None and columns is not None and text_column not in columns:
            raise ValueError(self._no_column(columns))

    def _no_column(self, columns) -> str:
        return f"dataset {self.spec!r} has no column {self.text_column!r}; its columns: {', '.join(columns)}"

    def __iter__(self) -> Iterator[str]:
        rows = iter(self.rows)
        while True:
            try:
                row = next(rows)
            except StopIteration:
                return
            except Exception as e:
                raise FileNotFoundError(f"dataset {self.spec!r} could not be read ({type(e).__name__}: {e}); it needs "
                                        "network access, or pass a local text/JSONL file") from None
            if self.text_column is not None:
                if self.text_column not in row:
                    raise ValueError(self._no_column(list(row)))
                text = row[self.text_column]
            else:
                text = row.get("text") if "text" in row else next((v for v in row.values() if isinstance(v, str)), None)
            if isinstance(text, str) and text.strip():
                self.read += 1
                yield text


def _hf_dataset(spec: str, text_column: str | None = None) -> DocumentStream:
    name, _, split = spec.partition("@")
    name, _, config = name.partition(":")
    datasets = _needs_datasets(f"--calib {spec!r}")
    try:  # streamed: calibration needs its first documents, not the whole split (C4's is ~300 GB)
        ds = datasets.load_dataset(name, config or None, split=split or "train", streaming=True)
    except Exception as e:
        raise FileNotFoundError(
            f"dataset {spec!r} could not be loaded ({type(e).__name__}: {e}); it needs network access, "
            "or pass a local text/JSONL file"
        ) from None
    return DocumentStream(ds, spec, text_column)


def _token_docs(tokenizer, docs: Iterable[str], need: int) -> Iterator[list[int]]:
    """Each document's tokens with an EOS after it, in order, until they hold `need` tokens: no document is
    read (or tokenized) past that."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    have = 0
    for d in docs:
        ids = tokenizer(d, add_special_tokens=False)["input_ids"] + [eos]
        yield ids
        have += len(ids)
        if have >= need:
            return


def _cut(ids: list[int], seq_len: int, max_sequences: int) -> torch.Tensor:
    n = min(len(ids) // seq_len, max_sequences)
    return torch.tensor(ids[: n * seq_len], dtype=torch.int64).reshape(n, seq_len)


def pack_sequences(tokenizer, docs: Iterable[str], seq_len: int, max_sequences: int,
                   counts: dict | None = None) -> torch.Tensor:
    """Concatenate tokenized documents (EOS between them) and cut into [n, seq_len] sequences; `counts`
    ["documents"]: how many documents that took."""
    read = list(_token_docs(tokenizer, docs, seq_len * max_sequences))
    if counts is not None:
        counts["documents"] = len(read)
    return _cut([t for d in read for t in d], seq_len, max_sequences)


def build_calibration(tokenizer, docs: list[str] | Iterable[str], cfg: CalibConfig,
                      counts: dict | None = None) -> dict[str, torch.Tensor]:
    """Seeded disjoint splits of packed sequences. Documents are shuffled before packing so the splits
    do not follow the source's order: a list as a whole, a stream (any other iterable, e.g. a DocumentStream)
    as the documents read from it, which are read only until they fill the sequences. `counts["documents"]`:
    how many documents the sequences were cut from."""
    total = cfg.n_train + cfg.n_val + cfg.n_init
    counts = {} if counts is None else counts
    if isinstance(docs, (list, tuple)):
        docs = list(docs)
        random.Random(cfg.seed).shuffle(docs)
        seqs = pack_sequences(tokenizer, docs, cfg.seq_len, total, counts)
    else:
        read = list(_token_docs(tokenizer, docs, cfg.seq_len * total))
        counts["documents"] = len(read)
        random.Random(cfg.seed).shuffle(read)
        seqs = _cut([t for d in read for t in d], cfg.seq_len, total)
    if len(seqs) < total:
        raise ValueError(
            f"the calibration text yields only {len(seqs)} sequences of {cfg.seq_len} tokens; "
            f"{total} are needed (train {cfg.n_train} + val {cfg.n_val} + init {cfg.n_init}). "
            "Give more text or lower the counts / --seq-len."
        )
    perm = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(cfg.seed))
    seqs = seqs[perm]
    return {
        "train": seqs[: cfg.n_train].contiguous(),
        "val": seqs[cfg.n_train : cfg.n_train + cfg.n_val].contiguous(),
        "init": seqs[cfg.n_train + cfg.n_val : total].contiguous(),
    }
