"""Build and load `native/` (libmoesq_s24.so: the grouped 2:4 sparse FP8 GEMM for Hopper).

    python -m moesq_core.kernels.native_build            # build (incremental, parallel), print the .so path
    python -m moesq_core.kernels.native_build --check    # also load it and check the GPU

Needs nvcc (CUDA >= 12.3; 13.0 is what we build with) and the CUTLASS 4.2 headers, found in this order:
$MOESQ_CUTLASS_DIR (a CUTLASS checkout or the wheel's `cutlass_library/source`), the installed
`nvidia-cutlass` wheel (`pip install -e .[native]`), or a `nvidia_cutlass-*.whl` in `.wheels/` at the repo root
(unpacked into native/build/; for machines without pip access). $MOESQ_NATIVE_BUILD_DIR overrides the build
directory; $MOESQ_S24_LIB points the loader at a library built elsewhere. No GPU is needed to build: the code is
compiled for sm_90a only (`-gencode=arch=compute_90a,code=sm_90a`). The library has a C ABI loaded with
ctypes, so one build serves every Python version and never links against torch.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
NATIVE_DIR = REPO_ROOT / "native"
BUILD_DIR = Path(os.environ.get("MOESQ_NATIVE_BUILD_DIR", NATIVE_DIR / "build"))
LIB_NAME = "libmoesq_s24.so"
CUTLASS_VERSION = "4.2.0.0"
ABI_VERSION = 1
GENCODE = "-gencode=arch=compute_90a,code=sm_90a"


class NativeBuildError(RuntimeError):
    """The native library cannot be built or loaded here; the message says what is missing and what to do."""


def find_nvcc() -> Path:
    cands = []
    if os.environ.get("CUDA_HOME"):
        cands.append(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc")
    which = shutil.which("nvcc")
    if which:
        cands.append(Path(which))
    cands.append(Path("/usr/local/cuda/bin/nvcc"))
    for c in cands:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise NativeBuildError(
        "nvcc not found (looked in $CUDA_HOME/bin, PATH, /usr/local/cuda/bin). Install the CUDA toolkit "
        "(>= 12.3, for sm_90a) or set CUDA_HOME."
    )


def nvcc_version(nvcc: Path) -> tuple[int, int]:
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise NativeBuildError(f"cannot read the CUDA version from `{nvcc} --version`:\n{out}")
    return int(m.group(1)), int(m.group(2))


def _source_root_ok(root: Path) -> bool:
    return (root / "include" / "cutlass" / "cutlass.h").is_file() and (
        root / "tools" / "util" / "include" / "cutlass" / "util" / "packed_stride.hpp"
    ).is_file()


def find_cutlass() -> Path:
    """The CUTLASS source root (holding include/ and tools/util/include/)."""
    env = os.environ.get("MOESQ_CUTLASS_DIR")
    if env:
        root = Path(env)
        if _source_root_ok(root):
            return root
        raise NativeBuildError(f"MOESQ_CUTLASS_DIR={env} has no include/cutlass/cutlass.h and tools/util/include")
    spec = importlib.util.find_spec("cutlass_library")
    if spec and spec.origin:
        root = Path(spec.origin).parent / "source"
        if _source_root_ok(root):
            return root
    unpacked = BUILD_DIR / "cutlass" / "cutlass_library" / "source"
    if _source_root_ok(unpacked):
        return unpacked
    wheels = sorted((REPO_ROOT / ".wheels").glob(f"nvidia_cutlass-{CUTLASS_VERSION}-*.whl"))
    if wheels:
        dest = BUILD_DIR / "cutlass"
        with zipfile.ZipFile(wheels[-1]) as z:
            z.extractall(dest, [n for n in z.namelist() if n.startswith("cutlass_library/source/")])
        if _source_root_ok(unpacked):
            return unpacked
    raise NativeBuildError(
        f"CUTLASS headers not found. `pip install nvidia-cutlass=={CUTLASS_VERSION}` (or `pip install -e .[native]`), "
        f"or put the wheel in {REPO_ROOT / '.wheels'}, or set MOESQ_CUTLASS_DIR to a CUTLASS source tree."
    )


def variant_ids() -> list[int]:
    text = (NATIVE_DIR / "src" / "variants.def").read_text()
    return [int(m.group(1)) for m in re.finditer(r"^VARIANT\((\d+),", text, re.M)]


def _flags(cutlass: Path) -> list[str]:
    return [
        "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", GENCODE, "-Xcompiler", "-fPIC",
        "-I", str(NATIVE_DIR / "include"), "-I", str(NATIVE_DIR / "src"),
        "-I", str(cutlass / "include"), "-I", str(cutlass / "tools" / "util" / "include"),
        "-Xptxas", "-v",  # register / spill report, kept in the build log
    ]


def _unit_digest(flags: list[str], toolkit: str, source: Path) -> str:
    """What an object file depends on: flags, toolkit, every header in native/include, the variant list, its source."""
    h = hashlib.sha256(" ".join(flags).encode() + toolkit.encode())
    deps = sorted((NATIVE_DIR / "include").rglob("*")) + [NATIVE_DIR / "src" / "variants.def", source]
    for p in deps:
        if p.is_file():
            h.update(str(p.relative_to(NATIVE_DIR)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def build(jobs: int | None = None, force: bool = False, verbose: bool = True) -> Path:
    """Compile every variant (in parallel) and link native/build/libmoesq_s24.so; skips work that is current."""
    nvcc = find_nvcc()
    major, minor = nvcc_version(nvcc)
    if (major, minor) < (12, 3):
        raise NativeBuildError(f"nvcc {major}.{minor} is too old for the sm90 sparse GEMM (need >= 12.3)")
    cutlass = find_cutlass()
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    flags = _flags(cutlass)
    lib = BUILD_DIR / LIB_NAME
    toolkit = f"{major}.{minor}"
    units = [(f"v{i}", NATIVE_DIR / "src" / "s24_variant.cu", [f"-DMOESQ_VARIANT_ID={i}"]) for i in variant_ids()]
    units.append(("api", NATIVE_DIR / "src" / "s24_api.cu", []))
    digests = {name: _unit_digest(flags + extra, toolkit, src) for name, src, extra in units}
    stamp = BUILD_DIR / "build.stamp"
    digest = hashlib.sha256(" ".join(sorted(digests.values())).encode()).hexdigest()[:16]
    if lib.is_file() and stamp.is_file() and stamp.read_text() == digest and not force:
        if verbose:
            print(f"up to date: {lib}")
        return lib
    jobs = jobs or max(1, os.cpu_count() or 1)

    def compile_unit(unit):
        name, src, extra = unit
        obj = BUILD_DIR / f"{name}.o"
        log = BUILD_DIR / f"{name}.log"
        obj_stamp = BUILD_DIR / f"{name}.stamp"
        if obj.is_file() and obj_stamp.is_file() and obj_stamp.read_text() == digests[name] and not force:
            return name, 0, ""
        cmd = [str(nvcc), *flags, *extra, "-c", str(src), "-o", str(obj)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        log.write_text(" ".join(cmd) + "\n" + r.stdout + r.stderr)
        if r.returncode == 0:
            obj_stamp.write_text(digests[name])
        return name, r.returncode, r.stderr

    if verbose:
        print(f"building {len(units)} units with {nvcc} ({major}.{minor}), CUTLASS at {cutlass}, {jobs} jobs")
    with ThreadPoolExecutor(jobs) as pool:
        results = list(pool.map(compile_unit, units))
    failed = [(n, err) for n, rc, err in results if rc]
    if failed:
        name, err = failed[0]
        raise NativeBuildError(
            f"compiling {name} failed ({len(failed)} of {len(units)} units; logs in {BUILD_DIR}):\n{err[-4000:]}"
        )
    objs = [str(BUILD_DIR / f"{n}.o") for n, _, _ in results]
    tmp = lib.with_suffix(".so.tmp")
    cmd = [str(nvcc), "-shared", GENCODE, "-o", str(tmp), *objs]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise NativeBuildError(f"linking {LIB_NAME} failed:\n{r.stderr[-4000:]}")
    os.replace(tmp, lib)
    stamp.write_text(digest)
    if verbose:
        print(f"built {lib}")
    return lib


def library_path() -> Path:
    env = os.environ.get("MOESQ_S24_LIB")
    return Path(env) if env else BUILD_DIR / LIB_NAME


def load_library(path: Path | None = None) -> ctypes.CDLL:
    """Open the built library and bind its C ABI. Raises NativeBuildError with the fix when it is missing."""
    path = path or library_path()
    if not path.is_file():
        raise NativeBuildError(
            f"{path} not found: build it with `python -m moesq_core.kernels.native_build` "
            "(needs nvcc >= 12.3 and the CUTLASS 4.2 headers; see native/README.md)"
        )
    lib = ctypes.CDLL(str(path))
    _bind(lib)
    if lib.moesq_s24_abi_version() != ABI_VERSION:
        raise NativeBuildError(f"{path} has ABI {lib.moesq_s24_abi_version()}, expected {ABI_VERSION}: rebuild it")
    return lib


class S24Args(ctypes.Structure):
    _fields_ = [
        ("a_values", ctypes.c_void_p), ("e_meta", ctypes.c_void_p), ("b_act", ctypes.c_void_p),
        ("scale_w", ctypes.c_void_p), ("scale_x", ctypes.c_void_p), ("counts", ctypes.c_void_p),
        ("d_out", ctypes.c_void_p),
        ("M", ctypes.c_int), ("N", ctypes.c_int), ("K", ctypes.c_int), ("L", ctypes.c_int),
        ("max_clusters", ctypes.c_int), ("device", ctypes.c_int), ("stream", ctypes.c_void_p),
    ]


class S24VariantInfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int) for n in (
        "tile_m", "tile_n", "tile_k", "cluster_m", "cluster_n", "pingpong", "fast_accum", "stages", "smem_bytes")]


def _bind(lib: ctypes.CDLL) -> None:
    c_int, c_void_p, c_char_p = ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p
    sigs = {
        "moesq_s24_abi_version": ([], c_int),
        "moesq_s24_num_variants": ([], c_int),
        "moesq_s24_variant_name": ([c_int], c_char_p),
        "moesq_s24_get_variant_info": ([c_int, ctypes.POINTER(S24VariantInfo)], c_int),
        "moesq_s24_last_error": ([], c_char_p),
        "moesq_s24_check_device": ([c_int], c_int),
        "moesq_s24_gemm": ([c_int, ctypes.POINTER(S24Args)], c_int),
        "moesq_s24_compress": ([c_void_p, c_void_p, c_void_p, c_int, c_int, c_int, c_int, c_void_p], c_int),
    }
    for name, (argtypes, restype) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moesq_core.kernels.native_build", description=__doc__.split("\n")[0])
    ap.add_argument("-j", "--jobs", type=int, default=None, help="parallel nvcc processes (default: all cores)")
    ap.add_argument("--force", action="store_true", help="rebuild everything")
    ap.add_argument("--check", action="store_true", help="load the library and check the current GPU")
    args = ap.parse_args(argv)
    try:
        lib_path = build(jobs=args.jobs, force=args.force)
        if args.check:
            lib = load_library(lib_path)
            names = [lib.moesq_s24_variant_name(i).decode() for i in range(lib.moesq_s24_num_variants())]
            print(f"{len(names)} variants: {', '.join(names)}")
            rc = lib.moesq_s24_check_device(0)
            print("GPU: ok (sm_90)" if rc == 0 else f"GPU: {lib.moesq_s24_last_error().decode()}")
    except NativeBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(lib_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
