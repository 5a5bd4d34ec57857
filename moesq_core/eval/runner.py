"""What `moesq eval` evaluates: targets (reference models, work dir stages, packed dirs), loaded one at a time,
with results cached by (target, data, protocol) so a re-run or an interrupted evaluation does not redo work."""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from moesq_core.compression.pack_swap import restore_interrupted_swap
from moesq_core.compression.workdir import DiskWriteError, WorkDir, sha256_file, weight_files_sha256, write_json_atomic
from moesq_core.naming import loaders_read
from moesq_core.progress import NullProgress

if TYPE_CHECKING:  # torch is imported where a model is: resolving targets answers a bad path at once
    import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalTarget:
    label: str
    kind: str  # "reference" | "stage" | "packed"
    path: str  # model dir, work dir or packed dir
    stage: str | None = None

    @property
    def key(self) -> str:
        return f"{self.kind}:{Path(self.path).resolve()}:{self.stage or ''}"


def resolve_targets(targets: list[str], stages: list[str] | None = None, reference: bool = True) -> list[EvalTarget]:
    """A work dir expands to its reference model (once) and its finished stages (or `stages`); a packed dir
    (config.json with quantization_config.moesq) is one target; any other model dir is a reference, but a dir
    with a pack manifest whose config lost quantization_config.moesq is refused (ValueError)."""
    out: list[EvalTarget] = []
    seen = set()
    several_workdirs = sum((Path(t) / "manifest.json").is_file() for t in targets) > 1

    def add(t: EvalTarget):
        if t.key not in seen:
            seen.add(t.key)
            out.append(t)

    for t in targets:
        p = Path(t)
        restore_interrupted_swap(p)  # a packed dir that a killed pack left aside
        if (p / "manifest.json").is_file():
            wd = WorkDir(p)
            if reference:
                add(EvalTarget("reference", "reference", str(wd.identity().model_path)))
            done = [k for k, v in wd.load()["stages"].items() if v.get("done")]
            for s in stages or done:
                if s not in done:
                    if several_workdirs:  # --stage picks from whichever work dirs have it
                        continue
                    raise ValueError(f"stage {s!r} is not finished in {p} (finished: {', '.join(done) or 'none'})")
                label = s.removeprefix("init-")
                add(EvalTarget(f"{p.name}:{label}" if several_workdirs else label, "stage", str(p), s))
        elif (p / "config.json").is_file():
            cfg = json.loads((p / "config.json").read_text())
            if "moesq" in (cfg.get("quantization_config") or {}):
                add(EvalTarget(f"packed:{p.name}", "packed", str(p)))
            elif (p / "moesq_pack.json").is_file():  # checksums.PACK_MANIFEST: a pack that lost its config's
                # quantization_config, not a reference (the constant is not imported: checksums imports torch)
                raise ValueError(f"{t}: a moesq pack (moesq_pack.json) whose config.json has no "
                                 f"quantization_config.moesq (changed after packing?); run `moesq verify {t}`")
            else:
                add(EvalTarget(f"reference:{p.name}" if len(targets) > 1 else "reference", "reference", str(p)))
        else:
            raise FileNotFoundError(f"{t}: not a work dir (manifest.json), a packed dir or a model dir (config.json)")
    missing = [s for s in stages or [] if not any(t.stage == s for t in out)]
    if missing:
        raise ValueError(f"stage(s) {', '.join(missing)} finished in none of the work dirs given")
    return out


def load_target(t: EvalTarget, device: str | torch.device = "cpu", dtype: torch.dtype | None = None, progress=None,
                verify: bool = True):
    """(model, tokenizer) in `dtype` (default float32); a packed dir of any moesq format goes through load_packed
    (fast path on sm_90; checked against its checksum manifest unless verify=False)."""
    import torch

    from moesq_core.compression.engine import load_workdir_model
    from moesq_core.models import load_model
    from moesq_core.serving.loader import load_packed

    dtype = torch.float32 if dtype is None else dtype
    if t.kind == "reference":
        model, tok, _, _ = load_model(t.path, dtype=dtype, device=device)
        return model, tok
    if t.kind == "stage":
        return load_workdir_model(t.path, t.stage, device=device, dtype=dtype)
    return load_packed(t.path, device=device, dtype=dtype, progress=progress, verify=verify)


def content_fingerprint(model_dir: Path) -> str:
    """sha256 over every file of a model or packed dir that loaders read (config.json, the weights and their
    index, tokenizer, templates: naming.loaders_read; a reference's *.bin weights), by path and content: the
    weight files' digests through the hash cache (weight_files_sha256: hashed again when a file's size or mtime
    changes), the small files' read now."""
    model_dir = Path(model_dir)
    files = sorted(p for p in model_dir.rglob("*") if p.is_file() and (
        loaders_read(p.relative_to(model_dir).as_posix()) or p.parent == model_dir and p.suffix == ".bin"))
    weights = [p for p in files if p.suffix in (".safetensors", ".bin")]
    digests = dict(zip(weights, weight_files_sha256(weights)))
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.relative_to(model_dir).as_posix()}:{digests.get(p) or sha256_file(p)};".encode())
    return h.hexdigest()


