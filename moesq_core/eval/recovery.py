"""The accuracy table: one row per model, one column per task, the average and recovery vs the reference.

Each task contributes its main metric (below). Recovery follows the paper: the ratio of averages,
100 · mean_t(score_model,t) / mean_t(score_reference,t), not the mean of per-task ratios. Scores are the
fractions lm-eval reports (0..1); averages too; recovery is in percent. Rendering is the CLI's business.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from moesq_core.eval.lm_eval_tasks import TaskResult, TaskResults

# Main metric per task, as lm-eval names it. truthfulqa_mc2 reports its MC2 score under "acc". gsm8k: the
# strict-match filter (the answer after "####", as in the paper's public release); flexible-extract is kept
# in the JSON results. The moesq_cloze choices differ in one word only, so plain summed log-likelihood (acc)
# compares like with like.
MAIN_METRICS: dict[str, str] = {
    "arc_challenge": "acc_norm,none",
    "arc_easy": "acc_norm,none",
    "hellaswag": "acc_norm,none",
    "mmlu": "acc,none",
    "truthfulqa_mc2": "acc,none",
    "winogrande": "acc,none",
    "gsm8k": "exact_match,strict-match",
    "moesq_cloze": "acc,none",
}
# For other tasks: the first of these that the task reports.
FALLBACK_METRICS = ("acc_norm,none", "acc,none", "exact_match,strict-match", "exact_match,none", "f1,none")


def main_metric_name(task: str, result: TaskResult | None = None, overrides: Mapping[str, str] | None = None) -> str:
    """The metric key used for `task` in the table."""
    if overrides and task in overrides:
        name = overrides[task]
        return name if "," in name else f"{name},none"
    if task in MAIN_METRICS:
        return MAIN_METRICS[task]
    if result is not None:
        for name in FALLBACK_METRICS:
            if name in result.metrics:
                return name
        names = result.metric_names()
        if names:
            return names[0]
    raise ValueError(f"no main metric known for task {task!r}; pass metrics={{{task!r}: 'acc'}} (or another "
                     "metric the task reports)")


@dataclass
class Row:
    label: str
    scores: dict[str, float | None]  # task -> main metric (fraction); None where the model lacks the task
    stderr: dict[str, float | None]
    average: float | None  # mean over all table tasks; None unless the model has every one
    recovery: float | None  # percent: 100 · average / reference average
    task_recovery: dict[str, float | None]  # percent per task (for reading only; not the paper's number)
    is_reference: bool = False


@dataclass
class Table:
    tasks: list[str]
    metrics: dict[str, str]  # task -> metric key used
    reference: str
    rows: list[Row]
    warnings: list[str] = field(default_factory=list)  # e.g. models evaluated with different shots or limits

    def row(self, label: str) -> Row:
        for r in self.rows:
            if r.label == label:
                return r
        raise KeyError(f"no row {label!r}; rows: {', '.join(r.label for r in self.rows)}")

    def to_dict(self) -> dict:
        return asdict(self)


def _mean(values: Sequence[float | None]) -> float | None:
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)  # type: ignore[arg-type]


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return 100.0 * a / b


def recovery_table(
    results: Sequence[TaskResults],
    reference_label: str,
    *,
    tasks: Sequence[str] | None = None,
    metrics: Mapping[str, str] | None = None,
) -> Table:
    """Build the table. Columns: `tasks`, or every task any model has, in first-seen order.

    The reference row comes first, the others in the given order. `metrics` overrides the main metric of a
    task (bare names such as "acc_norm" mean the "none" filter).
    """
    if not results:
        raise ValueError("no results to tabulate")
    labels = [r.label for r in results]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise ValueError(f"two result sets share the label(s) {', '.join(dupes)}; give each model its own label")
    if reference_label not in labels:
        raise ValueError(f"reference {reference_label!r} is not among the results ({', '.join(labels)}); "
                         "evaluate the reference model too, or name one of these")
    if tasks is None:
        tasks = list(dict.fromkeys(t for r in results for t in r.results))
    tasks = list(tasks)
    if not tasks:
        raise ValueError("no tasks to tabulate")

    # One metric per column, taken from whichever model has the task.
    metric_of: dict[str, str] = {}
    for t in tasks:
        sample = next((r.results[t] for r in results if t in r.results), None)
        metric_of[t] = main_metric_name(t, sample, metrics)

    warnings: list[str] = []
    for t in tasks:
        setups = {(x.results[t].num_fewshot, x.results[t].limit, x.results[t].seed)
                  for x in results if t in x.results}
        if len(setups) > 1:
            desc = "; ".join(f"{x.label}: shots={x.results[t].num_fewshot} limit={x.results[t].limit} "
                             f"seed={x.results[t].seed}" for x in results if t in x.results)
            warnings.append(f"{t}: models were evaluated differently ({desc}); recovery is not comparable")
        missing = [x.label for x in results if t not in x.results]
        if missing:
            warnings.append(f"{t}: no result for {', '.join(missing)}; their average and recovery are left out")

    def scores_of(r: TaskResults) -> tuple[dict, dict]:
        sc, se = {}, {}
        for t in tasks:
            res = r.results.get(t)
            if res is None:
                sc[t] = se[t] = None
                continue
            if metric_of[t] not in res.metrics:
                raise ValueError(f"{r.label}: task {t!r} has no metric {metric_of[t]!r} (it has "
                                 f"{', '.join(res.metric_names())}); pass metrics={{{t!r}: ...}}")
            sc[t] = float(res.metrics[metric_of[t]])
            se[t] = res.stderr(metric_of[t])
        return sc, se

    ordered = sorted(results, key=lambda r: r.label != reference_label)  # stable: reference first
    ref_scores, _ = scores_of(next(r for r in results if r.label == reference_label))
    ref_avg = _mean([ref_scores[t] for t in tasks])
    rows = []
    for r in ordered:
        sc, se = scores_of(r)
        avg = _mean([sc[t] for t in tasks])
        rows.append(Row(
            label=r.label, scores=sc, stderr=se, average=avg, recovery=_ratio(avg, ref_avg),
            task_recovery={t: _ratio(sc[t], ref_scores[t]) for t in tasks},
            is_reference=r.label == reference_label,
        ))
    return Table(tasks=tasks, metrics=metric_of, reference=reference_label, rows=rows, warnings=warnings)


__all__ = ["FALLBACK_METRICS", "MAIN_METRICS", "Row", "Table", "main_metric_name", "recovery_table"]
