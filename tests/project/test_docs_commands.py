"""Every `moesq …` command line the docs show runs as written: the shell code blocks (```bash, sh, shell,
console) of README.md and of each docs/*.md page (in order, in one directory, as one reader would) and the
"Examples" of every command's --help (in stage order, in one directory that holds a calibrated work dir
`moesq-work`).
Nothing here lists the commands: one added to a page or to a --help later is run too. A block not meant to
run (a listing, an example of output) is fenced as ```text.

A command that needs what the test machine lacks — a GPU (`bench-kernel`, `--kernel`, `--device cuda`) or the
network (a Hub model or dataset id, `--push-to-hub`, lm-eval tasks other than the shipped offline one) — must
fail cleanly instead: exit code 1, one `error:` line, no traceback. Help examples are written so that they
run in seconds on a CPU (small calibration budgets); the README's `moesq run` is the real default run.
"""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moesq_runner import ENV, MOESQ, moesq_here

REPO = Path(__file__).resolve().parents[2]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?(@[\w.:%\[\]-]+)?$")
# minutes of work (the README's real run among them): under pytest-xdist this file starts first (conftest.py)
START_FIRST = True
# the stage order: a later command's examples may use what an earlier one made
ORDER = ["calibrate", "init-sgptq", "refine", "pack", "verify", "eval", "run", "bench-kernel"]


DOC_PAGES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]


def readme_commands(page: str = "README.md") -> list[str]:
    """`moesq …` command lines in a page's shell code blocks (also after `&&`), comments dropped."""
    text = (REPO / page).read_text()
    cmds = []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S):
        if lang not in ("bash", "sh", "shell", "console"):
            continue
        for line in body.splitlines():
            for part in re.split(r"&&|;", line):
                part = part.strip()
                if part.startswith("$ "):
                    part = part[2:]
                if part.startswith("moesq ") or part == "moesq":
                    cmds.append(shlex.join(shlex.split(part, comments=True)))  # quoting kept
    return cmds


def help_examples() -> list[tuple[str, str]]:
    """(command, example) for the lines starting with `moesq ` in each command's help after "Examples", each
    example once."""
    from typer.main import get_command

    from moesq_cli.app import app

    group = get_command(app)
    names = sorted(group.commands, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))
    out = []
    for name in names:
        help_text = group.commands[name].help or ""
        _, found, examples = re.sub(r"\[/?[a-z ]*\]", "", help_text).partition("Examples")
        if found:
            out += [(name, line.strip()) for line in examples.splitlines() if line.strip().startswith("moesq ")]
    first = {}  # an example shown by two commands (`init-sgptq` and its general form `init`) runs once
    for name, example in out:
        first.setdefault(example, name)
    return [(name, example) for example, name in first.items()]


def needs(argv: list[str]) -> str | None:
    """What a command needs that the test machine may lack: 'gpu', 'network' or None."""
    opts = {a: argv[i + 1] if i + 1 < len(argv) else "" for i, a in enumerate(argv)}
    hub_model = any(HUB_ID.match(opts.get(o, "")) and not Path(opts[o]).exists() for o in ("--model", "-m"))
    hub_calib = HUB_ID.match(opts.get("--calib", "")) and not Path(opts["--calib"]).exists()
    tasks = [t for t in opts.get("--tasks", "").split(",") if t]
    if hub_model or hub_calib or "--push-to-hub" in argv or any(t != "moesq_cloze" for t in tasks):
        return "network"
    gpu = (len(argv) > 1 and argv[1] == "bench-kernel") or "--kernel" in argv or \
        opts.get("--device", "").startswith("cuda")
    if gpu and not torch.cuda.is_available():
        return "gpu"
    return None


