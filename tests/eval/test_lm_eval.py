"""lm-eval glue: offline task on the shared micro model, cache/resume, errors, recovery arithmetic."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
torch = pytest.importorskip("torch")

from moesq_core.eval.lm_eval_tasks import (  # noqa: E402
    OFFLINE_TASK,
    TaskResult,
    TaskResults,
    TaskUnavailableError,
    evaluate_tasks,
    load_tokenizer,
    resolve_tasks,
)
from moesq_core.eval.recovery import MAIN_METRICS, main_metric_name, recovery_table  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
MICRO = SHARED / "models" / "micro-qwen3-moe"
TASKS = REPO / "moesq_core" / "eval" / "tasks"
DATA = TASKS / "moesq_cloze.jsonl"

@pytest.fixture(scope="module")
def micro():
    if not (MICRO / "config.json").is_file():
        pytest.skip("shared micro model not found")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(MICRO), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(MICRO))


def _docs(n: int) -> list[dict]:
    with DATA.open(encoding="utf-8") as fh:
        return [json.loads(next(fh)) for _ in range(n)]


@torch.no_grad()
def _independent_scores(model, tok, docs: list[dict]) -> tuple[float, float]:
    """(acc, acc_norm) computed directly with torch, encoding as lm-eval does for causal models (whole =
    context + " " + choice; the continuation is what follows the context's tokens), and normalising by the
    choice's length in characters as lm-eval's acc_norm does: checks the whole lm-eval path."""
    right = right_norm = 0
    for d in docs:
        ctx_ids = tok.encode(d["context"])
        scores, lengths = [], []
        for word in d["options"]:
            choice = d["before"] + word + d["after"]
            whole = tok.encode(d["context"] + " " + choice)
            cont = whole[len(ctx_ids):]
            logp = model(torch.tensor([whole])).logits.float().log_softmax(-1)[0]
            pos = torch.arange(len(ctx_ids) - 1, len(whole) - 1)
            scores.append(logp[pos, torch.tensor(cont)].sum().item())
            lengths.append(len(choice))
        right += max(range(4), key=scores.__getitem__) == d["label"]
        right_norm += max(range(4), key=lambda i: scores[i] / lengths[i]) == d["label"]
    return right / len(docs), right_norm / len(docs)


# ----------------------------------------------------------------------------------- task resolution


def test_resolve_presets_and_overrides():
    reqs = resolve_tasks("openllm-v1")
    assert [(r.name, r.num_fewshot) for r in reqs] == [
        ("arc_challenge", 25), ("hellaswag", 10), ("mmlu", 5), ("truthfulqa_mc2", 0), ("winogrande", 5), ("gsm8k", 5)]
    reqs = resolve_tasks(["moesq_cloze,hellaswag", "OpenLLM-v1"], num_fewshot=3)
    assert [r.name for r in reqs][:3] == ["moesq_cloze", "hellaswag", "arc_challenge"]
    assert len(reqs) == 7 and all(r.num_fewshot == 3 for r in reqs)
    assert resolve_tasks("moesq_cloze")[0].num_fewshot is None
    with pytest.raises(ValueError, match="no task given"):
        resolve_tasks(" , ")
    with pytest.raises(ValueError, match="num_fewshot"):
        resolve_tasks("moesq_cloze", num_fewshot=-1)


# ------------------------------------------------------------------------------------- offline task


def test_offline_task_data_is_small_deterministic_and_well_formed():
    assert DATA.stat().st_size <= 300_000
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
    assert 200 <= len(rows) <= 500
    for r in rows:
        assert len(r["options"]) == 4 and len(set(r["options"])) == 4
        assert 0 <= r["label"] < 4 and r["context"] and r["options"][r["label"]]
    labels = [r["label"] for r in rows]
    assert min(labels.count(i) for i in range(4)) > len(rows) / 8  # answer position is not a giveaway
    src = SHARED / "data" / "eval-docs.txt.xz"
    if not src.is_file():
        pytest.skip("shared eval text not found")
    # The committed file is exactly what the seeded builder makes from the shared text.
    proc = subprocess.run([sys.executable, str(TASKS / "build_offline_task.py"), "--check", "--source", str(src)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_offline_task_runs_and_matches_direct_scoring(micro, tmp_path):
    """The shipped task through HFLM on CPU, a few documents; the accuracy equals a direct computation."""
    model, tok = micro
    events = []
    res = evaluate_tasks(model, tok, OFFLINE_TASK, label="micro-ref", limit=8, batch_size=4,
                         cache_dir=tmp_path, progress=events.append)
    r = res.results[OFFLINE_TASK]
    assert r.n_samples == 8 and r.n_docs == 400 and r.num_fewshot == 0 and not r.cached
    acc, acc_norm = _independent_scores(model, tok, _docs(8))
    assert (r.metric("acc"), r.metric("acc_norm")) == (pytest.approx(acc), pytest.approx(acc_norm))
    assert r.stderr("acc") is not None
    assert [e.kind for e in events][0] == "task_start" and events[-1].kind == "task_done"
    req = [e for e in events if e.kind == "requests"]
    assert req[-1].done == req[-1].total == 32  # 8 documents x 4 choices
    assert res.config["limit"] == 8 and res.config["seed"] == 1234
    assert res.config["tasks"] == [{"task": OFFLINE_TASK, "num_fewshot": None}]
    assert res.config["model"]["class"] == type(model).__name__
    again = TaskResults.from_dict(json.loads(json.dumps(res.to_dict())))
    assert again.results[OFFLINE_TASK].metrics == r.metrics


def _count_forwards(model):
    calls = []
    handle = model.register_forward_hook(lambda *a: calls.append(1))
    return calls, handle


def _local_task_dir(tmp_path: Path, name: str = "tiny_local") -> Path:
    """A user task: YAML + JSONL with a *relative* data_files path (resolved against the YAML's folder)."""
    d = tmp_path / "mytasks"
    (d / "data").mkdir(parents=True)
    rows = [{"q": f"The number after {i} is", "choices": [str(i + 1), str(i + 7), "blue"], "gold": 0}
            for i in range(6)]
    (d / "data" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: data/test.jsonl\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: choices\n"
        "doc_to_target: gold\nmetric_list:\n  - metric: acc\n")
    return d


def test_cache_resume_after_interruption(micro, tmp_path, monkeypatch):
    model, tok = micro
    tasks_dir = _local_task_dir(tmp_path)
    monkeypatch.chdir(tmp_path / "..")  # relative data paths must not depend on the working directory
    cache = tmp_path / "cache"

    class Stop(Exception):
        pass

    def stop_at_second(e):
        if e.kind == "task_start" and e.task == "tiny_local":
            raise Stop

    args = dict(label="micro-ref", tasks_dir=tasks_dir, limit=4, batch_size=2, cache_dir=cache)
    with pytest.raises(Stop):
        evaluate_tasks(model, tok, [OFFLINE_TASK, "tiny_local"], progress=stop_at_second, **args)
    first = json.loads(next(cache.rglob(f"{OFFLINE_TASK}__*.json")).read_text())

    events = []
    calls, handle = _count_forwards(model)
    try:
        res = evaluate_tasks(model, tok, [OFFLINE_TASK, "tiny_local"], progress=events.append, **args)
    finally:
        handle.remove()
    kinds = [(e.kind, e.task) for e in events]
    assert ("task_cached", OFFLINE_TASK) in kinds and ("task_start", OFFLINE_TASK) not in kinds
    assert ("task_done", "tiny_local") in kinds
    assert res.results[OFFLINE_TASK].cached and not res.results["tiny_local"].cached
    assert res.results[OFFLINE_TASK].metrics == first["result"]["metrics"]
    assert res.results["tiny_local"].n_samples == 4 and calls  # only the unfinished task ran

    # Everything finished: a third call runs nothing at all.
    calls, handle = _count_forwards(model)
    try:
        res3 = evaluate_tasks(model, tok, [OFFLINE_TASK, "tiny_local"], **args)
    finally:
        handle.remove()
    assert not calls and all(r.cached for r in res3.results.values())
    # Another key (here: the seed) is another result, so both run; request events name the running task.
    events = []
    calls, handle = _count_forwards(model)
    try:
        evaluate_tasks(model, tok, [OFFLINE_TASK, "tiny_local"], progress=events.append, **{**args, "seed": 7})
    finally:
        handle.remove()
    assert calls
    running = None
    finished = {}
    for e in events:
        if e.kind == "task_start":
            running = e.task
        elif e.kind == "requests":
            assert e.task == running
            finished[e.task] = (e.done, e.total)
    assert finished == {OFFLINE_TASK: (16, 16), "tiny_local": (12, 12)}  # 4 docs x 4 and x 3 choices


# ------------------------------------------------------------------------------------------- errors


def test_unknown_task_is_a_clear_error(micro):
    model, tok = micro
    with pytest.raises(ValueError, match="unknown task 'moesq_clozee'") as e:
        evaluate_tasks(model, tok, "moesq_clozee", label="m")
    assert "Did you mean: moesq_cloze" in str(e.value) and "--tasks-dir" in str(e.value)


def test_bad_tasks_dir_errors(micro, tmp_path):
    model, tok = micro
    with pytest.raises(FileNotFoundError, match="does not exist"):
        evaluate_tasks(model, tok, OFFLINE_TASK, label="m", tasks_dir=tmp_path / "nope")
    f = tmp_path / "file.yaml"
    f.write_text("task: x\n")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        evaluate_tasks(model, tok, OFFLINE_TASK, label="m", tasks_dir=f)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no task YAML"):
        evaluate_tasks(model, tok, OFFLINE_TASK, label="m", tasks_dir=tmp_path / "empty")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "mine.yaml").write_text("task: mine\n  doc_to_text: [unclosed\n")
    with pytest.raises(ValueError, match="could not be read") as e:
        evaluate_tasks(model, tok, "mine", label="m", tasks_dir=broken)
    assert "mine.yaml" in str(e.value)


def test_local_task_with_missing_data_file(micro, tmp_path):
    model, tok = micro
    d = _local_task_dir(tmp_path, "lost_data")
    (d / "data" / "test.jsonl").unlink()
    with pytest.raises(ValueError, match="could not be loaded.*data files exist"):
        evaluate_tasks(model, tok, "lost_data", label="m", tasks_dir=d)


def test_model_dir_without_tokenizer(micro, tmp_path):
    model, _ = micro
    d = tmp_path / "packed"
    d.mkdir()
    shutil.copy(MICRO / "config.json", d / "config.json")
    with pytest.raises(FileNotFoundError, match="has no tokenizer.*Copy the tokenizer files"):
        load_tokenizer(d)
    with pytest.raises(FileNotFoundError, match="has no tokenizer"):
        evaluate_tasks(model, d, OFFLINE_TASK, label="m", limit=2)
    with pytest.raises(ValueError, match="tokenizer is None"):
        evaluate_tasks(model, None, OFFLINE_TASK, label="m")
    with pytest.raises(ValueError, match="label"):
        evaluate_tasks(model, MICRO, OFFLINE_TASK, label=" ")


def test_hub_task_offline_says_what_to_do(micro, monkeypatch, tmp_path):
    """openllm-v1 tasks need Hub datasets: offline, the error names the task and points to --tasks-dir."""
    import datasets.config

    model, tok = micro
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty-cache"))  # nothing cached here
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty-cache")
    before = datasets.config.HF_HUB_OFFLINE
    with pytest.raises(TaskUnavailableError) as e:
        evaluate_tasks(model, tok, "arc_challenge", label="m", num_fewshot=0, limit=2)
    msg = str(e.value)
    assert "'arc_challenge'" in msg and "--tasks-dir" in msg and "offline" in msg and "ai2_arc" in msg
    assert datasets.config.HF_HUB_OFFLINE == before  # the temporary offline switch was undone


@pytest.mark.slow
def test_hub_task_without_network_says_what_to_do(micro, monkeypatch, tmp_path):
    """No offline switch, but the Hub is unreachable (endpoint pointed at a closed local port)."""
    import datasets.config
    import huggingface_hub.constants as hc

    model, tok = micro
    for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    closed = "http://127.0.0.1:9"
    monkeypatch.setattr(hc, "ENDPOINT", closed)
    monkeypatch.setattr(hc, "HUGGINGFACE_CO_URL_TEMPLATE", closed + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", closed)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty-cache")
    with pytest.raises(TaskUnavailableError, match="'arc_challenge'.*could not be reached.*--tasks-dir"):
        evaluate_tasks(model, tok, "arc_challenge", label="m", num_fewshot=0, limit=2)


# ---------------------------------------------------------------------------------------- recovery


def _res(label: str, scores: dict[str, float], shots: int = 0, limit=None, **extra_metrics) -> TaskResults:
    out = {}
    for task, v in scores.items():
        key = MAIN_METRICS.get(task, "acc,none")
        metric, _, flt = key.partition(",")
        metrics = {key: v, f"{metric}_stderr,{flt}": 0.01, **extra_metrics.get(task, {})}
        out[task] = TaskResult(task=task, metrics=metrics, subtasks={}, num_fewshot=shots, requested_fewshot=shots,
                               n_samples=100, n_docs=100, limit=limit, seed=1234, seconds=1.0)
    return TaskResults(label, out, {"label": label})


def test_recovery_is_ratio_of_averages():
    ref = _res("ref", {"arc_challenge": 0.60, "gsm8k": 0.80, "moesq_cloze": 0.40})
    q = _res("q", {"arc_challenge": 0.30, "gsm8k": 0.80, "moesq_cloze": 0.40})
    t = recovery_table([q, ref], "ref")
    assert [r.label for r in t.rows] == ["ref", "q"] and t.rows[0].is_reference
    assert t.rows[0].recovery == pytest.approx(100.0)
    assert t.row("q").average == pytest.approx(1.5 / 3)
    assert t.row("q").recovery == pytest.approx(100 * (1.5 / 3) / (1.8 / 3))
    ref2 = _res("ref", {"arc_challenge": 0.20, "moesq_cloze": 0.80})
    q2 = _res("q", {"arc_challenge": 0.10, "moesq_cloze": 0.80})
    t2 = recovery_table([ref2, q2], "ref")
    assert t2.row("q").recovery == pytest.approx(90.0)  # (0.45 / 0.50); the mean of ratios would be 75 %
    assert t2.row("q").task_recovery == {"arc_challenge": pytest.approx(50.0), "moesq_cloze": pytest.approx(100.0)}
    assert t2.metrics == {"arc_challenge": "acc_norm,none", "moesq_cloze": "acc,none"}
    assert t2.row("q").stderr["moesq_cloze"] == pytest.approx(0.01)
    assert json.loads(json.dumps(t2.to_dict()))["reference"] == "ref"


def test_recovery_main_metrics_and_overrides():
    assert main_metric_name("gsm8k") == "exact_match,strict-match"
    assert main_metric_name("truthfulqa_mc2") == "acc,none"  # lm-eval reports MC2 under acc
    assert main_metric_name("hellaswag") == "acc_norm,none" and main_metric_name("mmlu") == "acc,none"
    ref = _res("ref", {"gsm8k": 0.5}, **{"gsm8k": {"exact_match,flexible-extract": 0.6}})
    q = _res("q", {"gsm8k": 0.25}, **{"gsm8k": {"exact_match,flexible-extract": 0.45}})
    assert recovery_table([ref, q], "ref").row("q").recovery == pytest.approx(50.0)
    flex = recovery_table([ref, q], "ref", metrics={"gsm8k": "exact_match,flexible-extract"})
    assert flex.row("q").recovery == pytest.approx(75.0)
    other = TaskResult(task="my_task", metrics={"f1,none": 0.3, "acc,none": 0.7}, subtasks={}, num_fewshot=0,
                       requested_fewshot=None, n_samples=1, n_docs=1, limit=None, seed=0, seconds=0)
    assert main_metric_name("my_task", other) == "acc,none"
    with pytest.raises(ValueError, match="no main metric"):
        main_metric_name("my_task")


def test_recovery_missing_tasks_mismatches_and_bad_input():
    ref = _res("ref", {"arc_challenge": 0.5, "moesq_cloze": 0.8})
    partial = _res("partial", {"arc_challenge": 0.4})
    other_shots = _res("shots", {"arc_challenge": 0.5, "moesq_cloze": 0.8}, shots=5)
    t = recovery_table([ref, partial, other_shots], "ref")
    assert t.row("partial").scores["moesq_cloze"] is None
    assert t.row("partial").average is None and t.row("partial").recovery is None
    assert t.row("partial").task_recovery["arc_challenge"] == pytest.approx(80.0)
    assert any("no result for partial" in w for w in t.warnings)
    assert any("evaluated differently" in w and "shots=5" in w for w in t.warnings)
    assert recovery_table([ref, partial], "ref", tasks=["arc_challenge"]).row("partial").recovery == pytest.approx(80)
    with pytest.raises(ValueError, match="reference 'nope' is not among"):
        recovery_table([ref, partial], "nope")
    with pytest.raises(ValueError, match="share the label"):
        recovery_table([ref, ref], "ref")
    with pytest.raises(ValueError, match="no results"):
        recovery_table([], "ref")


# ------------------------------------------------------------------------------------ slow: accuracy


@pytest.mark.slow
def test_offline_task_discriminates_models(micro):
    """Full task: the reference is far above chance (25 %), and magnitude 4:8 + NVFP4 pruning costs accuracy."""
    from moesq_core.formats import get_format

    model, tok = micro
    ref = evaluate_tasks(model, tok, OFFLINE_TASK, label="micro-ref", batch_size=8)
    acc_ref = ref.results[OFFLINE_TASK].metric("acc")
    assert acc_ref > 0.6

    from transformers import AutoModelForCausalLM

    pruned = AutoModelForCausalLM.from_pretrained(str(MICRO), dtype=torch.float32).eval()
    fmt = get_format("p48-nvfp4")
    with torch.no_grad():
        for name, p in pruned.named_parameters():
            if ".experts." in name and p.dim() == 3:
                for e in range(p.shape[0]):
                    p[e] = fmt.quantize(p[e]).dequantize()
    q = evaluate_tasks(pruned, tok, OFFLINE_TASK, label="micro-p48-magnitude", batch_size=8)
    table = recovery_table([ref, q], "micro-ref")
    assert table.row("micro-p48-magnitude").recovery < 97.0
