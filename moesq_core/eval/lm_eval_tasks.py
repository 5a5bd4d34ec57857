"""Task accuracy with lm-evaluation-harness on a model that is already in memory.

`evaluate_tasks(model, tokenizer, tasks, label=...)` wraps the loaded model in lm-eval's `HFLM` (nothing is
loaded by name), runs each task with `lm_eval.simple_evaluate`, and returns every metric lm-eval reported
together with the exact configuration. Tasks are lm-eval names (tasks, groups or tags), presets
(`openllm-v1`: the paper's OpenLLM Leaderboard v1 set with its shot counts), or YAML tasks from a local
directory (`tasks_dir`, lm-eval's `TaskManager(include_path=...)`). The task shipped with moesq,
`moesq_cloze` (see `tasks/`), needs no network.

Each finished task is written to `cache_dir` as one JSON file; a later call with the same key (model label,
task, few-shot count, limit, seed, plus a fingerprint of a local task's files) reads it back instead of
rerunning, so an interrupted evaluation resumes where it stopped.

lm-eval is imported lazily: importing this module costs nothing until a task runs.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

BUILTIN_TASKS_DIR = Path(__file__).resolve().parent / "tasks"
OFFLINE_TASK = "moesq_cloze"

# The paper's evaluation (OpenLLM Leaderboard v1): task and number of few-shot examples.
PRESETS: dict[str, tuple[tuple[str, int], ...]] = {
    "openllm-v1": (
        ("arc_challenge", 25),
        ("hellaswag", 10),
        ("mmlu", 5),
        ("truthfulqa_mc2", 0),
        ("winogrande", 5),
        ("gsm8k", 5),
    ),
}

CACHE_VERSION = 1  # bump when the cached JSON layout changes
_LOCAL_DATA_BUILDERS = {"json", "csv", "parquet", "text", "arrow", "pandas"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
_OFFLINE_ENV = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


class TaskUnavailableError(RuntimeError):
    """A task's data cannot be had here (typically a Hub dataset while offline)."""


# --------------------------------------------------------------------------------------------- results


@dataclass
class TaskResult:
    """Everything lm-eval reported for one requested task (a group such as mmlu keeps its members)."""

    task: str
    metrics: dict[str, float]  # lm-eval keys, e.g. "acc,none", "acc_stderr,none", "exact_match,strict-match"
    subtasks: dict[str, dict[str, float]]  # members of a group, same key style
    num_fewshot: int | None  # what lm-eval actually used (a task may pin its own)
    requested_fewshot: int | None  # what was asked for (None: the task's default)
    n_samples: int | None  # documents evaluated (after limit)
    n_docs: int | None  # documents in the task
    limit: int | float | None
    seed: int
    seconds: float  # wall time of the run that produced it (not of a cache read)
    cached: bool = False  # read back from cache_dir in this call
    version: Any = None
    task_config: dict = field(default_factory=dict)  # lm-eval's task config, JSON-safe
    key: dict = field(default_factory=dict)  # the cache key

    def metric(self, name: str) -> float:
        """A metric by lm-eval key ("exact_match,strict-match") or bare name ("acc" → "acc,none")."""
        for key in (name, f"{name},none"):
            if key in self.metrics:
                return float(self.metrics[key])
        raise KeyError(f"task {self.task!r} has no metric {name!r}; it has: {', '.join(self.metric_names())}")

    def stderr(self, name: str) -> float | None:
        metric, _, flt = (name if "," in name else f"{name},none").partition(",")
        value = self.metrics.get(f"{metric}_stderr,{flt}")
        return float(value) if isinstance(value, (int, float)) else None

    def metric_names(self) -> list[str]:
        return [k for k, v in self.metrics.items() if "_stderr," not in k and isinstance(v, (int, float))]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> TaskResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class TaskResults:
    """One model's results: per requested task, in request order, plus the exact configuration."""

    label: str
    results: dict[str, TaskResult]
    config: dict

    @property
    def tasks(self) -> list[str]:
        return list(self.results)

    def to_dict(self) -> dict:
        return {"label": self.label, "config": self.config,
                "results": {k: v.to_dict() for k, v in self.results.items()}}

    @classmethod
    def from_dict(cls, d: Mapping) -> TaskResults:
        return cls(d["label"], {k: TaskResult.from_dict(v) for k, v in d["results"].items()}, dict(d["config"]))


