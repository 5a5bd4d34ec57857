"""The checksum manifest of a packed directory (`moesq_pack.json`) and the digests it records.

Every file of the directory is listed with its sha256 and size; a safetensors file also gets the sha256 of its
header (the 8-byte length, the JSON and its padding) and of each tensor's bytes, so that a changed byte is
traced to the tensor that holds it (the header gives every tensor's byte range). The manifest checksums
itself: it is canonical JSON (sorted keys, fixed indent) whose `manifest_sha256` covers everything else, and
the file must equal that canonical text byte for byte, so no byte of it can change unnoticed either.

The manifest is also how `moesq pack --overwrite` recognises a directory it may replace: a directory holding
exactly the files its manifest lists (and the manifest).
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moesq_core.naming import loaders_read
from moesq_core.paths import UnsafePathError, inside

PACK_MANIFEST = "moesq_pack.json"
MANIFEST_VERSION = 1
_CHUNK = 1 << 22


def canonical(body: dict) -> bytes:
    return (json.dumps(body, sort_keys=True, indent=1) + "\n").encode()


def safetensors_layout(path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """(bytes before the data, {tensor: (start, end) within the data}), from the header alone."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > 100_000_000:
            raise ValueError(f"header length {n} is implausible")
        raw = f.read(n)
    if len(raw) != n:
        raise ValueError("truncated header")
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    ranges = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        ranges[name] = (int(start), int(end))
    return 8 + n, ranges


def file_digest(path: Path) -> dict:
    """{"sha256", "bytes"} and, for a .safetensors file, "header" and "tensors" {name: sha256}."""
    path = Path(path)
    whole = hashlib.sha256()
    size = path.stat().st_size
    if path.suffix != ".safetensors":
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                whole.update(chunk)
        return {"sha256": whole.hexdigest(), "bytes": size}
    data_start, ranges = safetensors_layout(path)
    tensors = {}
    with open(path, "rb") as f:
        head = f.read(data_start)
        whole.update(head)
        header_sha = hashlib.sha256(head).hexdigest()
        pos = 0
        # Tensors in data order cover the data contiguously (safetensors checks that when it opens a file);
        # bytes outside every range, if any, still count in the whole-file hash.
        for name, (start, end) in sorted(ranges.items(), key=lambda kv: kv[1]):
            if start > pos:
                whole.update(f.read(start - pos))
                pos = start
            h = hashlib.sha256()
            left = end - start
            while left > 0:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    break
                h.update(chunk)
                whole.update(chunk)
                left -= len(chunk)
            pos = end
            tensors[name] = h.hexdigest()
        while chunk := f.read(_CHUNK):
            whole.update(chunk)
    return {"sha256": whole.hexdigest(), "bytes": size, "header": header_sha, "tensors": tensors}


def write_manifest(root: Path, summary: dict) -> dict:
    """Digest every file under root (the manifest itself excluded) and write the manifest; returns it."""
    root = Path(root)
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != PACK_MANIFEST:
            files[p.relative_to(root).as_posix()] = file_digest(p)
    body = {"moesq_pack": MANIFEST_VERSION, "summary": summary, "files": files}
    body["manifest_sha256"] = hashlib.sha256(canonical(body)).hexdigest()
    (root / PACK_MANIFEST).write_bytes(canonical(body))
    return body


def read_manifest(root: Path) -> dict:
    """The manifest, checked against its own checksum; ValueError says what is wrong."""
    raw = (Path(root) / PACK_MANIFEST).read_bytes()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if (not isinstance(body, dict) or body.get("moesq_pack") != MANIFEST_VERSION
            or not isinstance(body.get("files"), dict)):
        raise ValueError(f"not a moesq pack manifest (version {MANIFEST_VERSION})")
    recorded = body.pop("manifest_sha256", None)
    if hashlib.sha256(canonical(body)).hexdigest() != recorded:
        raise ValueError("its content does not match its manifest_sha256 (edited or corrupted)")
    body["manifest_sha256"] = recorded
    if canonical(body) != raw:
        raise ValueError("its bytes differ from the canonical form moesq writes (edited or corrupted)")
    _check_entry_types(body)
    return body


