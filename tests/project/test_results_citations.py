"""Product code keeps measurements out of its comments and cites the results file that holds them
(benchmarks/results/<file>); every file it cites must exist."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CITED = re.compile(r"benchmarks/results/([\w.\-]+)")


def cited_results(paths: list[Path]) -> list[tuple[Path, str]]:
    """(source, file name) of every benchmarks/results/<file> the sources mention (a sentence's full stop dropped)."""
    return [(p, m.group(1).rstrip(".")) for p in paths for m in CITED.finditer(p.read_text(encoding="utf-8"))]


def test_results_files_cited_by_the_code_exist():
    sources = [p for d in ("moesq_core", "moesq_cli") for p in sorted((ROOT / d).rglob("*.py"))]
    cited = cited_results(sources)
    assert len(cited) >= 5  # the refinement kernels, trainer and serving modules cite theirs
    missing = sorted({f"{p.relative_to(ROOT)}: {name}" for p, name in cited
                      if not (ROOT / "benchmarks" / "results" / name).is_file()})
    assert not missing, f"cited results files that do not exist: {missing}"


def test_a_citation_is_read_up_to_its_file_name(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("# numbers: benchmarks/results/no_such_run_h200.md. (and benchmarks/results/a-b_c.txt, more)\n")
    assert [name for _, name in cited_results([src])] == ["no_such_run_h200.md", "a-b_c.txt"]