def run_as_written(cmd: str, cwd: Path) -> None:
    """`cmd` run in `cwd`: in this process (the same app the console script runs; the console script itself is
    tested in tests/cli), or in a subprocess where the command starts processes of its own (`--nproc`)."""
    argv = shlex.split(cmd)
    assert argv[0] == "moesq"
    if "--nproc" in argv:
        r = subprocess.run([MOESQ, *argv[1:]], capture_output=True, text=True, env=ENV, cwd=cwd, timeout=1800)
    else:
        r = moesq_here(*argv[1:], check=False, cwd=cwd)
    out = r.stdout + r.stderr
    assert "Traceback" not in out, f"{cmd}\n{out}"
    lack = needs(argv)
    if lack is None:
        assert r.returncode == 0, f"{cmd} exited {r.returncode}\n{out}"
        return
    # expected to fail here (no GPU / no network): exit 1 with one clear line, nothing half-done
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and len(errors) == 1, f"{cmd} (needs {lack}) exited {r.returncode}\n{out}"
    assert r.stderr.strip().splitlines()[-1] == errors[0], f"{cmd}: the error is not the last line\n{out}"


def test_docs_have_commands():
    assert "moesq run" in readme_commands()
    assert "docs/workdir.md" in DOC_PAGES and "moesq init-sgptq" in readme_commands("docs/workdir.md")
    with_examples = {c for c, _ in help_examples()}
    assert {"calibrate", "init-sgptq", "refine", "run"} <= with_examples


def _helps() -> dict[str, str]:
    from typer.main import get_command

    from moesq_cli.app import app

    return {name: cmd.help or "" for name, cmd in get_command(app).commands.items()}


def test_every_command_shows_examples_of_itself():
    """Each command's --help has an Examples block with a command line of its own (which the test above runs)."""
    for name, text in _helps().items():
        _, found, examples = text.partition("Examples")
        lines = [line.strip() for line in examples.splitlines()]
        assert found and any(line.startswith(f"moesq {name} ") or line == f"moesq {name}" for line in lines), name


def test_init_and_init_sgptq_say_what_tells_them_apart():
    helps = _helps()
    first = {name: helps[name].split("\n\n")[0] for name in ("init", "init-sgptq")}
    assert first["init"] != first["init-sgptq"] and "--method" in first["init"] and "SGPTQ" in first["init-sgptq"]
    for name in ("init", "init-sgptq"):
        assert "`moesq init-sgptq` and `moesq init` are the same command" in helps[name]


def test_json_help_points_at_the_schema():
    from typer.main import get_command

    from moesq_cli.app import app

    assert "\n## JSON output\n" in (REPO / "docs" / "workdir.md").read_text()  # the anchor's heading
    with_json = [p for cmd in get_command(app).commands.values() for p in cmd.params if p.name == "json_out"]
    assert len(with_json) >= 8 and all("docs/workdir.md#json-output" in p.help for p in with_json)


_STAGE_COMMANDS = ("calibrate", "init-sgptq", "init", "refine", "run")


def doc_writes(page: str) -> list[tuple[str, str, str, bool]]:
    """What a page's commands and Python write, in order: ("workdir", dir, model) for a work dir a command makes or
    uses, ("pack", dir, "", overwrite) for a packed model dir (`moesq run` packs into WORKDIR/packed itself)."""
    text = (REPO / page).read_text()
    out: list[tuple[str, str, str, bool]] = []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S):
        if lang == "python":
            for wd in re.findall(r"workdir=\"([^\"]+)\"", body):
                out.append(("workdir", wd, "embedded", False))
            for d, rest in re.findall(r"save_pretrained\(\"([^\"]+)\"([^)]*)\)", body):
                out.append(("pack", d, "", "overwrite=True" in rest))
    for cmd in readme_commands(page):
        argv = shlex.split(cmd)
        opts = {a: argv[i + 1] if i + 1 < len(argv) else "" for i, a in enumerate(argv)}
        positional = [a for i, a in enumerate(argv[2:], 2) if not a.startswith("-") and not argv[i - 1].startswith("-")]
        if argv[1] in _STAGE_COMMANDS:
            wd = opts.get("-w") or opts.get("--workdir") or "moesq-work"
            out.append(("workdir", wd, opts.get("--model") or opts.get("-m") or "embedded", False))
            if argv[1] == "run":
                out.append(("pack", f"{wd}/packed", "", True))
        elif argv[1] == "pack":
            wd = positional[0] if positional else "moesq-work"
            out.append(("pack", opts.get("--out") or opts.get("-o") or f"{wd}/packed", "", "--overwrite" in argv))
    return out


