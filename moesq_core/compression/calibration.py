"""Calibration data: read documents (text, xz/gz text, JSONL, or a Hugging Face dataset name when online),
tokenize, pack into fixed-length sequences, and make seeded disjoint splits (train / val / init).

A Hugging Face dataset is streamed: only the documents the requested sequences need are downloaded and read."""
from __future__ import annotations

import gzip
import json
import lzma
import random
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

    def __post_init__(self):
        for name, what in (("seq_len", "tokens per sequence"), ("n_train", "refinement sequences"),
                           ("n_val", "held-out sequences"), ("n_init", "one-shot sequences")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive number of {what}, got {v!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer from 0 to 2**64 - 1 (torch's seeds), got {self.seed!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def open_text(path: Path):
    if path.suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _read_file(p: Path, max_chars: int | None) -> list[str]:
    """Documents of one text or JSONL file; a file that is not (compressed) UTF-8 text is named in the error."""
    try:
        with open_text(p) as fh:
            if ".jsonl" in p.name or ".json" in p.name:
                docs = []
                for i, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            docs.append(json.loads(line)["text"])
                        except (json.JSONDecodeError, KeyError, TypeError):
                            raise ValueError(f"{p}:{i}: expected a JSON object with a 'text' field per line") from None
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


def read_documents(source: str | Path, max_chars: int | None = None) -> list[str] | DocumentStream:
    """Documents from a text file (blank-line separated; .xz/.gz ok), a JSONL file (a "text" field per line),
    a directory of those (a list), or a Hugging Face dataset name `name[:config][@split]` (needs network; a
    DocumentStream, read only as far as it is iterated)."""
    p = Path(source).expanduser()
    if p.is_dir():
        docs: list[str] = []
        for f in sorted(p.iterdir()):
            if f.is_file() and any(s in f.name for s in (".txt", ".jsonl", ".json")):
                docs += read_documents(f)
        if not docs:
            raise ValueError(f"{source}: no .txt/.jsonl files with text found")
        return docs
    if p.is_file():
        return _read_file(p, max_chars)
    if "/" in str(source) and not str(source).startswith((".", "/", "~")):
        return _hf_dataset(str(source))
    raise FileNotFoundError(f"calibration source {source!r}: no such file or directory")


class DocumentStream:
    """The documents of a streamed Hugging Face dataset (its "text" column, else its first text column),
    fetched only as far as they are iterated; `read` counts the documents iterated so far. An error while
    fetching is a FileNotFoundError naming the dataset."""

    def __init__(self, rows: Iterable[dict], spec: str):
        self.rows, self.spec, self.read = rows, spec, 0

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
            text = row.get("text") if "text" in row else next((v for v in row.values() if isinstance(v, str)), None)
            if isinstance(text, str) and text.strip():
                self.read += 1
                yield text


def _hf_dataset(spec: str) -> DocumentStream:
    name, _, split = spec.partition("@")
    name, _, config = name.partition(":")
    try:
        import datasets
    except ImportError:
        raise FileNotFoundError(f"--calib {spec!r} names a Hugging Face dataset, which needs the 'datasets' package: "
                                "pip install 'moesq[datasets]' (or pass a local text/JSONL file)") from None
    try:  # streamed: calibration needs its first documents, not the whole split (C4's is ~300 GB)
        ds = datasets.load_dataset(name, config or None, split=split or "train", streaming=True)
    except Exception as e:
        raise FileNotFoundError(
            f"dataset {spec!r} could not be loaded ({type(e).__name__}: {e}); it needs network access, "
            "or pass a local text/JSONL file"
        ) from None
    return DocumentStream(ds, spec)


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


def pack_sequences(tokenizer, docs: Iterable[str], seq_len: int, max_sequences: int) -> torch.Tensor:
    """Concatenate tokenized documents (EOS between them) and cut into [n, seq_len] sequences."""
    ids: list[int] = []
    for d in _token_docs(tokenizer, docs, seq_len * max_sequences):
        ids += d
    return _cut(ids, seq_len, max_sequences)


def build_calibration(tokenizer, docs: list[str] | Iterable[str], cfg: CalibConfig) -> dict[str, torch.Tensor]:
    """Seeded disjoint splits of packed sequences. Documents are shuffled before packing so the splits
    do not follow the source's order: a list as a whole, a stream (any other iterable, e.g. a DocumentStream)
    as the documents read from it, which are read only until they fill the sequences."""
    total = cfg.n_train + cfg.n_val + cfg.n_init
    if isinstance(docs, (list, tuple)):
        docs = list(docs)
        random.Random(cfg.seed).shuffle(docs)
        seqs = pack_sequences(tokenizer, docs, cfg.seq_len, total)
    else:
        read = list(_token_docs(tokenizer, docs, cfg.seq_len * total))
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
