"""Build and load `native/` as one Python extension module, `_moesq_native` (pybind11, torch tensors in and out).

    python -m moesq_core.serving.kernels.native_build            # build (parallel, incremental), print the module path
    python -m moesq_core.serving.kernels.native_build --check    # also import it and check the GPU
    python -m moesq_core.serving.kernels.native_build --generate # only write the generated sources (no nvcc)

The module is also built on first use (`load_extension()`), so `pip install -e .[native]` (which brings the
CUTLASS headers) is all the setup a source checkout needs. Builds live in a cache directory keyed by the GPU
architecture and a hash of everything the binary depends on (the native sources, flags, CUTLASS version,
torch version and Python ABI): $MOESQ_NATIVE_CACHE, else ~/.cache/moesq/native, one `sm90a-<hash>/` folder per
key; compiled objects are also kept per unit in `objects/`, so a change to one source recompiles that unit
only; concurrent builders wait on a lock. $MOESQ_NATIVE_EXT points the loader at a module built elsewhere.

Needs nvcc (CUDA >= 12.3; built with 13.0) and a C++17 host compiler, and the CUTLASS 4.2 headers, found in this
order: $MOESQ_CUTLASS_DIR (a CUTLASS checkout or the wheel's `cutlass_library/source`), the installed
`nvidia-cutlass` wheel, or a `nvidia_cutlass-*.whl` in `.wheels/` at the repo root (unpacked into the cache;
for machines without pip access). No GPU is needed to build: the kernels are compiled for sm_90a only.

Layout of the build: one object per s24 kernel variant (nvcc, no torch headers, so variants compile in parallel),
the C interface (s24_api.cu), the p48 sparse-tensor-core kernels (p48_gemm.cu, which includes the variant X-macro
the build renders from p48_variants.P48_VARIANTS into `generated/<hash>/p48_variants.inc` in the cache), and the
pybind11 bindings (bindings.cpp, the host compiler with torch's headers), linked into `_moesq_native<EXT_SUFFIX>`.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from moesq_core.memory import available_memory_bytes
from moesq_core.serving.kernels import p48_variants

REPO_ROOT = Path(__file__).resolve().parents[3]
NATIVE_DIR = REPO_ROOT / "native"
MODULE_NAME = "_moesq_native"
CUTLASS_VERSION = "4.2.0.0"
ABI_VERSION = 1  # MOESQ_S24_ABI_VERSION in native/include/moesq/s24_api.h
ARCH = "sm90a"
GENCODE = "-gencode=arch=compute_90a,code=sm_90a"
NVCC_FALLBACKS = (Path("/usr/local/cuda/bin/nvcc"),)


class NativeBuildError(RuntimeError):
    """The native module cannot be built or loaded here; the message says what is missing and what to do."""


# ------------------------------------------------------------------------------------------------ toolchain


def find_nvcc() -> Path:
    cands = []
    if os.environ.get("CUDA_HOME"):
        cands.append(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc")
    which = shutil.which("nvcc")
    if which:
        cands.append(Path(which))
    cands.extend(NVCC_FALLBACKS)
    for c in cands:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise NativeBuildError(
        "nvcc not found (looked in $CUDA_HOME/bin, PATH, /usr/local/cuda/bin): the s24-fp8 kernels are compiled "
        "on first use and need the CUDA toolkit (>= 12.3, for sm_90a). Install it or set CUDA_HOME."
    )


def nvcc_version(nvcc: Path) -> tuple[int, int]:
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise NativeBuildError(f"cannot read the CUDA version from `{nvcc} --version`:\n{out}")
    return int(m.group(1)), int(m.group(2))


def find_cxx() -> str:
    for c in (os.environ.get("CXX"), "c++", "g++"):
        if c and shutil.which(c):
            return c
    raise NativeBuildError("no C++ compiler found (set CXX or install g++): needed for the Python bindings")


def _source_root_ok(root: Path) -> bool:
    return (root / "include" / "cutlass" / "cutlass.h").is_file() and (
        root / "tools" / "util" / "include" / "cutlass" / "util" / "packed_stride.hpp"
    ).is_file()


def find_cutlass(unpack_into: Path | None = None) -> Path:
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
    dest = (unpack_into or cache_root()) / f"cutlass-{CUTLASS_VERSION}"
    unpacked = dest / "cutlass_library" / "source"
    if _source_root_ok(unpacked):
        return unpacked
    wheels = sorted((REPO_ROOT / ".wheels").glob(f"nvidia_cutlass-{CUTLASS_VERSION}-*.whl"))
    if wheels:
        tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
        with zipfile.ZipFile(wheels[-1]) as z:
            z.extractall(tmp, [n for n in z.namelist() if n.startswith("cutlass_library/source/")])
        if not _source_root_ok(dest / "cutlass_library" / "source"):
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(tmp, dest)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        if _source_root_ok(unpacked):
            return unpacked
    raise NativeBuildError(
        f"CUTLASS headers not found. `pip install -e .[native]` (or `pip install nvidia-cutlass=={CUTLASS_VERSION}`), "
        f"or put the wheel in {REPO_ROOT / '.wheels'}, or set MOESQ_CUTLASS_DIR to a CUTLASS source tree."
    )


# ------------------------------------------------------------------------------------------------ what is built


def variant_ids() -> list[int]:
    text = (NATIVE_DIR / "src" / "variants.def").read_text()
    return [int(m.group(1)) for m in re.finditer(r"^VARIANT\((\d+),", text, re.M)]


def generated_sources() -> dict[str, str]:
    """The sources the build writes rather than reads from native/, by file name: the p48 variant X-macro that
    p48_gemm.cu includes, rendered from the variant table (p48_variants.P48_VARIANTS). Part of the build key."""
    return {p48_variants.INCLUDE_NAME: p48_variants.variants_include()}


def generated_dir(sources: dict[str, str] | None = None) -> Path:
    """The folder the generated sources go to: named by their hash, so that a unit including them from there has
    a new command line (a new object) exactly when they change."""
    sources = generated_sources() if sources is None else sources
    h = hashlib.sha256()
    for name, text in sorted(sources.items()):
        h.update(f"{name}\0{text}\0".encode())
    return cache_root() / "generated" / h.hexdigest()[:16]


def write_generated() -> Path:
    """Writes the generated sources (atomically, each file once) into generated_dir() and returns that folder;
    needs no compiler."""
    sources = generated_sources()
    out = generated_dir(sources)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in sources.items():
        path = out / name
        if not path.is_file() or path.read_text() != text:
            tmp = path.with_name(f"{name}.tmp{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(text)
            os.replace(tmp, path)
    return out


def _torch_flags() -> tuple[list[str], list[str]]:
    """(compile flags, link flags) for the bindings: torch's and Python's headers, torch's libraries."""
    import torch
    from torch.utils import cpp_extension

    inc = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    lib_dir = Path(torch.__file__).parent / "lib"
    cflags = [f"-I{p}" for p in inc] + [
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        "-DTORCH_API_INCLUDE_EXTENSION_H", f"-DTORCH_EXTENSION_NAME={MODULE_NAME}",
    ]
    libs = ["c10", "c10_cuda", "torch", "torch_cpu", "torch_cuda", "torch_python"]
    lflags = [f"-L{lib_dir}", "-Xlinker", f"-rpath,{lib_dir}"] + [f"-l{n}" for n in libs]
    return cflags, lflags


