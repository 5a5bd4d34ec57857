"""The model card (README.md) `moesq pack` writes: Hub front matter (base model, `base_model_relation: quantized`,
`library_name: moesq`, tags, the calibration's Hub dataset), what the checkpoint is, how it was made (its recipe,
its calibration in sequences × tokens and documents), the evaluation results the work dir holds for its stage, and
how to load and serve it; and the pack's `recipe.yaml` (`recipe_yaml`): the configuration that made it, which
`CompressConfig.from_file` loads.

Filled from the run's identity (the work dir's RunIdentity: model, format, activations, calibration, which the
caller reads and validates), the manifest's calibration and stage records, and the work dir's eval results
(`eval/results.json`: perplexities; `eval/lm_eval/`: task accuracies); reproducible: the same stage and results
give the same bytes (no dates, no machine paths).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from moesq_core.version import __version__

if TYPE_CHECKING:  # the caller (export, in the compression wing) reads it; the checkpoint only renders it
    from moesq_core.compression.workdir import RunIdentity

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_EMBEDDED_CALIB = "calib-sample.txt.xz"  # moesq_core/assets: the default calibration text
# lm-eval metrics in order of preference for a task's one number on the card
_PRIMARY_METRICS = ("acc_norm,none", "acc,none", "exact_match,strict-match", "exact_match,none")


RECIPE_FILE = "recipe.yaml"
INSTALL = "moesq installed from its source (`pip install -e .` in a clone of its repository)"
TRANSFORMERS_LOADER = (f"with {INSTALL}, `import moesq_core`, then `transformers.AutoModelForCausalLM."
                       "from_pretrained(DIR)`: the same model as `load_packed` (moesq routes its packs through "
                       "transformers' loader):")
_HUB_DATASET = re.compile(r"([\w.-]+(?:/[\w.-]+)?)(?::[\w.-]+)?(?:@[\w.:%\[\]-]+)?")


def hub_id_of(source: str) -> str | None:
    """The Hub id a model came from: the source itself when it is an id, or read from a Hub cache path."""
    m = re.search(r"models--([^/]+?)--([^/]+)/snapshots/", source)
    if m:
        return f"{m.group(1)}/{m.group(2)}"
    if not Path(source).expanduser().exists() and _HUB_ID.match(source):
        return source
    return None


def _base_license(src: Path) -> str | None:
    from huggingface_hub import ModelCard

    readme = src / "README.md"
    if not readme.is_file():
        return None
    try:
        return ModelCard.load(readme).data.license
    except Exception:  # a base model card without front matter
        return None


def calib_source_label(source: str) -> str:
    """A calibration source as a card names it: a Hub dataset as given, a local file by its name only."""
    if Path(source).name == _EMBEDDED_CALIB and Path(source).parent.name == "assets":
        return f"moesq's embedded calibration sample ({_EMBEDDED_CALIB})"
    p = Path(source)
    return p.name if p.is_absolute() or p.exists() else source


def hub_dataset_of(source: str | None) -> str | None:
    """The Hub dataset id a calibration came from (`[org/]name[:config][@split]` as recorded), else None (a local
    file or dir is recorded by its absolute path, a `datasets.Dataset` by its fingerprint)."""
    if not source or Path(source).is_absolute() or Path(source).exists():
        return None
    m = _HUB_DATASET.fullmatch(source)
    return m.group(1) if m else None


def stage_recipe(identity: RunIdentity, stage: str, st: dict) -> dict:
    """The stage's configuration in a recipe's form (CompressConfig.from_dict loads it): the run's identity and
    the stage's method (`st`: its recorded config; refinement with its in-loop init), every option as recorded;
    a local calibration file by its name only (the embedded sample: null, as in a recipe)."""
    recipe = {"format": identity.format_name, "act_quant": identity.act_quant}
    source = identity.calib_source
    if source:
        embedded = calib_source_label(source) != Path(source).name
        recipe["calib_source"] = None if embedded else calib_source_label(source)  # null: embedded
    recipe["calib"] = dict(sorted(identity.calib.to_dict().items()))  # in the manifest's (sorted) key order
    if st.get("method") == "refine":
        refine = dict(st["refine"])
        # keys the stage identity leaves out where they are off (moesq_core.compression.config.refine_identity)
        refine.setdefault("e2e_steps", 0)
        refine.setdefault("init_split_rows", False)
        recipe["init"], recipe["refine"] = st["init"], dict(sorted(refine.items()))
    else:
        recipe["init"] = {"method": st.get("method", stage.removeprefix("init-")), "options": st.get("options", {})}
        recipe["refine"] = None
    return recipe


def work_dir_evals(workdir: Path, stage: str) -> dict:
    """What the work dir's evaluations measured for the reference and `stage`: {"ppl": [rows of
    eval/results.json], "tasks": {task: {"metric", label: value}}} (empty where nothing was evaluated)."""
    label = stage.removeprefix("init-")
    out: dict = {"ppl": [], "tasks": {}}
    path = Path(workdir) / "eval" / "results.json"
    try:
        rows = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        rows = {}
    out["ppl"] = sorted((r for r in rows.values() if isinstance(r, dict) and
                         (r.get("kind") == "reference" or (r.get("kind") == "stage" and r.get("stage") == stage))),
                        key=lambda r: (r.get("kind") != "reference", str(r.get("file")), r.get("tokens", 0)))
    for f in sorted((Path(workdir) / "eval" / "lm_eval").glob("*/*.json")):
        try:
            data = json.loads(f.read_text())
            who, metrics = data["key"]["label"], data["result"]["metrics"]
            task = data["result"]["task"]
        except (ValueError, KeyError, TypeError):
            continue
        if who not in ("reference", label):
            continue
        metric = next((m for m in _PRIMARY_METRICS if isinstance(metrics.get(m), (int, float))), None)
        if metric is not None:
            entry = out["tasks"].setdefault(task, {"metric": metric})
            if entry["metric"] == metric:
                entry["reference" if who == "reference" else "model"] = float(metrics[metric])
    return out


def _calibration_lines(identity: RunIdentity, cal: dict) -> list[str]:
    """`cal`: the manifest's calibration record (what was built); the run's calibration config where it is
    silent."""
    calib = identity.calib
    seq_len = cal.get("seq_len", calib.seq_len)
    seqs = cal.get("sequences") or {"train": calib.n_train, "val": calib.n_val, "init": calib.n_init}
    if not seq_len or not all(seqs.values()):
        return []
    n = sum(seqs.values())
    docs = f" cut from {cal['documents']:,} documents" if cal.get("documents") else ""
    return [f"- Calibration: {n:,} sequences × {seq_len:,} tokens ({n * seq_len:,} tokens{docs}) of "
            f"{calib_source_label(identity.calib_source or _EMBEDDED_CALIB)}: {seqs['train']:,} for refinement, "
            f"{seqs['val']:,} held out for its validation, {seqs['init']:,} for the one-shot init."]


def _eval_lines(evals: dict, stage: str) -> list[str]:
    lines = []
    ppl = evals.get("ppl") or []
    if ppl:
        ref = {(r.get("file"), r.get("tokens"), r.get("window")): r["ppl"] for r in ppl if r.get("kind") == "reference"}
        lines += ["", "### Perplexity", "", "| model | perplexity | × reference | text | tokens (window) |",
                  "|---|---|---|---|---|"]
        for r in ppl:
            base = ref.get((r.get("file"), r.get("tokens"), r.get("window")))
            ratio = f"{r['ppl'] / base:.3f}" if base and r.get("kind") != "reference" else ""
            who = "reference (base model)" if r.get("kind") == "reference" else f"this model ({stage})"
            lines.append(f"| {who} | {r['ppl']:.3f} | {ratio} | {Path(str(r.get('file'))).name} | "
                         f"{r.get('tokens', 0):,} ({r.get('window', '')}) |")
    tasks = evals.get("tasks") or {}
    if tasks:
        lines += ["", "### Tasks (lm-eval)", "", "| task | metric | reference | this model |", "|---|---|---|---|"]
        for task, e in sorted(tasks.items()):
            vals = [f"{e[k]:.4f}" if k in e else "" for k in ("reference", "model")]
            lines.append(f"| {task} | {e['metric'].split(',')[0]} | {vals[0]} | {vals[1]} |")
    if not lines:
        return []
    return ["", "## Evaluation", "", "Measured by moesq (`moesq eval`, `moesq run`) in the work dir this checkpoint "
            "was packed from (the stage's fake-quantized model computes exactly what this checkpoint serves)."] + lines


def recipe_yaml(identity: RunIdentity, manifest: dict, stage: str) -> str | None:
    """The pack's recipe.yaml: the stage's configuration as a recipe (stage_recipe; CompressConfig.from_file
    loads it), None when the manifest records no configuration for the stage."""
    stage_config = manifest.get("stages", {}).get(stage, {}).get("config")
    if not stage_config:
        return None
    body = yaml.safe_dump(stage_recipe(identity, stage, stage_config), sort_keys=False, default_flow_style=None,
                          width=100)
    return (f"# The moesq configuration that made this checkpoint (stage {stage}): a recipe, loaded by\n"
            "# moesq_core.CompressConfig.from_file; `moesq run --recipe recipe.yaml --model BASE_MODEL` runs it.\n"
            + body)


def model_card(identity: RunIdentity, manifest: dict, summary: dict, evals: dict | None = None) -> str:
    """README.md with Hub front matter (huggingface_hub.ModelCardData); reproducible (no dates). `identity` is
    the work dir's run (its base model's license is read from `identity.model_path`), `manifest` the work dir's
    (its calibration and stage records), `summary` the pack's (export_packed), `evals` work_dir_evals' (None:
    none)."""
    from huggingface_hub import ModelCard, ModelCardData

    source, src = identity.model_source, identity.model_path
    hub_id = hub_id_of(source) or hub_id_of(str(src))
    fmt = identity.format
    stage = summary["stage"]
    calib_dataset = hub_dataset_of(identity.calib_source)
    data = ModelCardData(license=_base_license(src), pipeline_tag="text-generation", library_name="moesq",
                         base_model=hub_id, base_model_relation="quantized" if hub_id else None,
                         datasets=[calib_dataset] if calib_dataset else None,
                         tags=["moesq", "moe", "quantized", *fmt.card_tags])
    name = hub_id or Path(source).name
    activations = f"quantized ({fmt.act_label})" if summary["act_quant"] else "not quantized (weights only)"
    lines = [
        f"# {name.split('/')[-1]} — moesq {fmt.name}", "",
        f"The routed experts of {'`' + hub_id + '`' if hub_id else 'the base model'} compressed by moesq "
        f"{__version__}; every other weight is unchanged.", "",
        "| | |", "|---|---|",
        f"| base model | `{hub_id or Path(source).name}` |",
        f"| method | {summary['method']} |",
        f"| format | {fmt.name} ({fmt.description}) |",
        f"| activations | {activations} |",
        f"| expert bits per weight | {summary['bits_per_weight']:.3f} |",
        f"| expert weights | {summary['expert_weights']:,} in {summary['expert_bytes']:,} bytes |",
        "", "## How it was made", "",
        f"- moesq {__version__}, stage `{stage}` of its work dir, packed by `moesq pack`.",
        *_calibration_lines(identity, manifest.get("calibration") or {}),
    ]
    recipe = recipe_yaml(identity, manifest, stage)
    if recipe:
        lines += [f"- The configuration, as a recipe ([`{RECIPE_FILE}`]({RECIPE_FILE}) in this repository; "
                  f"`moesq run --recipe {RECIPE_FILE} --model BASE_MODEL` runs it):", "",
                  "```yaml", recipe.rstrip(), "```"]
    lines += _eval_lines(evals or {}, stage)
    lines += ["", "## Loading and serving", "",
              f"With {INSTALL}, in Python (`DIR`: a local copy of this repository, e.g. from "
              "`huggingface_hub.snapshot_download`):", "",
              "```python", "from moesq_core import load_packed", "",
              'model, tokenizer = load_packed("DIR")  # device="cuda": on the GPU', "```",
              "", f"or, {TRANSFORMERS_LOADER}", "", "```python", "import moesq_core  # routes moesq packs through "
              "transformers' compressed-tensors entries", "from transformers import AutoModelForCausalLM", "",
              'model = AutoModelForCausalLM.from_pretrained("DIR")', "```",
              "", "or from the command line:", "",
              "```bash", 'moesq generate DIR --prompt "The capital of France is"', "moesq verify DIR", "```", "",
              *[f"- {x}" for x in fmt.card_loader_lines(summary.get("layout"))], "",
              "`moesq verify DIR` checks every file against the checksums in `moesq_pack.json` and every packed "
              "expert tensor's structure.", ""]
    return str(ModelCard.from_template(data, template_str="---\n{{ card_data }}\n---\n\n" + "\n".join(lines)))