@dataclass(frozen=True)
class ProgressEvent:
    """Reported through `progress`: a task starts, is read from cache, advances, or finishes.

    For kind "requests", `done`/`total` count model requests of one type (loglikelihood, generate_until, ...)
    of the current task; they are reported per chunk of requests.
    """

    kind: Literal["task_start", "task_cached", "requests", "task_done"]
    task: str
    index: int  # 0-based position of the task in this call
    total_tasks: int
    request_type: str | None = None
    done: int = 0
    total: int = 0
    seconds: float = 0.0
    result: TaskResult | None = None


@dataclass(frozen=True)
class TaskRequest:
    name: str
    num_fewshot: int | None  # None: the task's own default


# ------------------------------------------------------------------------------------ task resolution


def resolve_tasks(tasks: str | Sequence[str], num_fewshot: int | None = None) -> list[TaskRequest]:
    """Expand presets and comma lists into (task, few-shot) requests, keeping order, dropping repeats.

    An explicit `num_fewshot` overrides the preset shot counts and task defaults.
    """
    items = [tasks] if isinstance(tasks, str) else list(tasks)
    names = [t.strip() for item in items for t in str(item).split(",") if t.strip()]
    if not names:
        raise ValueError("no task given; name lm-eval tasks, a preset (" + ", ".join(PRESETS)
                         + f") or the offline task {OFFLINE_TASK!r}")
    if num_fewshot is not None and num_fewshot < 0:
        raise ValueError(f"num_fewshot must be >= 0, got {num_fewshot}")
    out: dict[str, TaskRequest] = {}
    for name in names:
        expanded = PRESETS.get(name.lower(), ((name, None),))
        for task, shots in expanded:
            out.setdefault(task, TaskRequest(task, num_fewshot if num_fewshot is not None else shots))
    return list(out.values())


def check_tasks_dir(tasks_dir: str | os.PathLike) -> Path:
    """A readable directory holding at least one task YAML, else an error that says what is wrong."""
    d = Path(tasks_dir).expanduser()
    if not d.exists():
        raise FileNotFoundError(f"tasks dir {d} does not exist; pass the directory that holds your task YAML files")
    if not d.is_dir():
        raise NotADirectoryError(f"tasks dir {d} is a file, not a directory; pass the directory that holds the "
                                 "task YAML files (lm-eval loads every *.yaml below it)")
    if not os.access(d, os.R_OK | os.X_OK):
        raise PermissionError(f"tasks dir {d} cannot be read (permissions); fix them or copy the tasks elsewhere")
    try:
        has_yaml = next(iter(d.rglob("*.yaml")), None) is not None
    except OSError as e:
        raise PermissionError(f"tasks dir {d} cannot be read: {e}") from e
    if not has_yaml:
        raise FileNotFoundError(f"tasks dir {d} holds no task YAML (*.yaml) files; see {BUILTIN_TASKS_DIR} for "
                                "an example of an offline task with local data")
    return d.resolve()


_TM_CACHE: dict[tuple, Any] = {}


def require_lm_eval() -> None:
    """ImportError saying how to get lm-eval when it cannot be imported: a command checks this before it loads
    any model."""
    try:
        import lm_eval  # noqa: F401
    except ImportError as e:
        raise ImportError("lm-eval tasks need lm-eval, which is not installed: install moesq's `eval` extra "
                          f"(pip install -e '.[eval]' in a checkout) ({e})") from None


def _task_manager(dirs: tuple[Path, ...], with_defaults: bool):
    """lm-eval's TaskManager; indexing its ~15k built-in tasks takes seconds, so only when needed, once."""
    key = (dirs, with_defaults)
    if key not in _TM_CACHE:
        from lm_eval.tasks import TaskManager

        _TM_CACHE[key] = TaskManager(include_path=[str(d) for d in dirs], include_defaults=with_defaults)
    return _TM_CACHE[key]