def _check_entry_types(body: dict) -> None:
    """Each entry of the JSON type moesq writes (a manifest that checksums itself may still have been written
    by hand): ValueError naming the first that is not."""
    def expect(value, kind: type, where: str, what: str) -> None:
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"{where} is {json.dumps(value)[:40]}, expected {what}")

    if "summary" in body:
        expect(body["summary"], dict, "summary", "an object")
    for rel, want in body["files"].items():
        where = f"files[{rel!r}]"
        expect(want, dict, where, "an object")
        expect(want.get("sha256"), str, f"{where}.sha256", "a hex digest")
        expect(want.get("bytes"), int, f"{where}.bytes", "a byte count")
        if "header" in want or "tensors" in want:
            expect(want.get("header"), str, f"{where}.header", "a hex digest")
            expect(want.get("tensors"), dict, f"{where}.tensors", "an object")
            for name, digest in want["tensors"].items():
                expect(digest, str, f"{where}.tensors[{name!r}]", "a hex digest")


def is_moesq_pack(root: Path) -> bool:
    """True when root holds a moesq manifest and nothing but the files it lists (the contents may differ:
    a damaged earlier pack may still be replaced)."""
    root = Path(root)
    try:
        body = json.loads((root / PACK_MANIFEST).read_text())
        listed = set(body["files"])
    except Exception:
        return False
    if body.get("moesq_pack") != MANIFEST_VERSION:
        return False
    for p in root.rglob("*"):
        rel = p.relative_to(root).as_posix()
        if p.is_dir():
            if not any(f.startswith(rel + "/") for f in listed):
                return False
        elif rel != PACK_MANIFEST and rel not in listed:
            return False
    return True


TENSOR_CHANGED = "checksum mismatch: this tensor's bytes changed after packing"


@dataclass
class ChecksumProblem:
    file: str
    tensor: str | None
    problem: str


@dataclass
class ChecksumResult:
    present: bool
    problems: list[ChecksumProblem] = field(default_factory=list)
    changed_tensors: set[str] = field(default_factory=set)
    extra_files: list[str] = field(default_factory=list)
    files_checked: int = 0


def _check_file(root: Path, rel: str, want: dict, whole: bool = True) -> tuple[bool, list[ChecksumProblem]]:
    """(whether the file was there to check, what is wrong with it): a listed file against its recorded digests.
    whole=False skips the tensors' bytes of a safetensors file (its size and header are checked; a loader checks
    each tensor as it reads it, see ManifestCheck)."""
    try:
        p = inside(root, rel, f"{PACK_MANIFEST} entry")
    except UnsafePathError as e:
        return False, [ChecksumProblem(rel, None, str(e))]
    if not p.is_file():
        return False, [ChecksumProblem(rel, None, "listed in the checksum manifest but missing")]
    return True, _compare(p, rel, want, whole)


