"""`moesq pack`: a work dir stage -> a Hugging Face–style model directory.

config.json gets the format's `quantization_config` (`Format.quantization_config`: compressed-tensors' part
built with its own classes, `quantization_status: "compressed"`, the ignore list, plus a `moesq` entry and
the format's markers, e.g. sparse p48's `paired48_sparse`). Routed experts are stored per expert in the
format's packed layout with what its activation quantizer stores (NVFP4: a calibrated, always finite and
positive `input_global_scale`); everything else is copied untouched from the source checkpoint. Weights are
sharded by size (`max_shard_bytes`) with a `model.safetensors.index.json` when there is more than one shard.

Safety: the output is validated before anything is written (never the work dir or the source model, never a
directory holding anything but an earlier moesq pack); the pack is built in a temp dir beside the output and
renamed into place, an earlier pack being removed only after the new one is complete. Every file is listed
with its sha256 (and each tensor's) in `moesq_pack.json`, which `moesq verify` checks. The output is
byte-deterministic: the same stage gives the same bytes (no timestamps, fixed ordering).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .. import __version__
from ..engine import load_block
from ..formats import get_format
from ..formats.quantizers import input_global_scales
from ..naming import INDEX_FILE, SINGLE_FILE, expert_linear, experts_prefix
from ..workdir import WorkDir, WorkDirError, disk_errors
from .checksums import MANIFEST, is_moesq_pack, write_manifest

# Files carried over from the source model besides the weights; remote-code *.py and *.jinja templates too.
CARRIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                 "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja", "chat_template.json",
                 "preprocessor_config.json", "tiktoken.model", "added_tokens.json")
CARRIED_PATTERNS = ("*.py", "*.jinja")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # the Hub's customary 5 GB shards
LARGE_UPLOAD_BYTES = 20 * 10**9  # above this, push with upload_large_folder (resumable, chunked commits)
PACKED_SLOT = "packed"  # the work dir's own pack location (WORKDIR/packed), the default --out


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB or 2GiB")
    unit = m.group(2).upper()
    power = "KMGT".find(unit) + 1 if unit else 0
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


def quantization_config(fmt_name: str, ignore: list[str], act_quant: bool, sparse_layout: bool) -> dict:
    """The config.json `quantization_config` of a pack in format `fmt_name` (see Format.quantization_config)."""
    moesq = {"format": fmt_name, "version": 1, "act_quant": act_quant, "moesq_version": __version__}
    return get_format(fmt_name).quantization_config(list(ignore), act_quant, sparse_layout, moesq)


def _source_tensors(src: Path):
    """Yield (name, tensor) of every tensor in the source checkpoint, file by file, in stored order."""
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src}: no .safetensors weights to copy the non-expert tensors from")
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                yield k, sf.get_tensor(k)


class _ShardWriter:
    """Collects tensors in order and writes a shard whenever the next tensor would pass max_bytes."""

    def __init__(self, out: Path, max_bytes: int):
        self.out, self.max, self.cur, self.cur_bytes, self.shards = out, max_bytes, {}, 0, []

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.cur and self.cur_bytes + nbytes > self.max:
            self.flush()
        self.cur[name] = t.contiguous()
        self.cur_bytes += nbytes

    def flush(self) -> None:
        if self.cur:
            self.shards.append({k: (tuple(t.shape), t.numel() * t.element_size()) for k, t in self.cur.items()})
            save_file(self.cur, str(self.out / f".shard{len(self.shards)}.tmp"), metadata={"format": "pt"})
            self.cur, self.cur_bytes = {}, 0

    def finish(self) -> dict:
        self.flush()
        n = len(self.shards)
        weight_map, total = {}, 0
        for i, shard in enumerate(self.shards, 1):
            name = SINGLE_FILE if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
            (self.out / f".shard{i}.tmp").rename(self.out / name)
            for k, (_, nbytes) in shard.items():
                weight_map[k] = name
                total += nbytes
        if n > 1:
            (self.out / INDEX_FILE).write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
        return {"shards": n, "bytes": total}


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def check_output_dir(out_dir: Path, workdir_root: Path, source: Path | None, overwrite: bool) -> None:
    """Refuse an --out that would lose data, before anything is written (ValueError / FileExistsError)."""
    out = Path(out_dir).expanduser().resolve()
    wd = Path(workdir_root).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out_dir} is an existing file, not a directory; choose a directory path")
    if any(p.exists() and not p.is_dir() for p in out.parents):
        raise FileExistsError(f"--out {out_dir}: a parent of it is a file, not a directory")
    if out == wd or wd in out.parents and out != wd / PACKED_SLOT:
        where = "is the work dir" if out == wd else "is inside the work dir"
        raise ValueError(f"--out {out_dir} {where} {workdir_root}, whose artifacts it could replace; "
                         f"choose a directory outside it (or leave --out out to use {Path(workdir_root) / PACKED_SLOT})")
    if _inside(wd, out):
        raise ValueError(f"--out {out_dir} contains the work dir {workdir_root}; choose another directory")
    if source is not None:
        src = Path(source).expanduser().resolve()
        if _inside(out, src) or _inside(src, out):
            raise ValueError(f"--out {out_dir} is or overlaps the source model {source}; choose another directory")
    if out.is_dir() and any(out.iterdir()):
        if not is_moesq_pack(out):
            raise FileExistsError(f"--out {out_dir} holds files that are not a moesq pack (no {MANIFEST}, or files it "
                                  "does not list); moesq only replaces its own packs: choose another --out")
        if not overwrite:
            raise FileExistsError(f"--out {out_dir} holds an earlier moesq pack; pass --overwrite to replace it "
                                  "or choose another --out")


def _fix_modes(root: Path) -> None:
    """Like any model directory: 0755 dirs, 0644 files (temp dirs are created 0700, copies keep odd modes)."""
    os.chmod(root, 0o755)
    for p in root.rglob("*"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)


def export_packed(workdir: WorkDir, stage: str, out_dir: Path, **options) -> dict:
    """Write the packed model directory; returns a summary (bits/weight, sizes, files). A disk that is full or
    read-only raises DiskWriteError naming --out."""
    with disk_errors(Path(out_dir)):
        return _export_packed(workdir, stage, out_dir, **options)


def _export_packed(workdir: WorkDir, stage: str, out_dir: Path, *, overwrite: bool = False, sparse_layout: bool = True,
                   max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, ppl: dict | None = None, progress=None) -> dict:
    m = workdir.load()
    st = m["stages"].get(stage)
    if st is None or not st.get("done"):
        have = ", ".join(k for k, v in m["stages"].items() if v.get("done")) or "none"
        raise WorkDirError(f"stage {stage!r} is not finished in {workdir.root} (finished stages: {have})")
    if max_shard_bytes <= 0:
        raise ValueError(f"--max-shard-size must be positive, got {max_shard_bytes} bytes")
    fmt_name = m["config"]["format"]
    fmt = get_format(fmt_name)
    act_quant = m["config"].get("act_quant", True)
    src = Path(m["model"]["path"])
    out_dir = Path(out_dir)
    check_output_dir(out_dir, workdir.root, src, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):  # left by an interrupted pack
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    old = None
    try:
        writer = _ShardWriter(tmp, max_shard_bytes)
        blocks = sorted(int(k) for k in st["blocks"])
        packed_prefixes = {experts_prefix(li) for li in blocks}
        ignore = set()
        for name, t in _source_tensors(src):
            if any(name.startswith(p + ".") for p in packed_prefixes):
                continue  # routed experts are written packed below
            writer.add(name, t)
            if name.endswith(".weight") and t.dim() == 2:
                ignore.add(name[: -len(".weight")])
        if not any(n.startswith("lm_head") for n in ignore):
            ignore.add("lm_head")
        packed_bytes, n_weights, fallbacks = 0, 0, 0
        layout = fmt.export_layout(sparse_layout)
        for li in blocks:
            results, amax_in, amax_mid = load_block(workdir.verified_block(stage, li))
            g_in, n_in = input_global_scales(amax_in)
            g_mid, n_mid = input_global_scales(amax_mid)
            fallbacks += n_in + n_mid
            for e, r in enumerate(results):
                for proj, qw in r.weights().items():
                    name = expert_linear(experts_prefix(li), e, proj)
                    tensors = layout.pack(qw)
                    packed_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
                    n_weights += qw.codes.numel()
                    g = g_in if proj != "down" else g_mid
                    tensors.update(fmt.act.packed_tensors(g[e] if g is not None else None))
                    for suffix, t in tensors.items():
                        writer.add(f"{name}.{suffix}", t)
            if progress:
                progress(1)
        shards = writer.finish()
        config = json.loads((src / "config.json").read_text())
        config["quantization_config"] = quantization_config(fmt_name, sorted(ignore), act_quant, sparse_layout)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        carried = sorted({f for f in CARRIED_FILES if (src / f).is_file()}
                         | {p.name for pat in CARRIED_PATTERNS for p in src.glob(pat) if p.is_file()})
        for f in carried:
            shutil.copyfile(src / f, tmp / f)
        summary = {"format": fmt_name, "stage": stage, "method": st["config"].get("method", stage),
                   "act_quant": act_quant, "bits_per_weight": 8 * packed_bytes / max(1, n_weights),
                   "expert_weights": n_weights, "expert_bytes": packed_bytes,
                   "input_scale_fallbacks": fallbacks, "moesq_version": __version__, **shards}
        (tmp / "README.md").write_text(model_card(m, src, summary, ppl))
        _fix_modes(tmp)
        manifest = write_manifest(tmp, summary)
        os.chmod(tmp / MANIFEST, 0o644)
        summary["files"] = sorted([*manifest["files"], MANIFEST])
        if out_dir.exists():
            # keep the earlier pack until the new one is in place; re-check it is still only a moesq pack
            check_output_dir(out_dir, workdir.root, src, overwrite)
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            out_dir.rename(old / "pack")
        tmp.rename(out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
            old = None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and (old / "pack").exists() and not out_dir.exists():
            (old / "pack").rename(out_dir)  # the swap failed half-way: put the earlier pack back
            shutil.rmtree(old, ignore_errors=True)
    summary["path"] = str(out_dir)
    return summary


# -- model card ---------------------------------------------------------------------------------------------
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
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


def model_card(manifest: dict, src: Path, summary: dict, ppl: dict | None) -> str:
    """README.md with Hub front matter (huggingface_hub.ModelCardData); reproducible (no dates)."""
    from huggingface_hub import ModelCard, ModelCardData

    source = manifest["model"]["source"]
    hub_id = hub_id_of(source) or hub_id_of(str(src))
    fmt = get_format(summary["format"])
    data = ModelCardData(license=_base_license(src), pipeline_tag="text-generation", base_model=hub_id,
                         base_model_relation="quantized" if hub_id else None,
                         tags=["moesq", "moe", *fmt.card_tags])
    name = hub_id or Path(source).name
    lines = [
        f"# {name.split('/')[-1]} — moesq {fmt.name}", "",
        f"The routed experts of {'`' + hub_id + '`' if hub_id else 'the base model'} compressed by moesq "
        f"{__version__}; every other weight is unchanged.", "",
        "| | |", "|---|---|",
        f"| base model | `{hub_id or Path(source).name}` |",
        f"| method | {summary['method']} |",
        f"| format | {fmt.name} ({fmt.description}) |",
        f"| activations | {'quantized (' + fmt.act_label + ')' if summary['act_quant'] else 'not quantized (weights only)'} |",
        f"| expert bits per weight | {summary['bits_per_weight']:.3f} |",
        f"| expert weights | {summary['expert_weights']:,} in {summary['expert_bytes']:,} bytes |",
    ]
    if ppl:
        lines += ["", "## Measured perplexity", "", "| model | perplexity |", "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in sorted(ppl.items())]
    lines += ["", "## Loading", "", *[f"- {x}" for x in fmt.card_loaders], "",
              "`moesq verify DIR` checks every file against the checksums in `moesq_pack.json` and every packed "
              "expert tensor's structure.", ""]
    return str(ModelCard.from_template(data, template_str="---\n{{ card_data }}\n---\n\n" + "\n".join(lines)))


# -- Hub ----------------------------------------------------------------------------------------------------
def default_repo_name(model_source: str, fmt: str) -> str:
    """The repo name `--push-to-hub` without a value uses (under the logged-in user): <model>-moesq-<format>."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(model_source).rstrip("/")).name).strip("-.") or "model"
    return f"{name}-moesq-{fmt}"


