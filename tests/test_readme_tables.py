"""The README's tables of numbers are rendered from benchmarks/results/*.json and must match them."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _renderer():
    spec = importlib.util.spec_from_file_location("render_readme", ROOT / "benchmarks" / "render_readme.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_tables_match_results():
    mod = _renderer()
    _, changed = mod.render((ROOT / "README.md").read_text())
    assert not changed, f"README tables differ from benchmarks/results: {changed}; run python benchmarks/render_readme.py"


def test_a_hand_edited_number_is_caught():
    mod = _renderer()
    text = (ROOT / "README.md").read_text()
    marker = "<!-- results:run -->"
    i = text.index(marker) + len(marker)
    j = text.index("| reference |", i)
    edited = text[:j] + text[j:].replace("19.058", "19.000", 1)
    _, changed = mod.render(edited)
    assert changed == ["run"]


def test_results_keep_relative_paths():
    for f in (ROOT / "benchmarks" / "results").iterdir():
        text = f.read_text(errors="replace") if f.suffix in (".json", ".md", ".txt") else ""
        for bad in ("/work/", "/home/", "/root/", "/tmp/"):
            assert bad not in text, f"{f.name} holds a machine path ({bad})"
