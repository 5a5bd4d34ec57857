"""`moesq pack`: a work dir stage -> a Hugging Face–style model directory.

config.json gets a compressed-tensors–style `quantization_config` (format, group size, ignore list, the
release's `paired48_sparse` marker for sparse p48, and a `moesq` entry); routed experts are stored per expert
in the format's packed layout (moesq_core.packing) with a calibrated `input_global_scale`; everything else is
copied untouched from the source checkpoint at its source precision. The directory is built under a temp name
and renamed into place, so an interrupted pack leaves nothing half-written.
"""
from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .. import __version__
from ..engine import load_block
from ..formats import get_format
from ..runtime.experts import act_global_from_amax
from ..packing import pack
from ..packing.p48 import MARKER, MARKER_KEY
from ..workdir import WorkDir, WorkDirError

PROJ_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")


def quantization_config(fmt_name: str, ignore: list[str], act_quant: bool, sparse_layout: bool) -> dict:
    fmt = get_format(fmt_name)
    nv = fmt_name.endswith("nvfp4")
    qc = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized" if nv else "float-quantized",
        "group_size": fmt.scale_block if nv else None,
        "ignore": ignore,
        "config_groups": {"group_0": {
            "targets": ["re:.*mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$"],
            "weights": {"num_bits": 4 if nv else 8, "type": "float", "symmetric": True, "dynamic": False,
                        "strategy": "tensor_group" if nv else "channel", "group_size": fmt.scale_block if nv else None},
            "input_activations": None if not act_quant else {
                "num_bits": 4 if nv else 8, "type": "float", "symmetric": True, "dynamic": "local" if nv else True,
                "strategy": "tensor_group" if nv else "token", "group_size": fmt.act.block if nv else None},
        }},
        "moesq": {"format": fmt_name, "version": 1, "act_quant": act_quant, "moesq_version": __version__},
    }
    if sparse_layout and fmt_name == "p48-nvfp4":
        qc[MARKER_KEY] = dict(MARKER)
    return qc


def _source_tensors(src: Path):
    """Yield (name, tensor) of every tensor in the source checkpoint, file by file."""
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src}: no .safetensors weights to copy the non-expert tensors from")
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                yield k, sf.get_tensor(k)