def _cuda_include(nvcc: Path) -> Path:
    """The CUDA runtime headers (torch's CUDA stream headers include them)."""
    cands = [Path(os.environ["CUDA_HOME"]) / "include"] if os.environ.get("CUDA_HOME") else []
    cands += [nvcc.resolve().parent.parent / "include", Path("/usr/local/cuda/include")]
    for c in cands:
        if (c / "cuda_runtime_api.h").is_file():
            return c
    raise NativeBuildError(f"cuda_runtime_api.h not found (looked in {', '.join(map(str, cands))}): set CUDA_HOME")


def _sources_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(NATIVE_DIR.rglob("*")):
        if p.is_file() and p.suffix in (".h", ".hpp", ".cuh", ".cu", ".cpp", ".def"):
            h.update(str(p.relative_to(NATIVE_DIR)).encode())
            h.update(p.read_bytes())
    for name, text in sorted(generated_sources().items()):
        h.update(f"generated/{name}".encode())
        h.update(text.encode())
    h.update(Path(__file__).read_bytes())  # the flags live here
    return h.hexdigest()


def _unit_digest(cmd: list[str]) -> str:
    """A compile unit's identity: its command line, the unit's own source file, every header and .def under
    native/ (other units' sources excluded), and the CUTLASS version: objects are reused across build keys. The
    generated sources count through the command line: their folder is named by their hash (generated_dir)."""
    h = hashlib.sha256("\0".join(cmd).encode() + CUTLASS_VERSION.encode())
    own = Path(cmd[-1])
    for p in sorted(NATIVE_DIR.rglob("*")):
        if p.is_file() and (p.suffix in (".h", ".hpp", ".cuh", ".def") or p == own):
            h.update(str(p.relative_to(NATIVE_DIR)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:24]


def build_key() -> str:
    """`<arch>-<hash>`: the native sources, the generated ones, this build script, CUTLASS version, torch version,
    Python ABI."""
    import torch

    h = hashlib.sha256(_sources_digest().encode())
    h.update(f"{CUTLASS_VERSION}|{torch.__version__}|{sysconfig.get_config_var('EXT_SUFFIX')}".encode())
    return f"{ARCH}-{h.hexdigest()[:16]}"


def cache_root() -> Path:
    env = os.environ.get("MOESQ_NATIVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "moesq" / "native"


def module_filename() -> str:
    return MODULE_NAME + sysconfig.get_config_var("EXT_SUFFIX")


def build_dir() -> Path:
    return cache_root() / build_key()


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# Peak resident memory of one compiler process: a CUTLASS sm90 variant unit took 4.85 GB with nvcc 13.0 (cicc).
UNIT_PEAK_BYTES = 5 << 30


def default_jobs(cpus: int | None, available: int | None, units: int) -> int:
    """Parallel compilers: one per core, no more than the units, and no more than the memory holds (a first use
    on a many-core machine with little memory would otherwise be killed for memory)."""
    jobs = min(max(1, cpus or 1), max(1, units))
    if available is not None:
        jobs = min(jobs, max(1, available // UNIT_PEAK_BYTES))
    return jobs


def compile_units(nvcc: str, nv_flags: list[str], cxx: str, cxx_flags: list[str],
                  generated: Path) -> list[tuple[str, list[str]]]:
    """(name, command line without `-o`) per compile unit, the source last: one per s24 variant, the s24 C
    interface, the p48 kernels (which alone see the `generated` sources' folder) and the bindings."""
    src = NATIVE_DIR / "src"
    units = [(f"v{i}", [nvcc, *nv_flags, f"-DMOESQ_VARIANT_ID={i}", "-c", str(src / "s24_variant.cu")])
             for i in variant_ids()]
    units.append(("api", [nvcc, *nv_flags, "-c", str(src / "s24_api.cu")]))
    units.append(("p48", [nvcc, *nv_flags, "-I", str(generated), "-c", str(src / "p48_gemm.cu")]))
    units.append(("bindings", [cxx, *cxx_flags, "-c", str(src / "bindings.cpp")]))
    return units


def build(jobs: int | None = None, force: bool = False, verbose: bool = True) -> Path:
    """Compile every unit (in parallel) and link the extension module; returns its path. Work that is current
    (same build key, same per-unit inputs) is skipped."""
    out_dir = build_dir()
    target = out_dir / module_filename()
    with _locked(out_dir.parent / f"{out_dir.name}.lock"):
        if target.is_file() and not force:
            if verbose:
                print(f"up to date: {target}")
            return target
        nvcc = find_nvcc()
        major, minor = nvcc_version(nvcc)
        if (major, minor) < (12, 3):
            raise NativeBuildError(f"nvcc {major}.{minor} is too old for the sm90 sparse GEMM (need >= 12.3)")
        cxx = find_cxx()
        cutlass = find_cutlass()
        out_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        nv_flags = [
            "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", GENCODE, "-Xcompiler", "-fPIC",
            "-I", str(NATIVE_DIR / "include"), "-I", str(NATIVE_DIR / "src"),
            "-I", str(cutlass / "include"), "-I", str(cutlass / "tools" / "util" / "include"),
            "-Xptxas", "-v",  # register / spill report, kept in the unit's log
        ]
        torch_cflags, torch_lflags = _torch_flags()
        cxx_flags = ["-std=c++17", "-O2", "-fPIC", "-DNDEBUG", "-I", str(NATIVE_DIR / "include"),
                     "-I", str(_cuda_include(nvcc)), *torch_cflags]
        units = compile_units(str(nvcc), nv_flags, cxx, cxx_flags, write_generated())
        jobs = jobs or default_jobs(os.cpu_count(), available_memory_bytes(), len(units))
        if verbose:
            print(f"building {MODULE_NAME} ({len(units)} units, {jobs} jobs) with {nvcc} ({major}.{minor}), {cxx}, "
                  f"CUTLASS at {cutlass}\n  into {out_dir}", flush=True)
        done = [0]
        lock = threading.Lock()

        objects = cache_root() / "objects"
        objects.mkdir(parents=True, exist_ok=True)

        def compile_unit(unit):
            name, cmd = unit
            obj = out_dir / f"{name}.o"
            cached = objects / f"{_unit_digest(cmd)}.o"
            if cached.is_file():  # same command, source and headers: reuse the object of an earlier build
                shutil.copyfile(cached, obj)
                rc, err, how = 0, "", "cached"
            else:
                full = [*cmd, "-o", str(obj)]
                r = subprocess.run(full, capture_output=True, text=True)
                (out_dir / f"{name}.log").write_text(" ".join(full) + "\n" + r.stdout + r.stderr)
                rc, err, how = r.returncode, r.stderr, "ok" if r.returncode == 0 else "FAILED"
                if rc == 0:
                    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}.{threading.get_ident()}")
                    shutil.copyfile(obj, tmp)
                    os.replace(tmp, cached)
            with lock:
                done[0] += 1
                if verbose:
                    print(f"  [{done[0]}/{len(units)}] {name} {how} ({time.perf_counter() - t0:.0f} s)", flush=True)
            return name, rc, err

        with ThreadPoolExecutor(jobs) as pool:
            results = list(pool.map(compile_unit, units))
        failed = [(n, err) for n, rc, err in results if rc]
        if failed:
            name, err = failed[0]
            raise NativeBuildError(
                f"compiling {name} failed ({len(failed)} of {len(units)} units; logs in {out_dir}):\n{err[-4000:]}")
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        cmd = [str(nvcc), "-shared", GENCODE, "-o", str(tmp), *[str(out_dir / f"{n}.o") for n, _, _ in results],
               *torch_lflags]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise NativeBuildError(f"linking {target.name} failed:\n{' '.join(cmd)}\n{r.stderr[-4000:]}")
        os.replace(tmp, target)
        info = {"seconds": round(time.perf_counter() - t0, 1), "nvcc": f"{major}.{minor}", "cxx": cxx,
                "cutlass": str(cutlass), "jobs": jobs, "units": len(units)}
        (out_dir / "build.json").write_text(json.dumps(info, indent=1))
        if verbose:
            print(f"built {target} in {info['seconds']} s", flush=True)
        return target


# ------------------------------------------------------------------------------------------------ loading

_module = None
_module_lock = threading.Lock()


def _import(path: Path):
    import torch  # noqa: F401  (loads libtorch, which the module links against)

    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, str(path), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    if getattr(mod, "ABI_VERSION", None) != ABI_VERSION:
        raise NativeBuildError(f"{path} has ABI {getattr(mod, 'ABI_VERSION', None)}, expected {ABI_VERSION}: "
                               "rebuild it")
    return mod


def load_extension(build_if_missing: bool = True):
    """The imported `_moesq_native` module: $MOESQ_NATIVE_EXT, else the cached build for this source tree,
    building it first when missing (minutes; a message says so). Raises NativeBuildError with the fix."""
    global _module
    with _module_lock:
        if _module is not None:
            return _module
        env = os.environ.get("MOESQ_NATIVE_EXT")
        if env:
            if not Path(env).is_file():
                raise NativeBuildError(f"MOESQ_NATIVE_EXT={env}: no such file")
            _module = _import(Path(env))
            return _module
        if not (NATIVE_DIR / "src" / "bindings.cpp").is_file():
            raise NativeBuildError(f"the native sources are not here ({NATIVE_DIR}): the native kernels are built "
                                   "from a source checkout (`pip install -e .[native]`), or set MOESQ_NATIVE_EXT")
        path = build_dir() / module_filename()
        if not path.is_file():
            if not build_if_missing:
                raise NativeBuildError(f"{path} not built: run `python -m moesq_core.serving.kernels.native_build`")
            print(f"moesq: compiling the native kernels (s24-fp8, p48) for {ARCH} (first use; cached in {path.parent})",
                  file=sys.stderr, flush=True)
            path = build(verbose=False)
        _module = _import(path)
        return _module


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moesq_core.serving.kernels.native_build",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("-j", "--jobs", type=int, default=None,
                    help="parallel compiler processes (default: one per core, as many as the free memory holds at "
                         "~5 GiB each)")
    ap.add_argument("--force", action="store_true", help="rebuild everything")
    ap.add_argument("--check", action="store_true", help="import the module and check the current GPU")
    ap.add_argument("--generate", action="store_true",
                    help="only write the generated sources (the p48 variant X-macro) and print their folder; no nvcc")
    args = ap.parse_args(argv)
    if args.generate:
        print(write_generated())
        return 0
    try:
        path = build(jobs=args.jobs, force=args.force)
        if args.check:
            mod = _import(path)
            names = [v["name"] for v in mod.s24_variants()]
            print(f"{len(names)} variants: {', '.join(names)}")
            try:
                mod.s24_check_device(0)
                print("GPU: ok (sm_90)")
            except RuntimeError as e:
                print(f"GPU: {e}")
    except NativeBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
