"""How a pack takes the place of --out (compression/export.py builds it): --out's lock, the marked temp dirs
beside --out, and the swap's recovery. The pack is built in `.<name>.tmp-<token>/pack`; an earlier pack in --out is
renamed to `.<name>.old-<token>/pack`, the new one renamed to --out, then the earlier one removed. A process killed
between those two renames leaves no --out and the earlier pack aside: every moesq command that reads or writes
--out (or a work dir, whose WORKDIR/packed is the default --out) puts it back first (`restore_interrupted_swap`).

--out is taken through its symlinks (`real_out`): a link's target gets the lock and the pack, and the link stays.
Nothing here imports torch: the work dir's lock calls it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
from pathlib import Path

from moesq_core.compression.workdir import LockHeld, pid_alive, take_lock

log = logging.getLogger(__name__)
PACKED_SLOT = "packed"  # the work dir's own pack location (WORKDIR/packed), the default --out


def real_out(out_dir: str | Path) -> Path:
    """The directory a pack into out_dir writes: out_dir with every symlink resolved (a link to a directory, or
    one in its parents), so that any spelling of one directory takes the same lock and a link stays a link."""
    return Path(os.path.realpath(Path(out_dir).expanduser()))


class OutputLocked(FileExistsError):
    """Another moesq process is writing the same --out."""


@contextlib.contextmanager
def out_locked(out_dir: Path):
    """Hold --out's lock: a file beside it (`.<name>.moesq-lock`, removed on release) locked like the work dir's
    (workdir.take_lock). A second pack into the same --out is refused at once, naming the holder's pid."""
    path = out_dir.parent / f".{out_dir.name}.moesq-lock"
    try:  # a file of that name that is not moesq's (it holds a pid or nothing) is neither written nor removed
        foreign = path.is_symlink() or not re.fullmatch(r"\d*\s*", path.read_text(errors="replace")[:64])
    except FileNotFoundError:
        foreign = False
    except OSError:
        foreign = True
    if foreign:
        raise FileExistsError(f"{path} is in the way of --out {out_dir}'s lock file and is not moesq's; move it "
                              "away or choose another --out")
    while True:
        try:
            fd = take_lock(path)
        except LockHeld as e:
            raise OutputLocked(f"--out {out_dir} is being written by another moesq process (pid {e.pid}); wait for "
                               "it to finish, or choose another --out") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder removed the file as this process opened it: lock the new one
    try:
        yield
    finally:
        os.unlink(path)  # before releasing: a process that opened this file sees it is gone and retries
        os.close(fd)


# A pack's temp dirs beside --out (`.<name>.tmp-<token>` while building, `.<name>.old-<token>` holding the pack
# it replaces during the swap) carry this marker, "moesq <pid> <token>": a later pack removes such a dir only
# when the marker proves moesq made it (its token is the dir's) and its process has ended. Other dirs, a user's
# of the same name among them, are never touched.
OWNER_MARKER = ".moesq-owner"


def owned_dir(parent: Path, prefix: str) -> Path:
    """A new dir `<prefix><token>` in parent, marked as this process's."""
    token = secrets.token_hex(8)
    d = parent / f"{prefix}{token}"
    d.mkdir(mode=0o700)
    (d / OWNER_MARKER).write_text(f"moesq {os.getpid()} {token}\n")
    return d


def _stale(d: Path, prefix: str) -> bool:
    """d was made by owned_dir(parent, prefix) of a process that has ended (or of this one)."""
    try:
        tag, pid, token = (d / OWNER_MARKER).read_text().split()
    except (OSError, ValueError):
        return False
    if tag != "moesq" or d.name != prefix + token or not pid.isdigit():
        return False
    return int(pid) == os.getpid() or not pid_alive(int(pid))


def remove_stale(out_dir: Path) -> None:
    """Remove what killed packs into out_dir left beside it (call with --out's lock held). A pack killed between
    the swap's two renames left no out_dir and the earlier pack in its `.old-` dir: that pack is put back."""
    for kind in ("tmp", "old"):
        prefix = f".{out_dir.name}.{kind}-"
        for d in sorted(out_dir.parent.glob(prefix + "*")):
            if not d.is_dir() or d.is_symlink() or not _stale(d, prefix):
                continue
            if kind == "old" and (d / "pack").is_dir() and not out_dir.exists():
                (d / "pack").rename(out_dir)
                log.warning("put back the earlier pack %s that an interrupted `moesq pack --overwrite` had moved "
                            "aside", out_dir)
            shutil.rmtree(d, ignore_errors=True)
            log.info("removed %s, left by an interrupted pack", d)


def restore_interrupted_swap(out_dir: str | Path) -> bool:
    """Put back the earlier pack that a pack killed between the swap's two renames left aside, when out_dir is
    missing; True if it did. A pack still running (holding --out's lock) is left alone, and so is a dir moesq
    cannot prove it made (remove_stale's rule). Cheap when there is nothing to do: out_dir exists, or no
    `.<name>.old-` dir lies beside it."""
    out = real_out(out_dir)
    try:
        if out.exists() or not any(out.parent.glob(f".{out.name}.old-*")):
            return False
        with out_locked(out):
            remove_stale(out)
    except OSError as e:  # held by a running pack (OutputLocked), a read-only parent: not this command's business
        log.info("left %s as it is: %s", out, e)
        return False
    return out.exists()