def test_following_the_docs_in_order_writes_no_dir_twice():
    """README.md then each docs page, as one reader in one directory: no command or Python block is refused for
    what an earlier page left there (a work dir made for another model, a pack dir written without --overwrite).
    The Python blocks are not run here (README's runs in a slow test), so their writes are read from the code."""
    made: dict[str, str] = {}  # work dir -> its model
    packed: set[str] = set()
    clashes = []
    for page in DOC_PAGES:
        for kind, d, model, overwrite in doc_writes(page):
            if kind == "workdir":
                if made.setdefault(d, model) != model:
                    clashes.append(f"{page}: work dir {d} for {model}, made earlier for {made[d]}")
            elif d in packed and not overwrite:
                clashes.append(f"{page}: pack into {d}, written earlier, without --overwrite")
            elif kind == "pack":
                packed.add(d)
    assert not clashes, clashes


def test_blocks_fenced_as_text_are_not_run(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\nmoesq run --help   # runs\n```\n\n```text\nmoesq pack   # a listing\n```\n")
    assert readme_commands(str(page)) == ["moesq run --help"]


@pytest.fixture(scope="module")
def reader_dir(tmp_path_factory) -> Path:
    """The one directory a reader works in: the README's `moesq run` first, then each page's commands in turn
    (docs/workdir.md's stage commands then find the stages `moesq run` made, which that page says they check
    rather than recompute)."""
    return tmp_path_factory.mktemp("reader")


@pytest.mark.parametrize("page", DOC_PAGES)
def test_page_commands_run_as_written(page, reader_dir):
    for cmd in readme_commands(page):
        run_as_written(cmd, reader_dir)


@pytest.fixture(scope="module")
def example_dir(tmp_path_factory, micro_path) -> Path:
    """A directory whose `moesq-work` is calibrated with the examples' small budget."""
    d = tmp_path_factory.mktemp("examples")
    moesq_here("calibrate", "--model", micro_path, "-w", d / "moesq-work", "--seq-len", "32", "--n-train", "2",
          "--n-val", "2", "--n-init", "8", "--quiet")
    return d


def test_help_examples_run_as_written(example_dir):
    examples = help_examples()
    for _, cmd in examples:
        run_as_written(cmd, example_dir)


@pytest.mark.parametrize("argv, want", [
    ("moesq refine --model Qwen/Qwen3-30B-A3B", "network"),
    ("moesq calibrate --calib allenai/c4:en@train", "network"),
    ("moesq pack moesq-work --push-to-hub me/x", "network"),
    ("moesq eval moesq-work --tasks moesq_cloze", None),
    ("moesq eval moesq-work --tasks arc_easy", "network"),
    ("moesq init-sgptq --model ./local/dir", None),
])
def test_needs_classifies(argv, want):
    assert needs(shlex.split(argv)) == want


def test_examples_fail_cleanly_without_gpu_or_network(tmp_path):
    """The help examples that need the network or a GPU really are refused here with one line."""
    lacking = [c for _, c in help_examples() if needs(shlex.split(c))]
    if not lacking:
        pytest.skip("every example runs on this machine")
    assert any("Qwen/Qwen3-30B-A3B" in c for c in lacking)
    shutil.rmtree(tmp_path)
    tmp_path.mkdir()
    for cmd in lacking:
        run_as_written(cmd, tmp_path)
    assert not any(tmp_path.iterdir())  # nothing was created by a refused command


@pytest.mark.slow
def test_readme_python_example_runs_as_written(tmp_path):
    """The README's Python block, run as a script from a directory holding the recipes it names."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    assert len(blocks) == 1
    shutil.copytree(REPO / "recipes", tmp_path / "recipes")
    (tmp_path / "example.py").write_text(blocks[0])
    r = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=ENV,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("The capital of France is"), r.stdout
    assert (tmp_path / "micro-p48" / "moesq_pack.json").is_file()