class _ShardWriter:
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
            self.shards.append(self.cur)
            path = self.out / f".shard{len(self.shards)}.tmp"
            save_file(self.cur, str(path), metadata={"format": "pt"})
            self.cur, self.cur_bytes = {}, 0

    def finish(self) -> dict:
        self.flush()
        n = len(self.shards)
        weight_map, total = {}, 0
        for i, shard in enumerate(self.shards, 1):
            name = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
            (self.out / f".shard{i}.tmp").rename(self.out / name)
            for k, t in shard.items():
                weight_map[k] = name
                total += t.numel() * t.element_size()
        if n > 1:
            (self.out / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
        return {"shards": n, "bytes": total}


def export_packed(workdir: WorkDir, stage: str, out_dir: Path, *, overwrite: bool = False, sparse_layout: bool = True,
                  max_shard_bytes: int = 2 << 30, ppl: dict | None = None, progress=None) -> dict:
    """Write the packed model directory; returns a summary (bits/weight, sizes)."""
    m = workdir.load()
    st = m["stages"].get(stage)
    if st is None or not st.get("done"):
        have = ", ".join(k for k, v in m["stages"].items() if v.get("done")) or "none"
        raise WorkDirError(f"stage {stage!r} is not finished in {workdir.root} (finished stages: {have})")
    fmt_name = m["config"]["format"]
    act_quant = m["config"].get("act_quant", True)
    src = Path(m["model"]["path"])
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out_dir} exists and is not empty; pass --overwrite or choose another --out")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        writer = _ShardWriter(tmp, max_shard_bytes)
        blocks = sorted(int(k) for k in st["blocks"])
        moe_layers = set(blocks)
        ignore = set()
        for name, t in _source_tensors(src):
            mm = _EXPERT_KEY.match(name)
            if mm and int(mm.group(1)) in moe_layers:
                continue  # routed experts are written packed below
            writer.add(name, t)
            if name.endswith(".weight") and t.dim() == 2:
                ignore.add(name[: -len(".weight")])
        if not any(n.startswith("lm_head") for n in ignore):
            ignore.add("lm_head")
        packed_bytes, n_weights = 0, 0
        nv = fmt_name.endswith("nvfp4")
        layout = None if sparse_layout or fmt_name != "p48-nvfp4" else "dense-p48"
        for li in blocks:
            results, amax_in, amax_mid = load_block(workdir.verified_block(stage, li))
            g_in, g_mid = act_global_from_amax(amax_in), act_global_from_amax(amax_mid)
            for e, r in enumerate(results):
                for proj, qw in r.weights().items():
                    name = f"model.layers.{li}.mlp.experts.{e}.{PROJ_NAMES[proj]}"
                    tensors = pack(qw, layout)
                    packed_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
                    n_weights += qw.codes.numel()
                    if nv:
                        # calibrated static activation global scale (0 = dynamic: no token reached it)
                        tensors["input_global_scale"] = (g_in[e] if proj != "down" else g_mid[e]).reshape(1).clone()
                    for suffix, t in tensors.items():
                        writer.add(f"{name}.{suffix}", t)
            if progress:
                progress(1)
        shards = writer.finish()
        config = json.loads((src / "config.json").read_text())
        config["quantization_config"] = quantization_config(fmt_name, sorted(ignore), act_quant, sparse_layout)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in TOKENIZER_FILES:
            if (src / f).is_file():
                shutil.copy2(src / f, tmp / f)
        summary = {"format": fmt_name, "stage": stage, "method": st["config"].get("method", stage),
                   "bits_per_weight": 8 * packed_bytes / max(1, n_weights), "expert_weights": n_weights,
                   "expert_bytes": packed_bytes, **shards}
        (tmp / "README.md").write_text(model_card(m, summary, ppl))
        (tmp / "moesq_pack.json").write_text(json.dumps(summary, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return summary


def model_card(manifest: dict, summary: dict, ppl: dict | None) -> str:
    src = manifest["model"]["source"]
    lines = [
        "---", "library_name: transformers", "tags: [moesq, moe, nvfp4, sparse, compressed-tensors]",
        f"base_model: {src}", "---", "",
        f"# {Path(src).name} — moesq {summary['format']}", "",
        f"Routed experts of `{src}` compressed by [moesq](https://github.com/) {__version__}.", "",
        "| | |", "|---|---|",
        f"| base model | `{src}` |",
        f"| method | {summary['method']} |",
        f"| format | {summary['format']} ({get_format(summary['format']).description}) |",
        f"| expert bits per weight | {summary['bits_per_weight']:.3f} |",
        f"| expert weights | {summary['expert_weights']:,} in {summary['expert_bytes']:,} bytes |",
        f"| packed | {time.strftime('%Y-%m-%d')} |",
    ]
    if ppl:
        lines += ["", "## Measured perplexity", "", "| model | perplexity |", "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in ppl.items()]
    lines += ["", "Load with `moesq_core.checkpoint.loader.load_packed(path)`; check with `moesq verify DIR`.", ""]
    return "\n".join(lines)


def push_to_hub(out_dir: Path, repo_id: str, private: bool = False, token: str | None = None) -> str:
    """Upload a packed directory, creating the repo if missing. Errors say what to do; the local dir stays."""
    from huggingface_hub import HfApi

    try:
        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(folder_path=str(out_dir), repo_id=repo_id, repo_type="model",
                                 commit_message="moesq pack")
        return str(getattr(info, "commit_url", repo_id))
    except Exception as e:
        raise RuntimeError(
            f"push to {repo_id!r} failed ({type(e).__name__}: {e}). The packed model is intact in {out_dir}; "
            "check your network and `huggingface-cli login` / HF_TOKEN, then push again."
        ) from None
