"""What `moesq pack` leaves and removes beside --out: its locks (the work dir's and --out's), the temp dirs of a
killed pack (removed only when their marker proves moesq made them and their process ended), and the earlier
pack an interrupted --overwrite moved aside (removed, or put back when the swap had not finished)."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from moesq_core.compression import pack_swap
from moesq_core.compression.export import export_packed
from moesq_core.compression.workdir import WorkDir, WorkDirLocked

from conftest import REPO
from moesq_runner import moesq, moesq_here


def _digests(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _marked(parent, prefix, pid):
    """A dir made the way pack makes its temp dirs, recorded as process pid's."""
    d = pack_swap.owned_dir(parent, prefix)
    (d / "pack").mkdir()
    (d / "pack" / "model.safetensors").write_bytes(b"half a pack")
    token = d.name.removeprefix(prefix)
    (d / pack_swap.OWNER_MARKER).write_text(f"moesq {pid} {token}\n")
    return d


def test_only_provably_stale_temp_dirs_are_removed(packs, tmp_path):
    wd, _, _ = packs["dense-nvfp4"]
    out = tmp_path / "model"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        users = tmp_path / ".model.tmp-mine"  # a user's dir with a temp dir's name
        users.mkdir()
        (users / "notes.txt").write_text("mine")
        forged = _marked(tmp_path, ".model.tmp-", _dead_pid())  # a marker whose token is not its dir's
        forged = forged.rename(tmp_path / ".model.tmp-renamed")
        running = _marked(tmp_path, ".model.tmp-", live.pid)  # a live pack's temp dir
        dead = _marked(tmp_path, ".model.tmp-", _dead_pid())
        dead_old = _marked(tmp_path, ".model.old-", _dead_pid())
        shutil.rmtree(dead_old / "pack")  # killed before it moved an earlier pack in (one would be put back)
        export_packed(wd, "init-rtn", out)
        assert (users / "notes.txt").read_text() == "mine" and forged.is_dir()
        assert (running / "pack" / "model.safetensors").is_file()
        assert not dead.exists() and not dead_old.exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".model.tmp-mine", ".model.tmp-renamed",
                                                                     running.name, "model"])
    finally:
        live.kill()
        live.wait()


def test_a_second_pack_into_the_same_out_is_refused_naming_the_holder(packs, tmp_path):
    wd = packs["p48-nvfp4"][0].root
    out = tmp_path / "model"
    with pack_swap.out_locked(out):  # this test process packs into --out
        r = moesq("pack", wd, "--out", out, "--quiet", check=False)
        err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode == 1 and len(err) == 1 and f"pid {os.getpid()}" in err[0] and "--out" in err[0]
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the lock file goes with the lock
    lock = tmp_path / ".model.moesq-lock"
    # no other process holds the lock from here on: the packs run in this process
    lock.write_text("a user's file of the lock's name")  # neither written nor removed
    r = moesq_here("pack", wd, "--out", out, "--quiet", check=False)
    assert r.returncode == 1 and "is not moesq's" in r.stderr and lock.read_text().startswith("a user's")
    lock.unlink()
    lock.write_text("4194304\n")  # what a killed pack leaves: taken and removed
    moesq_here("pack", wd, "--out", out, "--quiet")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_pack_takes_the_work_dirs_lock(packs, tmp_path):
    wd = packs["s24-fp8"][0]
    with WorkDir(wd.root).locked():  # another command writing the work dir (this process)
        r = moesq("pack", wd.root, "--out", tmp_path / "model", "--quiet", check=False)
    assert r.returncode == 1 and f"in use by another moesq process (pid {os.getpid()})" in r.stderr
    assert not (tmp_path / "model").exists()
    with pytest.raises(WorkDirLocked):  # the library call too, while another process holds the lock
        _export_while_locked(wd, tmp_path)
    assert not (tmp_path / "model").exists()