def _compare(p: Path, rel: str, want: dict, whole: bool) -> list[ChecksumProblem]:
    if p.stat().st_size != want.get("bytes"):
        return [ChecksumProblem(rel, None, f"size is {p.stat().st_size} bytes, the pack wrote {want.get('bytes')}")]
    try:
        if "tensors" not in want:
            got = {"sha256": file_digest(p)["sha256"]}
        elif whole:
            got = file_digest(p)
        else:
            data_start, _ = safetensors_layout(p)
            with open(p, "rb") as f:  # no whole-file hash; the tensors are taken as recorded (checked when read)
                header = hashlib.sha256(f.read(data_start)).hexdigest()
                got = {"sha256": None, "header": header, "tensors": want["tensors"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [ChecksumProblem(rel, None, f"checksum mismatch; its safetensors header is unreadable ({e})")]
    if got["sha256"] == want.get("sha256"):
        return []
    if "tensors" not in want:
        return [ChecksumProblem(rel, None, "checksum mismatch: the file changed after packing")]
    problems = []
    if got["header"] != want.get("header"):
        problems.append(ChecksumProblem(rel, None, "checksum mismatch in the safetensors header (tensor names, "
                                        "dtypes, shapes or offsets changed)"))
    changed = [n for n, h in want["tensors"].items() if got["tensors"].get(n) != h]
    problems += [ChecksumProblem(rel, n, TENSOR_CHANGED) for n in changed]
    if whole and not problems:
        problems.append(ChecksumProblem(rel, None, "checksum mismatch outside every tensor's bytes"))
    return problems


def _unlisted(root: Path, listed) -> tuple[list[ChecksumProblem], list[str]]:
    """(problems for the unlisted files that loaders read, the other unlisted files)."""
    extra = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                   if p.is_file() and p.name != PACK_MANIFEST and p.relative_to(root).as_posix() not in listed)
    read = [ChecksumProblem(f, None, "not listed in the checksum manifest, and loaders read it (added after "
                            "packing?)") for f in extra if loaders_read(f)]
    return read, [f for f in extra if not loaders_read(f)]


def check_manifest(root: Path) -> ChecksumResult:
    """Compare every listed file with its recorded digests, naming the changed file and tensor(s); an unlisted
    file that loaders read is a problem too, other unlisted files are only listed (extra_files)."""
    root = Path(root)
    if not (root / PACK_MANIFEST).is_file():
        return ChecksumResult(False)
    res = ChecksumResult(True)
    try:
        body = read_manifest(root)
    except (OSError, ValueError) as e:
        res.problems.append(ChecksumProblem(PACK_MANIFEST, None, f"checksum manifest is damaged: {e}"))
        return res
    for rel, want in sorted(body["files"].items()):
        checked, problems = _check_file(root, rel, want)
        res.files_checked += checked
        res.problems += problems
        res.changed_tensors.update(p.tensor for p in problems if p.tensor)
    unlisted_read, res.extra_files = _unlisted(root, set(body["files"]))
    res.problems += unlisted_read
    return res


class ManifestCheck:
    """Checks a pack against its manifest while a loader reads it, so that what is loaded is what `moesq pack`
    wrote: on creation the manifest itself, every listed file's size, the small files' hashes and the
    safetensors headers, and that no unlisted file a loader reads is there; then each tensor's bytes as the
    loader reads them (`tensor`), and at the end that every listed tensor was read (`finish`). A header and all
    its tensors cover a safetensors file exactly (safetensors checks that on opening), so this checks every
    byte once, without reading the weights twice. Problems raise ValueError naming the file and tensor."""

    def __init__(self, root: Path):
        self.root = Path(root)
        if not (self.root / PACK_MANIFEST).is_file():
            self._fail(PACK_MANIFEST, None, "missing: a moesq pack lists its files' checksums there (deleted, or "
                       "written by another tool?)")
        try:
            body = read_manifest(self.root)
        except (OSError, ValueError) as e:
            self._fail(PACK_MANIFEST, None, f"checksum manifest is damaged: {e}")
        self.files = body["files"]
        problems = [p for rel, want in sorted(self.files.items())
                    for p in _check_file(self.root, rel, want, whole=False)[1]]
        problems += _unlisted(self.root, set(self.files))[0]
        if problems:
            self._fail(problems[0].file, problems[0].tensor, problems[0].problem)
        self.unread = {(rel, n) for rel, want in self.files.items() for n in want.get("tensors", {})}

    def _fail(self, file: str, tensor: str | None, problem: str):
        where = f"{file}: {tensor}" if tensor else file
        raise ValueError(f"{self.root}: {where}: {problem}; run `moesq verify {self.root}` (or load with "
                         "verify=False / --no-verify to load it anyway)")

    def tensor(self, file: str, name: str, t) -> None:
        """Check the bytes of tensor `name` as read from `file` (a torch tensor, as stored)."""
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        want = self.files.get(file, {}).get("tensors", {}).get(name)
        if want is None or hashlib.sha256(data).hexdigest() != want:
            self._fail(file, name, TENSOR_CHANGED if want is not None else "not listed in the checksum manifest")
        self.unread.discard((file, name))

    def finish(self) -> int:
        """After loading: every listed tensor was read and checked; returns the number of files checked."""
        if self.unread:
            file, name = min(self.unread)
            self._fail(file, name,
                       f"listed in the checksum manifest but not read by the loader ({len(self.unread)} such)")
        return len(self.files)
