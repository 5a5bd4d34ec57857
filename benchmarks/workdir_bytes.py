"""Work-dir bytes per stage, against the packed checkpoint's expert bytes, for work dirs `moesq run` made.

    python benchmarks/workdir_bytes.py --out benchmarks/results/workdir_bytes \
        "micro, before=run-micro-old" "micro=run-micro" "tiny=run-tiny"

Each LABEL=WORKDIR is a work dir with a finished `moesq run` (its pack in WORKDIR/packed). Writes OUT.json and
OUT.md: per stage its block files' bytes, bytes per expert weight and the ratio to the packed experts' bytes;
and the calibration, evaluation cache and pack sizes. Labels and model names only, no paths.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _bytes(paths) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file())


def measure(label: str, root: Path) -> dict:
    m = json.loads((root / "manifest.json").read_text())
    pack = json.loads((root / "packed" / "moesq_pack.json").read_text())["summary"]
    weights, expert_bytes = pack["expert_weights"], pack["expert_bytes"]
    stages = {}
    for name, st in m["stages"].items():
        b = _bytes(root / rec["file"] for rec in st["blocks"].values())
        stages[name] = {"layout": st.get("layout", 1), "bytes": b, "bytes_per_weight": round(b / weights, 3),
                        "x_packed_experts": round(b / expert_bytes, 3)}
    return {"label": label, "model": Path(m["model"]["source"]).name, "format": m["config"]["format"],
            "calibration": m["calibration"]["sequences"],
            "seq_len": m["calibration"]["seq_len"], "expert_weights": weights,
            "packed_expert_bytes": expert_bytes, "packed_bits_per_weight": round(pack["bits_per_weight"], 3),
            "stages": stages, "calib_bytes": _bytes((root / "calib").rglob("*")),
            "eval_bytes": _bytes((root / "eval").rglob("*")), "pack_bytes": _bytes((root / "packed").rglob("*")),
            "workdir_bytes_without_pack": _bytes(p for p in root.rglob("*")
                                                 if "packed" not in p.relative_to(root).parts)}


def markdown(rows: list[dict], meta: dict) -> str:
    out = [f"# Work-dir bytes per stage ({meta['date']}, commit {meta['commit']})", "",
           "Block files of each stage of a `moesq run` work dir, per expert weight and against the expert tensors "
           "of the packed checkpoint made from it (layout 1: codes, masks and fp32 latents unpacked; layout 2: "
           "packed by the format's packer)." + (f" {meta['note']}" if meta.get("note") else ""), "",
           "| work dir | layout | stage | bytes | bytes / weight | × packed experts |", "|---|---|---|---|---|---|"]
    for r in rows:
        for name, s in r["stages"].items():
            out.append(f"| {r['label']} | {s['layout']} | {name} | {s['bytes']:,} | {s['bytes_per_weight']:.3f} | "
                       f"{s['x_packed_experts']:.2f} |")
    out += ["", "| work dir | model | expert weights | packed experts (bytes, bits/weight) | calibration | "
                "work dir without the pack |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['label']} | {r['model']} | {r['expert_weights']:,} | {r['packed_expert_bytes']:,} "
                   f"({r['packed_bits_per_weight']}) | {r['calib_bytes']:,} | {r['workdir_bytes_without_pack']:,} |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workdirs", nargs="+", metavar="LABEL=WORKDIR")
    ap.add_argument("--out", type=Path, required=True, help="output path without extension (.json and .md)")
    ap.add_argument("--note", default="", help="how the work dirs were made (a line under the title)")
    args = ap.parse_args()
    rows = []
    for spec in args.workdirs:
        label, sep, path = spec.rpartition("=")
        if not sep:
            raise SystemExit(f"{spec!r}: expected LABEL=WORKDIR")
        rows.append(measure(label, Path(path)))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    meta = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "note": args.note}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