def push_to_hub(out_dir: Path, repo_id: str | None, private: bool = False, token: str | None = None,
                default_name: str | None = None) -> dict:
    """Upload a packed directory, creating the repo if missing; --private is applied to an existing repo too.
    Large packs go through upload_large_folder. With no repo_id the repo is <logged-in user>/<default_name>.
    Errors say what to do; the local dir is never touched."""
    from huggingface_hub import HfApi

    out_dir = Path(out_dir)
    size = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
    try:
        api = HfApi(token=token)
        if repo_id is None:
            repo_id = f"{api.whoami()['name']}/{default_name or out_dir.name}"
        url = str(api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model"))
        notes = []
        if private:
            info = api.model_info(repo_id)
            if not getattr(info, "private", False):
                api.update_repo_settings(repo_id, private=True, repo_type="model")
                notes.append("the existing repo was made private")
        if size > LARGE_UPLOAD_BYTES:
            api.upload_large_folder(repo_id=repo_id, folder_path=str(out_dir), repo_type="model")
            commit = url
        else:
            info = api.upload_folder(folder_path=str(out_dir), repo_id=repo_id, repo_type="model", commit_message="moesq pack")
            commit = str(getattr(info, "commit_url", url))
        return {"repo": repo_id, "url": commit, "private": private, "bytes": size, "notes": notes}
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RuntimeError(
            f"--push-to-hub {repo_id or '(your user)/' + str(default_name)}: upload failed ({type(e).__name__}: {msg}). The packed model is intact in "
            f"{out_dir}; check your network and `hf auth login` / HF_TOKEN, then push again."
        ) from None
