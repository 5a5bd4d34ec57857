"""Data loading and choices for the `moesq_cloze` lm-eval task (see moesq_cloze.yaml)."""
from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "moesq_cloze.jsonl"


def load_dataset(**_ignored):
    """lm-eval `custom_dataset` hook: the local JSONL as a DatasetDict with one `test` split.

    lm-eval passes the task metadata as keyword arguments; none of it changes the data.
    """
    import datasets

    with DATA.open(encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def doc_to_choice(doc: dict) -> list[str]:
    """The sentence once per option, the blank filled in; scored after the context."""
    return [doc["before"] + word + doc["after"] for word in doc["options"]]
