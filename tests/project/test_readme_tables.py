"""The tables of numbers in README.md and docs/*.md are rendered from benchmarks/results/*.json and must match them."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _renderer():
    spec = importlib.util.spec_from_file_location("render_readme", ROOT / "benchmarks" / "render_readme.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_page_matches_results():
    mod = _renderer()
    rendered = mod.render_pages()  # also refuses a table that sits on no page
    assert {p.name for p in rendered} >= {"README.md", "accuracy.md", "workdir.md", "serving.md"}
    stale = {p.name: changed for p, (_, changed) in rendered.items() if changed}
    assert not stale, f"tables differ from benchmarks/results: {stale}; run python benchmarks/render_readme.py"


def test_a_docs_page_links_results_from_its_folder():
    mod = _renderer()
    page = ROOT / "docs" / "serving.md"
    text, _ = mod.render(page.read_text(), page)
    block = text[text.index("<!-- results:decode -->"):text.index("<!-- /results:decode -->")]
    links = [m for m in block.split("](")[1:]]
    assert links and all(link.startswith("../benchmarks/results/") for link in links)
    for link in links:
        assert (page.parent / link.split(")")[0]).exists()


def test_a_marker_naming_no_table_is_refused():
    import pytest

    mod = _renderer()
    with pytest.raises(SystemExit, match="names no table"):
        mod.render("<!-- results:no-such-table -->\n<!-- /results:no-such-table -->\n")


def test_a_hand_edited_number_is_caught():
    mod = _renderer()
    text = (ROOT / "README.md").read_text()
    marker = "<!-- results:run -->"
    i = text.index(marker) + len(marker)
    j = text.index("| reference |", i)
    edited = text[:j] + text[j:].replace("19.058", "19.000", 1)
    _, changed = mod.render(edited)
    assert changed == ["run"]
    page = ROOT / "docs" / "accuracy.md"
    text = page.read_text()
    i = text.index("<!-- results:accuracy-methods -->")
    j = text.index("| reference |", i)
    _, changed = mod.render(text[:j] + text[j:].replace("19.06", "19.60", 1), page)
    assert changed == ["accuracy-methods"]


def test_results_keep_relative_paths():
    for f in (ROOT / "benchmarks" / "results").iterdir():
        text = f.read_text(errors="replace") if f.suffix in (".json", ".md", ".txt") else ""
        for bad in ("/work/", "/home/", "/root/", "/tmp/"):
            assert bad not in text, f"{f.name} holds a machine path ({bad})"


def test_the_run_table_has_the_rows_moesq_run_prints():
    """README's `moesq run` table is the table the command prints for the recorded run: its rows, labels and
    numbers (the run's recorded report, rendered by the CLI's own table code)."""
    import json

    from moesq_cli.app import run_table

    mod = _renderer()
    report = json.loads((ROOT / "benchmarks" / "results" / mod.RUN_FILE).read_text())
    printed = run_table(report)
    cli_rows = [list(cells) for cells in zip(*(c._cells for c in printed.columns))]
    text = (ROOT / "README.md").read_text()
    block = text[text.index("<!-- results:run -->"):text.index("<!-- /results:run -->")]
    readme_rows = [[c.strip() for c in line.strip("|").split("|")] for line in block.splitlines()
                   if line.startswith("| ") and not line.startswith("| model ")]
    assert readme_rows == cli_rows and len(cli_rows) >= 4
    machine = report["machine"]
    assert f"{report['wall_seconds']:.0f} s on {machine['cpu_count']} cores" in block  # the time says on what
