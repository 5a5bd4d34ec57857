"""benchmarks/accuracy_table.py: the rows run what their names say, and the recorded command holds no machine path."""
import importlib.util
import json
from dataclasses import asdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("accuracy_table", ROOT / "benchmarks" / "accuracy_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sgptq_rows_say_whether_they_refit(table):
    from moesq_core.compression.methods.registry import get_method

    assert get_method("sgptq").refit  # moesq's default init: the `sgptq` row
    assert table.ROWS["sgptq-paper"][3] == {"refit": False}
    # the release-faithful row starts from the release's SGPTQ: fp32 scales, no refit
    init = table.ROWS["release-faithful"][2]
    assert table.ROWS[init][3] == {"exact_scales": False, "refit": False}


def test_every_group_names_known_rows_once(table):
    for group in table.GROUPS:
        rows = table.expand_rows(group)
        assert rows and len(rows) == len(set(rows)) and set(rows) <= set(table.ROWS)
        assert all(r in table.DESCRIPTION for r in rows)
    gpu = table.expand_rows("gpu")
    assert {"refine", "refine-seed1", "refine-p0", "refine-values", "refine-support", "refine-quarter", "refine-paper",
            "release-faithful", "sgptq-paper", "sgptq"} <= set(gpu)


def test_seed_rows_differ_from_their_row_in_the_seed_alone(table):
    seeded = [r for r in table.ROWS if r.endswith("-seed1")]
    assert "refine-e2e-128-seed1" in seeded
    for row in seeded:
        base = row.removesuffix("-seed1")
        assert table.ROWS[row][:3] == table.ROWS[base][:3]
        assert table.ROWS[row][3] == {**table.ROWS[base][3], "seed": 1}
        assert row in table.DESCRIPTION


def test_recorded_command_keeps_no_machine_path(table):
    cmd = table.command_line(["--models", "micro", "--workdir-root", "/tmp/x/accw", "--out", "/root/out",
                              "--shared", "/data/shared-copy", "--rows", "gpu"])
    assert cmd == ("python benchmarks/accuracy_table.py --models micro --workdir-root accw --out out "
                   "--shared shared-copy --rows gpu")


def test_shared_folder_is_an_option(table, tmp_path):
    old = table.SHARED
    try:
        table.SHARED = tmp_path
        assert table.model_path("tiny") == tmp_path / "models/tiny-qwen3-moe"
        assert table.texts("micro") == (tmp_path / "data/calib-docs.txt.xz", tmp_path / "data/eval-docs.txt.xz")
        # the packaged model, whatever --shared says
        assert table.model_path("embedded") == table.pipeline.DEFAULT_MODEL
    finally:
        table.SHARED = old


def test_a_rerun_of_the_same_protocol_keeps_the_notes(table, tmp_path):
    args = ["--models", "embedded", "--acts", "wa", "--rows", "reference", "--out", str(tmp_path),
            "--workdir-root", str(tmp_path / "w"), "--no-run"]
    table.main(args + ["--note", "first run"])
    table.main(args + ["--note", "second run"])
    doc = json.loads((tmp_path / "accuracy_embedded.json").read_text())
    assert doc["notes"] == ["first run", "second run"]
    table.main(args[:-1] + ["--seq-len", "128", "--no-run", "--note", "another protocol"])
    assert json.loads((tmp_path / "accuracy_embedded.json").read_text())["notes"] == ["another protocol"]


def test_window_rows_are_the_default_rows_with_the_window_and_their_kl_line_reads_windowed_records(table):
    for row, window in (("refine-default-w2", 2), ("refine-default-w2-seed1", 2), ("refine-default-w1", 1)):
        base = table.ROWS[row.replace(f"-w{window}", "")]
        assert table.ROWS[row][:3] == base[:3] and table.ROWS[row][3] == {**base[3], "e2e_window": window}
    assert {"refine-default", "refine-default-w2", "refine-default-w1"} <= set(table.expand_rows("e2e-window"))
    whole = {"val_kl": [1.2, 1.0, 1.1], "best_pass": 1, "passes": 2, "steps": 8}
    assert table.e2e_kl(whole) == "val KL 1.2000 → 1.0000 (pass 1 of 2, 8 steps)"
    windowed = {"windows": [{**whole, "layers": [0, 1]}, {"val_kl": [1.0, 0.9, 0.95], "best_pass": 1, "passes": 2,
                                                          "steps": 8, "layers": [2, 3]}], "steps": 8, "best_pass": 1}
    assert table.e2e_kl(windowed) == "val KL 1.2000 → 0.9000 (2 windows, 8 steps each)"


def test_optimizer_rows_are_the_e2e_rows_with_lion_and_tables_from_before_the_option_ran_adam(table):
    for lr in ("1e-3", "3e-4", "1e-4"):
        for seed in ("", "-seed1"):
            row, base = table.ROWS[f"refine-e2e-lion{lr}{seed}"], table.ROWS[f"refine-e2e{seed}"]
            assert row[:3] == base[:3] and row[3] == {**base[3], "e2e_optimizer": "lion", "e2e_lr": float(lr)}
    assert {"refine-e2e", "refine-e2e-seed1", "refine-e2e-lion3e-4"} <= set(table.expand_rows("e2e-optimizer"))
    new = asdict(table.RefineConfig(e2e_steps=64))
    old = {k: v for k, v in new.items() if k != "e2e_optimizer"}  # a table written before the option existed
    assert table.same_refine(old, new)
    assert not table.same_refine(old, {**new, "e2e_optimizer": "lion"})