def target_identity(t: EvalTarget) -> str:
    """What identifies a target's weights for caching: a stage by its artifacts' checksums (from the manifest),
    a packed dir or a reference model by the content of the files loading reads (content_fingerprint)."""
    ident = t.key
    if t.kind == "stage":
        ident += json.dumps(WorkDir(t.path).stage(t.stage)["blocks"], sort_keys=True)
    else:
        ident += content_fingerprint(Path(t.path))
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


class ResultCache:
    """JSON file of finished evaluations keyed by target + data + protocol."""

    def __init__(self, path: Path | None):
        self.path = path
        self.data = json.loads(path.read_text()) if path and path.is_file() else {}

    @staticmethod
    def key(*parts) -> str:
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]

    def get(self, key: str):
        return self.data.get(key)

    def put(self, key: str, value) -> None:
        self.data[key] = value
        if self.path:
            try:
                write_json_atomic(self.path, self.data)
            except DiskWriteError as e:  # a read-only work dir: the results are shown, not cached
                log.warning("evaluation results are not cached: %s", e)
                self.path = None
            except ValueError:  # a non-finite result (a diverged model): JSON cannot hold it
                del self.data[key]


def computation_fingerprint(model: torch.nn.Module, tokens: torch.Tensor) -> str:
    """What decides a perplexity on the CPU: the config, every module's class and settings (extra_repr, train
    mode), every parameter and buffer bit for bit, and the tokens. Two loaded targets with the same fingerprint
    compute the same numbers (a packed dir and the stage it was packed from, on the CPU)."""
    import torch

    h = hashlib.sha256(json.dumps([model.config.to_diff_dict(), model.config._attn_implementation],
                                  sort_keys=True, default=str).encode())
    for name, mod in model.named_modules():
        h.update(f"{name}|{type(mod).__module__}.{type(mod).__qualname__}|{mod.extra_repr()}|{mod.training}".encode())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|{t.device}".encode())
        h.update(memoryview(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()))  # no bytes copy
    h.update(tokens.numpy().tobytes())
    return h.hexdigest()


def ppl_for_targets(targets: list[EvalTarget], text_file: Path, *, max_tokens: int = 65536, window: int = 512,
                    device="cpu", cache: ResultCache | None = None, progress=None, verify: bool = True) -> list[dict]:
    """Perplexity rows of `targets`, in order. A target that computes exactly what one evaluated before it in
    this call does (computation_fingerprint; e.g. a packed dir and its stage on the CPU) takes that target's
    perplexity instead of evaluating again; its row names it in `same_as`."""
    import torch

    from moesq_core.eval.perplexity import load_eval_tokens, perplexity

    if window < 1 or max_tokens < 1:
        raise ValueError(f"window ({window}) and max_tokens ({max_tokens}) must be at least 1")
    cache = cache or ResultCache(None)
    digest = sha256_file(Path(text_file))
    rows, evaluated = [], {}  # computation fingerprint -> the row evaluated for it
    for t in targets:
        key = cache.key("ppl", target_identity(t), digest, max_tokens, window)
        hit = cache.get(key)
        if hit is not None and t.kind == "packed" and verify:
            from moesq_core.checkpoint.checksums import ManifestCheck

            ManifestCheck(Path(t.path))  # a result is shown for a pack only while loading it would be allowed
        if hit is None:
            with (progress or NullProgress()).task(f"loading {t.label}", None):
                model, tok = load_target(t, device, progress=progress, verify=verify)
            tokens = load_eval_tokens(tok, text_file, max_tokens)
            n = len(tokens) // window
            same = computation_fingerprint(model, tokens[: n * window]) if torch.device(device).type == "cpu" else None
            twin = evaluated.get(same)
            if twin is not None:
                ppl, extra = twin["ppl"], {"same_as": twin["label"]}
            elif progress is not None:
                with progress.task(f"perplexity: {t.label}", n) as task:
                    ppl, extra = perplexity(model, tokens, window, progress=task.advance), {}
            else:
                ppl, extra = perplexity(model, tokens, window), {}
            hit = {"label": t.label, "kind": t.kind, "path": t.path, "stage": t.stage, "ppl": ppl,
                   "tokens": n * window, "window": window, "file": str(text_file), **extra}
            cache.put(key, hit)
            if same is not None and twin is None:
                evaluated[same] = hit
            del model
        rows.append({**hit, "label": t.label})
    return rows