def _unreadable_yamls(d: Path) -> list[str]:
    """YAML files under d that lm-eval's indexer would skip silently, with the reason."""
    from lm_eval.tasks._yaml_loader import load_yaml

    bad = []
    for p in sorted(d.rglob("*.yaml")):
        try:
            cfg = load_yaml(p, resolve_func=False)
            if not ({"task", "group", "class"} & set(cfg)):
                bad.append(f"{p}: no 'task' or 'group' key")
        except Exception as e:  # noqa: BLE001 - any parse failure is worth showing
            bad.append(f"{p}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return bad


def _unknown_task_error(name: str, known: Iterable[str], tasks_dir: Path | None) -> ValueError:
    lines = [f"unknown task {name!r}: not an lm-eval task, group or tag"
             + (f", and not defined in tasks dir {tasks_dir}" if tasks_dir else "") + "."]
    close = difflib.get_close_matches(name, sorted(set(known)), n=5, cutoff=0.75)
    if close:
        lines.append("Did you mean: " + ", ".join(close) + "?")
    lines.append(f"Presets: {', '.join(PRESETS)}. Offline task shipped with moesq: {OFFLINE_TASK!r}. Your own "
                 "tasks: --tasks-dir DIR holding YAML files whose data are local JSON/JSONL files.")
    bad = _unreadable_yamls(tasks_dir) if tasks_dir else []
    if bad:
        lines.append("These YAML files in the tasks dir could not be read:\n  " + "\n  ".join(bad))
    return ValueError("\n".join(lines))


def _is_local_entry(entry, local_dirs: Sequence[Path]) -> bool:
    p = getattr(entry, "yaml_path", None)
    return p is not None and any(Path(p).resolve().is_relative_to(d) for d in local_dirs)


def _fingerprint(entry, local_dirs: Sequence[Path]) -> str:
    """Changes when a local task's files change, so stale cached results are not reused."""
    import lm_eval

    if not _is_local_entry(entry, local_dirs):
        return f"lm-eval {lm_eval.__version__}"
    folder = Path(entry.yaml_path).resolve().parent
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.suffix in {".yaml", ".yml", ".json", ".jsonl", ".py", ".csv", ".parquet", ".txt"}:
            st = p.stat()
            h.update(str(p.relative_to(folder)).encode() + b"\0")
            # Content for task-sized files; size and mtime stand in for huge ones.
            h.update(p.read_bytes() if st.st_size <= 64 << 20 else f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _absolute_data_files(cfg: dict, base: Path) -> dict:
    """Relative `dataset_kwargs.data_files`/`data_dir` are taken relative to the YAML, not the working dir."""
    kwargs = dict(cfg.get("dataset_kwargs") or {})

    def fix(v):
        if isinstance(v, str) and not re.match(r"^[a-z][a-z0-9+.-]*://", v) and not Path(v).is_absolute():
            return str(base / v)
        if isinstance(v, list):
            return [fix(x) for x in v]
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        return v

    for k in ("data_files", "data_dir"):
        if k in kwargs:
            kwargs[k] = fix(kwargs[k])
    return {**cfg, "dataset_kwargs": kwargs} if kwargs else cfg


def _offline_requested() -> bool:
    if any(os.environ.get(k, "").strip().upper() in {"1", "ON", "YES", "TRUE"} for k in _OFFLINE_ENV):
        return True
    try:
        import datasets.config

        return bool(datasets.config.HF_HUB_OFFLINE)
    except Exception:  # noqa: BLE001
        return False


@contextmanager
def _hub_offline(enabled: bool):
    """Honour HF_*_OFFLINE set after `datasets` was imported: both libraries read it once, at import."""
    if not enabled:
        yield
        return
    import datasets.config
    import huggingface_hub.constants as hc

    saved = (datasets.config.HF_HUB_OFFLINE, hc.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = hc.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hc.HF_HUB_OFFLINE = saved


def _dataset_paths(entry, tm) -> list[str]:
    """The dataset_path of a task, or of every member of a group (best effort, for messages)."""
    cfg = getattr(entry, "cfg", None) or {}
    if "dataset_path" in cfg:
        return [str(cfg["dataset_path"])]
    out = []
    members = cfg.get("task") if isinstance(cfg.get("task"), list) else []
    for m in members[:3]:
        name = m if isinstance(m, str) else (m.get("task") or m.get("group")) if isinstance(m, dict) else None
        sub = tm.task_index.get(name) if isinstance(name, str) else None
        if sub is not None and sub is not entry:
            out += _dataset_paths(sub, tm)
    for t in sorted(getattr(entry, "tags", ()) or ())[:3]:
        sub = tm.task_index.get(t)
        if sub is not None and sub is not entry:
            out += _dataset_paths(sub, tm)
    return sorted(set(out))


def _locate(name: str, local_dirs: tuple[Path, ...], user_dir: Path | None):
    """The TaskManager that knows `name`: the local dirs first (they override lm-eval's tasks, as in lm-eval),
    then lm-eval's built-ins, indexed once per process and shared by every tasks dir."""
    from lm_eval.tasks._index import Kind

    tm = _task_manager(local_dirs, with_defaults=False)
    entry = tm.task_index.get(name)
    if entry is not None:
        # A local group may list lm-eval tasks among its members: build it with both indexes.
        return _task_manager(local_dirs, with_defaults=True) if entry.kind == Kind.GROUP else tm
    defaults = _task_manager((), with_defaults=True)
    if name in defaults.task_index:
        return defaults
    raise _unknown_task_error(name, [*tm.all_tasks, *defaults.all_tasks], user_dir)


def _expand_tags(requests: list[TaskRequest], local_dirs: tuple[Path, ...], user_dir: Path | None):
    """[(request, task manager)]; a tag (e.g. moesq_offline) is only a list of tasks: each member runs and is
    reported on its own."""
    from lm_eval.tasks._index import Kind

    out: dict[str, tuple[TaskRequest, Any]] = {}
    for r in requests:
        tm = _locate(r.name, local_dirs, user_dir)
        entry = tm.task_index[r.name]
        names = sorted(entry.tags) if entry.kind == Kind.TAG else [r.name]
        for name in names:
            out.setdefault(name, (TaskRequest(name, r.num_fewshot), tm))
    return list(out.values())


def _looks_like_no_hub(e: BaseException) -> bool:
    """A network/Hub failure (as opposed to a bug or a missing package), anywhere in the exception chain."""
    names = {"DatasetNotFoundError", "LocalEntryNotFoundError", "OfflineModeIsEnabled", "HfHubHTTPError"}
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (ConnectionError, TimeoutError)) or type(e).__name__ in names:
            return True
        if isinstance(e, OSError) and not isinstance(e, (FileNotFoundError, PermissionError)):
            return True  # requests' and urllib3's connection errors derive from OSError
        e = e.__cause__ or e.__context__
    return False


def _build_task(name: str, tm, local_dirs: Sequence[Path], offline: bool):
    """lm-eval Task/Group object(s) for one name; dataset loading happens here, so errors surface here."""
    from lm_eval.tasks._index import Kind
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = tm.task_index[name]
    local = _is_local_entry(entry, local_dirs)
    if local and entry.kind == Kind.TASK:
        # Full config (includes merged, !function resolved), with data paths made relative to the YAML.
        spec = _absolute_data_files(load_yaml(entry.yaml_path, resolve_func=True), Path(entry.yaml_path).parent)
    else:
        spec = name
    try:
        with _hub_offline(offline and not local):
            loaded = tm.load([spec])
    except Exception as e:
        if local:
            raise ValueError(f"task {name!r} from {entry.yaml_path} could not be loaded: {type(e).__name__}: {e}. "
                             "Check its YAML and that its data files exist (relative paths are taken from "
                             "the YAML's folder).") from e
        if not (offline or _looks_like_no_hub(e)):
            raise ValueError(f"task {name!r} could not be loaded: {type(e).__name__}: {e}") from e
        paths = [p for p in _dataset_paths(entry, tm) if p not in _LOCAL_DATA_BUILDERS]
        where = f" (Hugging Face Hub dataset {', '.join(paths)})" if paths else ""
        why = ("offline mode is on (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE) and the dataset is not in the local "
               "datasets cache" if offline else "the Hugging Face Hub could not be reached (no network?)")
        raise TaskUnavailableError(
            f"task {name!r} needs its data from the Hub{where}, but {why}. moesq downloads nothing by itself "
            f"here: run once with network to fill the datasets cache, or evaluate offline with the shipped "
            f"task (--tasks {OFFLINE_TASK}) or your own YAML tasks with local data files (--tasks-dir DIR). "
            f"[{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}]"
        ) from e
    groups = loaded.get("groups") or {}
    return [groups[name]] if name in groups else list(loaded["tasks"].values())


# ------------------------------------------------------------------------------------------- caching


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_")[:60] or "model"


def _cache_path(cache_dir: Path, key: dict) -> Path:
    label = key["label"]
    sub = f"{_slug(label)}-{hashlib.sha256(label.encode()).hexdigest()[:8]}"
    fs = "default" if key["num_fewshot"] is None else key["num_fewshot"]
    name = f"{_slug(key['task'])}__fs{fs}__limit{key['limit']}__seed{key['seed']}.json"
    return cache_dir / sub / name


def _atomic_write_json(path: Path, obj: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False, default=_json_default) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # a crash never leaves a half-written result that a resume would trust
    return path


def _read_cached(path: Path, key: dict) -> TaskResult | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if data.get("key") != key:  # same file name but other label/fingerprint: stale, rerun
        return None
    try:
        res = TaskResult.from_dict(data["result"])
    except (KeyError, TypeError):
        return None
    res.cached = True
    return res


def _json_default(o: Any):
    if callable(o):
        return f"<function {getattr(o, '__module__', '?')}.{getattr(o, '__qualname__', repr(o))}>"
    if isinstance(o, (set, tuple)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
    except ImportError:
        pass
    return str(o)


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=_json_default))


# -------------------------------------------------------------------------------------------- running


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer stored in a model directory, or an error that says what to do."""
    d = Path(path).expanduser()
    if not d.is_dir():
        raise FileNotFoundError(f"model directory {d} does not exist (looking for its tokenizer)")
    if not any((d / f).is_file() for f in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"model directory {d} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}). Copy the tokenizer "
            "files of the source model into it (moesq's exports do this), or pass the source model's "
            "directory as the tokenizer."
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d))


def _model_info(model) -> dict:
    import torch

    params = list(model.parameters()) if hasattr(model, "parameters") else []
    first = params[0] if params else None
    cfg = getattr(model, "config", None)
    return {
        "class": type(model).__name__,
        "name_or_path": getattr(cfg, "_name_or_path", None),
        "model_type": getattr(cfg, "model_type", None),
        "dtype": str(first.dtype) if isinstance(first, torch.Tensor) else None,
        "device": str(getattr(model, "device", first.device if first is not None else None)),
        "parameters": int(sum(p.numel() for p in params)),
    }


def _install_progress(lm, emit: Callable[[str, int, int], None], chunk: int) -> None:
    """Run each request list in chunks so long tasks report progress (results are per request, unchanged)."""
    for reqtype in ("loglikelihood", "loglikelihood_rolling", "generate_until"):
        inner = getattr(lm, reqtype)

        def run(requests, disable_tqdm: bool = False, _inner=inner, _type=reqtype):
            out, n = [], len(requests)
            emit(_type, 0, n)
            for i in range(0, n, chunk):
                out.extend(_inner(requests[i:i + chunk], disable_tqdm=True))
                emit(_type, min(i + chunk, n), n)
            return out

        setattr(lm, reqtype, run)


def _extract(name: str, res: dict) -> dict:
    """The requested name's metrics, its members' metrics, and shot/sample counts from lm-eval's results."""
    results = res.get("results", {})
    def numeric(d: dict) -> dict:  # metric keys are "name,filter"; drop alias, sample_len and the like
        return {k: v for k, v in d.items() if "," in k and isinstance(v, (int, float)) and not isinstance(v, bool)}

    main = numeric(results.get(name, {}))
    subtasks = {k: numeric(v) for k, v in results.items() if k != name}
    shots = res.get("n-shot", {})
    if name in shots:
        fs = shots[name]
    else:  # a group: its members' shot count when they agree
        vals = {v for k, v in shots.items() if k in subtasks}
        fs = vals.pop() if len(vals) == 1 else None
    ns = res.get("n-samples", {})
    if name in ns:
        n_eff, n_orig = ns[name].get("effective"), ns[name].get("original")
    else:
        members = [v for k, v in ns.items() if k in subtasks]
        n_eff = sum(v.get("effective", 0) for v in members) if members else None
        n_orig = sum(v.get("original", 0) for v in members) if members else None
    cfg = res.get("configs", {}).get(name) or {k: v for k, v in res.get("configs", {}).items() if k in subtasks}
    return {"metrics": main, "subtasks": subtasks, "num_fewshot": fs, "n_samples": n_eff, "n_docs": n_orig,
            "version": res.get("versions", {}).get(name), "task_config": _jsonable(cfg)}


def evaluate_tasks(
    model,
    tokenizer,
    tasks: Sequence[str] | str,
    *,
    label: str,
    tasks_dir: str | os.PathLike | None = None,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    batch_size: int | str = 1,
    seed: int = 1234,
    cache_dir: str | os.PathLike | None = None,
    progress: Callable[[ProgressEvent], None] | None = None,
    bootstrap_iters: int = 1000,
    model_id: str | None = None,
) -> TaskResults:
    """Run lm-eval tasks on an in-memory model.

    model: a transformers causal LM (already on its device, in eval mode); tokenizer: its tokenizer, or the
    path of a directory holding one. label: names the model in tables and in the cache key; give different
    models different labels. tasks: names, comma lists or presets (see `resolve_tasks`). limit: documents per
    task (an int, or a fraction < 1; for quick checks: results on a limit are not comparable to full runs).
    num_fewshot: overrides the preset/task default (a task whose YAML pins 0 shots keeps 0, as in lm-eval).
    seed: python, numpy, torch and few-shot sampling seeds. cache_dir: per-task JSON results; finished tasks
    are read back instead of rerun. model_id: identity of the weights for the cache key when the label alone
    does not pin them (e.g. checksums of a work dir stage; a changed stage then reruns). bootstrap_iters: for
    stderr of non-mean metrics (lm-eval's default is 100000, slow on CPU; means use a closed form anyway).

    Raises ValueError for unknown tasks or bad arguments, FileNotFoundError/NotADirectoryError/PermissionError
    for a bad tasks dir or tokenizer dir, TaskUnavailableError for a Hub task that cannot be downloaded.
    """
    if not isinstance(label, str) or not label.strip():
        raise ValueError("label must be a non-empty string naming the model (it keys the cache and the table)")
    if model is None:
        raise ValueError("model is None; load the model first (moesq_core.serving.loader) and pass it")
    if tokenizer is None:
        raise ValueError("tokenizer is None; pass the model's tokenizer or the directory that holds it")
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and hasattr(tokenizer, "__len__") and len(tokenizer) > vocab:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {vocab}: "
                         "this is not the model's tokenizer; pass the one from the model's directory")
    if limit is not None and (limit <= 0 or (isinstance(limit, float) and limit >= 1 and limit != int(limit))):
        raise ValueError(f"limit must be a positive int or a fraction in (0, 1), got {limit!r}")
    if isinstance(limit, float) and limit >= 1:
        limit = int(limit)
    if not (batch_size == "auto" or (isinstance(batch_size, int) and batch_size >= 1)):
        raise ValueError(f"batch_size must be a positive int or 'auto', got {batch_size!r}")

    requests = resolve_tasks(tasks, num_fewshot)
    user_dir = check_tasks_dir(tasks_dir) if tasks_dir is not None else None
    local_dirs = (BUILTIN_TASKS_DIR,) + ((user_dir,) if user_dir else ())
    located = _expand_tags(requests, local_dirs, user_dir)
    requests = [r for r, _ in located]
    managers = {r.name: tm for r, tm in located}

    import lm_eval
    import torch
    import transformers

    config = {
        "label": label,
        "model_id": model_id,
        "tasks": [{"task": r.name, "num_fewshot": r.num_fewshot} for r in requests],
        "limit": limit,
        "seed": seed,
        "batch_size": batch_size,
        "bootstrap_iters": bootstrap_iters,
        "tasks_dir": str(user_dir) if user_dir else None,
        "builtin_tasks_dir": str(BUILTIN_TASKS_DIR),
        "cache_dir": str(cache_dir) if cache_dir else None,
        "model": _model_info(model),
        "versions": {"lm_eval": lm_eval.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__},
    }

    keys, paths, results = {}, {}, {}
    for r in requests:
        keys[r.name] = {"cache_version": CACHE_VERSION, "label": label, "model_id": model_id, "task": r.name,
                        "num_fewshot": r.num_fewshot, "limit": limit, "seed": seed,
                        "task_fingerprint": _fingerprint(managers[r.name].task_index[r.name], local_dirs)}
        if cache_dir is not None:
            paths[r.name] = _cache_path(Path(cache_dir), keys[r.name])
            hit = _read_cached(paths[r.name], keys[r.name])
            if hit is not None:
                results[r.name] = hit

    # Build every task still to run before running any: a missing dataset fails in seconds, not after hours.
    offline = _offline_requested()
    built = {r.name: _build_task(r.name, managers[r.name], local_dirs, offline)
             for r in requests if r.name not in results}

    lm = None
    if built:
        from lm_eval.models.huggingface import HFLM

        if hasattr(model, "eval"):
            model.eval()
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)

    n = len(requests)
    current = {"task": "", "index": 0, "t0": 0.0}  # the task now running, for request-level events
    if progress and lm is not None:
        def emit(typ: str, done: int, total: int) -> None:
            progress(ProgressEvent("requests", current["task"], current["index"], n, typ, done, total,
                                   time.perf_counter() - current["t0"]))

        _install_progress(lm, emit, chunk=max(128, 32 * (batch_size if isinstance(batch_size, int) else 8)))
    out: dict[str, TaskResult] = {}
    for i, r in enumerate(requests):
        if r.name in results:
            out[r.name] = results[r.name]
            if progress:
                progress(ProgressEvent("task_cached", r.name, i, n, result=results[r.name]))
            continue
        current.update(task=r.name, index=i, t0=time.perf_counter())
        if progress:
            progress(ProgressEvent("task_start", r.name, i, n))
        t0 = time.perf_counter()
        res = lm_eval.simple_evaluate(
            model=lm, tasks=built[r.name], task_manager=managers[r.name], num_fewshot=r.num_fewshot, limit=limit,
            bootstrap_iters=bootstrap_iters, log_samples=False, random_seed=seed, numpy_random_seed=seed,
            torch_random_seed=seed, fewshot_random_seed=seed,
        )
        seconds = time.perf_counter() - t0
        result = TaskResult(task=r.name, requested_fewshot=r.num_fewshot, limit=limit, seed=seed,
                            seconds=round(seconds, 3), key=keys[r.name], **_extract(r.name, res))
        if not result.metrics:
            raise RuntimeError(f"lm-eval returned no metrics for task {r.name!r} (got: {sorted(res['results'])})")
        if cache_dir is not None:
            _atomic_write_json(paths[r.name], {"key": keys[r.name], "result": result.to_dict()})
        out[r.name] = result
        if progress:
            progress(ProgressEvent("task_done", r.name, i, n, seconds=seconds, result=result))
    return TaskResults(label=label, results=out, config=config)


def list_tasks(tasks_dir: str | os.PathLike | None = None, *, include_lm_eval: bool = False) -> list[str]:
    """Task names available offline from the shipped and given dirs (and all of lm-eval's when asked)."""
    dirs = (BUILTIN_TASKS_DIR,) + ((check_tasks_dir(tasks_dir),) if tasks_dir is not None else ())
    return list(_task_manager(dirs, with_defaults=include_lm_eval).all_tasks)


__all__ = [
    "BUILTIN_TASKS_DIR", "OFFLINE_TASK", "PRESETS", "ProgressEvent", "TaskRequest", "TaskResult", "TaskResults",
    "TaskUnavailableError", "check_tasks_dir", "evaluate_tasks", "list_tasks", "load_tokenizer", "resolve_tasks",
]
