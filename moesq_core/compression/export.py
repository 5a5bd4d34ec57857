"""`moesq pack`: a work dir stage -> a Hugging Face–style model directory.

config.json gets the format's `quantization_config` (`Format.quantization_config`: compressed-tensors' part
built with its own classes, `quantization_status: "compressed"`, the ignore list, plus a `moesq` entry and
the format's markers, e.g. sparse p48's `paired48_sparse`). Routed experts are stored per expert in the
format's packed layout with what its activation quantizer stores (NVFP4: a calibrated, always finite and
positive `input_global_scale`); everything else is copied untouched from the source checkpoint. Weights are
sharded by size (`max_shard_bytes`) with a `model.safetensors.index.json` when there is more than one shard.

Safety: the output is validated before anything is written (never the work dir or the source model, never a
directory holding anything but an earlier moesq pack); the pack is built in a temp dir beside the output and
renamed into place, an earlier pack being removed only after the new one is complete. The work dir's lock and
a lock on the output are held throughout; temp dirs a killed pack left are removed only when their marker
proves moesq made them and their process has ended (compression/pack_swap.py). Every file is listed
with its sha256 (and each tensor's) in `moesq_pack.json`, which `moesq verify` checks. The output is
byte-deterministic: the same stage gives the same bytes (no timestamps, fixed ordering).
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shutil
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from moesq_core.checkpoint.checksums import PACK_MANIFEST, is_moesq_pack, write_manifest
from moesq_core.checkpoint.model_card import RECIPE_FILE, model_card, recipe_yaml, work_dir_evals
from moesq_core.compression.engine import load_block
from moesq_core.compression.pack_swap import PACKED_SLOT, out_locked, owned_dir, real_out, remove_stale
from moesq_core.compression.workdir import (
    RunIdentity,
    StageLedger,
    WorkDir,
    WorkDirError,
    disk_errors,
)
from moesq_core.formats import get_format
from moesq_core.formats.quantizers import input_global_scales
from moesq_core.memory import release_freed_memory
from moesq_core.naming import CARRIED_FILES, CARRIED_PATTERNS, INDEX_FILE, SINGLE_FILE, expert_linear, experts_prefix
from moesq_core.version import __version__

log = logging.getLogger(__name__)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # the Hub's customary 5 GB shards
LARGE_UPLOAD_BYTES = 20 * 10**9  # above this, push with upload_large_folder (resumable, chunked commits)


def quantization_config(fmt_name: str, ignore: list[str], act_quant: bool, sparse_layout: bool) -> dict:
    """The config.json `quantization_config` of a pack in format `fmt_name` (see Format.quantization_config)."""
    moesq = {"format": fmt_name, "version": 1, "act_quant": act_quant, "moesq_version": __version__}
    return get_format(fmt_name).quantization_config(list(ignore), act_quant, sparse_layout, moesq)


def _source_tensors(src: Path, skip=lambda name: False):
    """Yield (name, tensor) of every tensor in the source checkpoint but those `skip(name)` names (never read),
    file by file, in stored order."""
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src}: no .safetensors weights to copy the non-expert tensors from")
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                if not skip(k):
                    yield k, sf.get_tensor(k)


class _ShardWriter:
    """Collects tensors in order and writes a shard whenever the next tensor would pass max_bytes.

    A shard's tensors go to a spill file beside it as they come, so host memory holds one tensor rather than
    a shard (5 GB by default); at the shard's end its file is written as safetensors' save_file writes it,
    byte for byte: the header (tensors ordered by safetensors' dtype order, then by name; compact JSON padded
    with spaces to 8 bytes) and the tensors' bytes in that order, copied from the spill."""

    COPY_BYTES = 64 << 20

    def __init__(self, out: Path, max_bytes: int):
        self.out, self.max, self.cur, self.cur_bytes, self.shards = out, max_bytes, {}, 0, []
        self.spill = None

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.cur and self.cur_bytes + nbytes > self.max:
            self.flush()
        if self.spill is None:
            self.spill = open(self.out / f".shard{len(self.shards) + 1}.spill", "w+b")
        self.cur[name] = (t.dtype, tuple(t.shape), self.spill.tell(), nbytes)
        self.spill.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
        self.cur_bytes += nbytes

    def flush(self) -> None:
        if not self.cur:
            return
        rank, dtype_name = _safetensors_dtypes(tuple(sorted({d for d, *_ in self.cur.values()}, key=str)))
        order = sorted(self.cur, key=lambda k: (rank[self.cur[k][0]], k))
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for k in order:
            dtype, shape, _, nbytes = self.cur[k]
            header[k] = {"dtype": dtype_name[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        raw += b" " * (-len(raw) % 8)
        self.spill.flush()
        spill = self.spill.fileno()
        with open(self.out / f".shard{len(self.shards) + 1}.tmp", "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for k in order:
                _, _, at, nbytes = self.cur[k]
                for lo in range(at, at + nbytes, self.COPY_BYTES):
                    f.write(os.pread(spill, min(self.COPY_BYTES, at + nbytes - lo), lo))
        self.spill.close()
        os.unlink(self.spill.name)
        self.spill = None
        self.shards.append({k: (shape, nbytes) for k, (_, shape, _, nbytes) in self.cur.items()})
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


@functools.cache
def _safetensors_dtypes(dtypes: tuple) -> tuple[dict, dict]:
    """({dtype: its place in a safetensors file}, {dtype: its name there}), asked of safetensors itself: the
    order of one one-element tensor of each dtype in the header of what it saves."""
    from safetensors.torch import save

    raw = save({str(i): torch.zeros(1, dtype=d) for i, d in enumerate(dtypes)})
    header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    keys = [k for k in header if k != "__metadata__"]
    return ({dtypes[int(k)]: i for i, k in enumerate(keys)}, {dtypes[int(k)]: header[k]["dtype"] for k in keys})


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
                         "choose a directory outside it "
                         f"(or leave --out out to use {Path(workdir_root) / PACKED_SLOT})")
    if _inside(wd, out):
        raise ValueError(f"--out {out_dir} contains the work dir {workdir_root}; choose another directory")
    if source is not None:
        src = Path(source).expanduser().resolve()
        if _inside(out, src) or _inside(src, out):
            raise ValueError(f"--out {out_dir} is or overlaps the source model {source}; choose another directory")
    if out.is_dir() and any(out.iterdir()):
        if not is_moesq_pack(out):
            raise FileExistsError(f"--out {out_dir} holds files that are not a moesq pack (no {PACK_MANIFEST}, "
                                  "or files it does not list); moesq only replaces its own packs: choose another --out")
        if not overwrite:
            raise FileExistsError(f"--out {out_dir} holds an earlier moesq pack; pass --overwrite to replace it "
                                  "or choose another --out")


def _fix_modes(root: Path) -> None:
    """Like any model directory: 0755 dirs, 0644 files (temp dirs are created 0700, copies keep odd modes)."""
    os.chmod(root, 0o755)
    for p in root.rglob("*"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)


def _add_packed_block(writer: _ShardWriter, path: Path, li: int, fmt, layout) -> tuple[int, int, int]:
    """Block li's experts from its artifact at `path`, packed in the pack's layout with their activation
    tensors, added to `writer` expert by expert; (packed weight bytes, weights, input-scale fallbacks)."""
    results, amax_in, amax_mid = load_block(path)
    g_in, n_in = input_global_scales(amax_in)
    g_mid, n_mid = input_global_scales(amax_mid)
    packed_bytes = n_weights = 0
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
    return packed_bytes, n_weights, n_in + n_mid


def export_packed(workdir: WorkDir, stage: str, out_dir: Path, *, overwrite: bool = False, sparse_layout: bool = True,
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress=None) -> dict:
    """Write the packed model directory; returns a summary (bits/weight, sizes, files). Its model card
    (model_card.py) carries the work dir's evaluation results for the stage, where there are any. Holds the work
    dir's lock (unless the work dir is read-only) and --out's lock throughout: another command writing the work
    dir, or another pack into --out, refuses. A disk that is full or read-only raises DiskWriteError naming --out."""
    workdir.load()  # not a work dir: say so before the lock creates anything
    with contextlib.ExitStack() as held:
        if os.access(workdir.root, os.W_OK):
            held.enter_context(workdir.locked())
        else:  # a read-only work dir (a read-only mount): no process can change it while it is packed
            log.info("%s is read-only: packing it without its lock", workdir.root)
        m = workdir.load()
        st = m["stages"].get(stage)
        if st is None or not st.get("done"):
            have = ", ".join(k for k, v in m["stages"].items() if v.get("done")) or "none"
            raise WorkDirError(f"stage {stage!r} is not finished in {workdir.root} (finished stages: {have})")
        identity = RunIdentity.from_manifest(m, workdir.manifest_path)
        with disk_errors(Path(out_dir)):
            return _export_packed(workdir.ledger(stage), identity, m, Path(out_dir), held, overwrite=overwrite,
                                  sparse_layout=sparse_layout, max_shard_bytes=max_shard_bytes, progress=progress)


def _export_packed(ledger: StageLedger, identity: RunIdentity, manifest: dict, out_dir: Path,
                   held: contextlib.ExitStack, *, overwrite: bool, sparse_layout: bool, max_shard_bytes: int,
                   progress) -> dict:
    """The pack of a finished stage (`ledger`'s), with the work dir's lock held; `manifest` is the work dir's,
    for the model card."""
    st = ledger.record()
    if max_shard_bytes <= 0:
        raise ValueError(f"--max-shard-size must be positive, got {max_shard_bytes} bytes")
    fmt, act_quant, src = identity.format, identity.act_quant, identity.model_path
    given, root, stage = Path(out_dir), ledger.root, ledger.name
    check_output_dir(given, root, src, overwrite)
    out_dir = real_out(given)  # a symlink's target: locked and replaced, the link stays
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    held.enter_context(out_locked(out_dir))
    remove_stale(out_dir)
    check_output_dir(given, root, src, overwrite)  # an earlier pack may have been put back
    work = owned_dir(out_dir.parent, f".{out_dir.name}.tmp-")
    tmp = work / "pack"  # built here, then renamed to out_dir
    tmp.mkdir()
    old = None
    try:
        writer = _ShardWriter(tmp, max_shard_bytes)
        blocks = sorted(int(k) for k in st["blocks"])
        packed_prefixes = {experts_prefix(li) for li in blocks}
        ignore = set()
        # routed experts are written packed below (and not read: a model's worth of reads through the heap)
        for name, t in _source_tensors(src, skip=lambda name: any(name.startswith(p + ".") for p in packed_prefixes)):
            writer.add(name, t)
            if name.endswith(".weight") and t.dim() == 2:
                ignore.add(name[: -len(".weight")])
        if not any(n.startswith("lm_head") for n in ignore):
            ignore.add("lm_head")
        packed_bytes, n_weights, fallbacks = 0, 0, 0
        layout = fmt.export_layout(sparse_layout)
        for li in blocks:
            nbytes, nw, nf = _add_packed_block(writer, ledger.verified_block(li), li, fmt, layout)
            packed_bytes, n_weights, fallbacks = packed_bytes + nbytes, n_weights + nw, fallbacks + nf
            release_freed_memory()  # the block's unpacked experts (freed on return), back to the system
            if progress:
                progress(1)
        shards = writer.finish()
        config = json.loads((src / "config.json").read_text())
        config["quantization_config"] = quantization_config(identity.format_name, sorted(ignore), act_quant,
                                                            sparse_layout)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        carried = sorted({f for f in CARRIED_FILES if (src / f).is_file()}
                         | {p.relative_to(src).as_posix() for pat in CARRIED_PATTERNS for p in src.glob(pat)
                            if p.is_file()})
        for f in carried:
            (tmp / f).parent.mkdir(exist_ok=True)
            shutil.copyfile(src / f, tmp / f)
        summary = {"format": identity.format_name, "layout": layout.name, "stage": stage,
                   "method": st["config"].get("method", stage), "act_quant": act_quant,
                   "bits_per_weight": 8 * packed_bytes / max(1, n_weights), "expert_weights": n_weights,
                   "expert_bytes": packed_bytes,
                   "input_scale_fallbacks": fallbacks, "moesq_version": __version__, **shards}
        (tmp / "README.md").write_text(model_card(identity, manifest, summary, work_dir_evals(root, stage)))
        recipe = recipe_yaml(identity, manifest, stage)
        if recipe:
            (tmp / RECIPE_FILE).write_text(recipe)
        _fix_modes(tmp)
        manifest = write_manifest(tmp, summary)
        os.chmod(tmp / PACK_MANIFEST, 0o644)
        summary["files"] = sorted([*manifest["files"], PACK_MANIFEST])
        if out_dir.exists():
            # keep the earlier pack until the new one is in place; re-check it is still only a moesq pack
            check_output_dir(given, root, src, overwrite)
            old = owned_dir(out_dir.parent, f".{out_dir.name}.old-")
            out_dir.rename(old / "pack")
        tmp.rename(out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
            old = None
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
        if old is not None and (old / "pack").exists() and not out_dir.exists():
            (old / "pack").rename(out_dir)  # the swap failed half-way: put the earlier pack back
            shutil.rmtree(old, ignore_errors=True)
    summary["path"] = str(given)
    return summary


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
            info = api.upload_folder(folder_path=str(out_dir), repo_id=repo_id, repo_type="model",
                                     commit_message="moesq pack")
            commit = str(getattr(info, "commit_url", url))
        return {"repo": repo_id, "url": commit, "private": private, "bytes": size, "notes": notes}
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RuntimeError(
            f"--push-to-hub {repo_id or '(your user)/' + str(default_name)}: upload failed "
            f"({type(e).__name__}: {msg}). The packed model is intact in "
            f"{out_dir}; check your network and `hf auth login` / HF_TOKEN, then push again."
        ) from None