def _export_while_locked(wd, tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from moesq_core.compression.workdir import WorkDir
        with WorkDir({str(wd.root)!r}).locked():
            print("locked", flush=True)
            sys.stdin.readline()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        export_packed(wd, "init-rtn", tmp_path / "model")
    finally:
        holder.stdin.close()
        holder.wait()


KILL_DURING_SWAP = """
import os, pathlib, sys
from moesq_core.compression.export import export_packed
from moesq_core.compression.workdir import WorkDir

wd, out, when = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
rename = pathlib.Path.rename
def killed_after(self, target):  # SIGKILL semantics: no finally, no cleanup
    done = rename(self, target)
    moved_aside = pathlib.Path(target).name == "pack" and ".old-" in pathlib.Path(target).parent.name
    if (when == "aside" and moved_aside) or (when == "swapped" and pathlib.Path(target) == out):
        os._exit(137)
    return done
pathlib.Path.rename = killed_after
export_packed(WorkDir(wd), "init-rtn", out, overwrite=True, sparse_layout=False)
"""


@pytest.mark.parametrize("when", ["aside", "swapped"])
def test_a_kill_during_the_overwrite_swap_loses_nothing_and_leaves_nothing(packs, tmp_path, when):
    """Killed after moving the earlier pack aside (the new one not yet in place), or after the swap (before the
    earlier pack was removed): the next pack puts back or removes the earlier pack; no `.old-` copy stays."""
    wd, first, _ = packs["p48-nvfp4"]
    out = tmp_path / "model"
    shutil.copytree(first, out)
    r = subprocess.run([sys.executable, "-c", KILL_DURING_SWAP, str(wd.root), str(out), when],
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
    assert r.returncode == 137
    olds = [p for p in tmp_path.iterdir() if p.name.startswith(".model.old-")]
    assert len(olds) == 1 and (olds[0] / "pack" / "moesq_pack.json").is_file()
    assert out.exists() == (when == "swapped")
    if when == "aside":  # a pack without --overwrite puts the earlier pack back, then refuses to replace it
        with pytest.raises(FileExistsError, match="--overwrite"):
            export_packed(wd, "init-rtn", out)
        assert _digests(out) == _digests(first)
    export_packed(wd, "init-rtn", out, overwrite=True)
    assert _digests(out) == _digests(first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def _left_aside(first, out):
    """The state a pack killed between the swap's two renames leaves: no `out`, the earlier pack in a marked
    `.old-` dir of a process that has ended."""
    aside = pack_swap.owned_dir(out.parent, f".{out.name}.old-")
    shutil.copytree(first, aside / "pack")
    (aside / pack_swap.OWNER_MARKER).write_text(f"moesq {_dead_pid()} {aside.name.split('.old-')[1]}\n")
    return aside


def test_the_next_command_puts_back_a_pack_a_killed_swap_left_aside(packs, tmp_path):
    """Not only the next pack: `moesq verify` / `generate` / `eval` on --out (and verify_packed_dir), and any
    command on the work dir for its WORKDIR/packed, put the earlier pack back first."""
    from moesq_core.checkpoint.verify import verify_packed_dir
    from moesq_core.compression.pipeline import _command_lock
    from moesq_core.eval.runner import resolve_targets

    from moesq_runner import moesq_here

    wd, first, _ = packs["p48-nvfp4"]
    out = tmp_path / "model"
    for command in (verify_packed_dir, lambda p: resolve_targets([str(p)]),
                    lambda p: moesq_here("verify", p, "--checksums-only", "--quiet")):
        _left_aside(first, out)
        command(out)
        assert _digests(out) == _digests(first) and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
        shutil.rmtree(out)
    root = tmp_path / "wd"
    shutil.copytree(wd.root, root, ignore=shutil.ignore_patterns("packed", ".packed.*"))
    _left_aside(first, root / "packed")
    with _command_lock(WorkDir(root)):  # what every command on a work dir takes first
        assert _digests(root / "packed") == _digests(first)
    assert not [p for p in root.iterdir() if p.name.startswith(".packed.")]


def test_out_through_a_symlink_locks_and_fills_its_target(packs, tmp_path):
    """--out given as a link: the lock is the target's (a pack into the target directly is refused while it is
    held), and the pack goes into the target; the link stays a link."""
    wd, first, _ = packs["dense-nvfp4"]
    target, link = tmp_path / "real" / "model", tmp_path / "link"
    shutil.copytree(first, target)
    link.symlink_to(target, target_is_directory=True)
    with pack_swap.out_locked(target):  # another pack writing the target
        with pytest.raises(pack_swap.OutputLocked, match="another moesq process"):
            export_packed(wd, "init-rtn", link, overwrite=True)
    summary = export_packed(wd, "init-rtn", link, overwrite=True, sparse_layout=False)
    assert link.is_symlink() and link.resolve() == target.resolve() and summary["path"] == str(link)
    assert (target / "moesq_pack.json").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["model"]
