"""Paths read from files moesq did not necessarily write (a work dir's manifest, a pack's checksum manifest and
index, a saved-states record) are joined to their directory only through `inside`: a crafted entry must not
make moesq read, hash or delete anything outside that directory. Also what a model source names
(`model_dir_or_hub_id`), checked before torch is imported."""
from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath


class UnsafePathError(ValueError):
    """A path entry that would leave its directory (absolute, with `..`, or through a symlink)."""


def inside(root: str | Path, relpath: object, what: str) -> Path:
    """root / relpath, after checking that it stays inside root: relpath is a non-empty relative path without
    `..` parts, and neither it nor a symlink on the way resolves outside root (or to root itself); in a
    Hugging Face Hub cache snapshot (…/snapshots/<revision>), whose files are symlinks into the repo's blobs/,
    inside that repo's cache directory.
    what names the entry in the one-line UnsafePathError otherwise."""
    root = Path(root)
    if not isinstance(relpath, str) or not relpath.strip():
        raise UnsafePathError(f"{what}: {relpath!r} is not a file name; refusing to use it")
    parts = PurePosixPath(relpath.replace("\\", "/"))
    if parts.is_absolute() or os.path.isabs(relpath) or ".." in parts.parts or "\0" in relpath:
        raise UnsafePathError(f"{what}: {relpath!r} points outside {root} (absolute or with '..'); refusing to use it")
    real_root = os.path.realpath(root)
    real = os.path.realpath(root / relpath)
    if real == real_root:
        raise UnsafePathError(f"{what}: {relpath!r} is {root} itself, not a file in it; refusing to use it")
    if os.path.commonpath([_containing(real_root), real]) != _containing(real_root):
        raise UnsafePathError(
            f"{what}: {relpath!r} resolves to {real}, outside {root} (a symlink?); refusing to use it"
        )
    return root / relpath


def _containing(real_root: str) -> str:
    """The directory a file of real_root must resolve into: real_root, or the repo cache dir of a Hub snapshot."""
    root = Path(real_root)
    if root.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", root.name):
        return str(root.parent.parent)
    return real_root


def model_dir_or_hub_id(source: str) -> Path | None:
    """The local model directory `source` names, or None for a Hub id (org/name) that is not a local path.
    FileNotFoundError, saying what to pass, when it is neither (a missing path, a directory without config.json)."""
    p = Path(source).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{source} exists but has no config.json; pass a model directory or a Hub id")
        return p
    if source.count("/") != 1 or source.startswith((".", "/")):
        raise FileNotFoundError(f"model {source!r}: no such directory, and it is not a Hub id of the form org/name")
    return None
