"""Grouped 2:4 sparse FP8 GEMM for MoE experts on Hopper (`s24-fp8`): Python API, CPU reference, re-layout.

The operation, for experts e = 0..E-1 and tokens n < counts[e] of expert e's capacity slab:

    Y[e, n, m] = bf16( (sum_k W_e[m, k] * X[e, n, k]) * scale_w[e, m] * scale_x[e, n] )

W_e is the 2:4 sparse e4m3 weight of the packed checkpoint (moesq_core/formats/s24_fp8.py: `weight_sparse_values`
[M, K/2], `weight_sparse_meta` [M, K/8], `weight_scale` [M, 1]); X is e4m3 with one fp32 scale per token
(`quantize_activations`). Activations and outputs are capacity-batched: X [E, capacity, K], Y [E, capacity, M],
and `counts` [E] int32 stays on the device: the kernel reads it, so a call never synchronises with the host and
can be captured in a CUDA graph. Rows n >= counts[e] of Y are unspecified (the kernel skips whole tiles there
and may write garbage into the partial tile).

Load time (`prepare_weights`): the values keep their layout; the metadata is re-laid out into the blocked
order CUTLASS's sm90 sparse mainloop loads with TMA: for each 128-column block of K, a row-major [roundup(M, 64),
16] byte slab ([E, ceil(K/128), roundup(M, 64), 16] in all). The nibble encoding is the packer's
(i0 | i1 << 2 per 4-group, low nibble = lower K), which is also what the tensor cores read.

`grouped_gemm` picks a kernel variant with an autotuner (the fastest per (GPU, M, K, E, capacity bucket,
fast_accum), timed on first use and cached in memory and in $MOESQ_AUTOTUNE_CACHE or
~/.cache/moesq/s24_autotune.json). `reference_grouped_gemm` is the same numerics on any device in float64.

Kernel shape limits: M % 8 == 0 (16-byte output rows), K % 32 == 0 (16-byte compressed rows for TMA).
"""
from __future__ import annotations

import json
import os
import statistics
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from moesq_core.formats.e4m3 import E4M3_MAX

META_BLOCK_K = 128  # CUTLASS blocks sm90 sparse metadata by min(tile_k, 128) along K; every variant has tile_k >= 128
META_BLOCK_M = 64
M_MULTIPLE = 8
K_MULTIPLE = 32
_PAD_META = 0x44  # two (0, 1) groups: a valid pattern for padding (the padded values are zero)


# ------------------------------------------------------------------------------------------------ CPU side


def _check_packed(values: torch.Tensor, meta: torch.Tensor) -> tuple[int, int]:
    if values.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"weight_sparse_values: dtype {values.dtype}, expected float8_e4m3fn")
    if meta.dtype != torch.uint8:
        raise ValueError(f"weight_sparse_meta: dtype {meta.dtype}, expected uint8")
    if values.dim() < 2:
        raise ValueError(f"weight_sparse_values: expected [..., M, K/2], got shape {tuple(values.shape)}")
    M, K = values.shape[-2], values.shape[-1] * 2
    if K % 8:
        raise ValueError(f"weight_sparse_values: K = {K} is not a multiple of 8 (two 4-groups per metadata byte)")
    if tuple(meta.shape) != (*values.shape[:-1], K // 8):
        raise ValueError(f"weight_sparse_meta: shape {tuple(meta.shape)}, expected {(*values.shape[:-1], K // 8)}")
    return M, K


def meta_positions(meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., M, K/8] metadata bytes -> (i0, i1) int64 [..., M, K/4]: the kept positions of every 4-group."""
    nib = torch.stack((meta & 0xF, meta >> 4), -1).flatten(-2).long()
    i0, i1 = nib & 3, nib >> 2
    if bool((i0 >= i1).any()):
        bad = (i0 >= i1).nonzero()[0].tolist()
        raise ValueError(f"weight_sparse_meta: group at {bad} has kept positions ({int(i0[tuple(bad)])}, "
                         f"{int(i1[tuple(bad)])}); 2:4 metadata needs i0 < i1")
    return i0, i1


def decompress(values: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """Packed (values [..., M, K/2], meta [..., M, K/8]) -> dense float8_e4m3fn [..., M, K] (pruned entries 0)."""
    M, K = _check_packed(values, meta)
    i0, i1 = meta_positions(meta)
    v = values.view(torch.uint8).reshape(*values.shape[:-1], K // 4, 2)
    dense = torch.zeros(*values.shape[:-1], K // 4, 4, dtype=torch.uint8, device=values.device)
    dense.scatter_(-1, i0.unsqueeze(-1), v[..., :1])
    dense.scatter_(-1, i1.unsqueeze(-1), v[..., 1:])
    return dense.reshape(*values.shape[:-1], K).view(torch.float8_e4m3fn)


def relayout_meta(meta: torch.Tensor, K: int) -> torch.Tensor:
    """Logical metadata [..., M, K/8] -> CUTLASS sm90 order [..., ceil(K/128), roundup(M, 64), 16] (uint8).

    Works on any device (plain tensor ops). Padding rows/columns hold a valid pattern; the matching values
    are zero (TMA fills out-of-bounds A with zeros).
    """
    if meta.dtype != torch.uint8 or meta.shape[-1] * 8 != K:
        raise ValueError(f"metadata: expected uint8 [..., M, {K // 8}], got {meta.dtype} {tuple(meta.shape)}")
    M = meta.shape[-2]
    kb = -(-K // META_BLOCK_K)
    m64 = -(-M // META_BLOCK_M) * META_BLOCK_M
    bytes_per_block = META_BLOCK_K // 8
    padded = torch.full((*meta.shape[:-2], m64, kb * bytes_per_block), _PAD_META, dtype=torch.uint8, device=meta.device)
    padded[..., :M, : K // 8] = meta
    out = padded.reshape(*meta.shape[:-2], m64, kb, bytes_per_block).transpose(-3, -2)
    return out.contiguous()


def unrelayout_meta(meta_cutlass: torch.Tensor, M: int, K: int) -> torch.Tensor:
    """Inverse of relayout_meta: [..., ceil(K/128), roundup(M, 64), 16] -> [..., M, K/8]."""
    kb = -(-K // META_BLOCK_K)
    m64 = -(-M // META_BLOCK_M) * META_BLOCK_M
    if tuple(meta_cutlass.shape[-3:]) != (kb, m64, META_BLOCK_K // 8):
        raise ValueError(f"CUTLASS metadata: shape {tuple(meta_cutlass.shape)} does not match M={M}, K={K}")
    rows = meta_cutlass.transpose(-3, -2).reshape(*meta_cutlass.shape[:-3], m64, kb * (META_BLOCK_K // 8))
    return rows[..., :M, : K // 8].contiguous()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token e4m3 (W8A8): x [..., K] -> (xq float8_e4m3fn [..., K], scale float32 [...]).

    scale = amax(|x|)/448 per token (1 for an all-zero token), xq = round_e4m3(x / scale). Graph-safe.
    """
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    xq = (xf / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return xq, scale


def reference_grouped_gemm(
    values: torch.Tensor, meta: torch.Tensor, scale_w: torch.Tensor, xq: torch.Tensor, scale_x: torch.Tensor,
    counts: torch.Tensor,
) -> torch.Tensor:
    """The kernel's numerics in float64: exact e4m3 products and sums, then the two fp32 scalings, then bf16.

    values [E, M, K/2], meta [E, M, K/8] (logical, as packed), scale_w [E, M] or [E, M, 1], xq [E, cap, K]
    float8_e4m3fn, scale_x [E, cap], counts [E]. Returns bf16 [E, cap, M] with rows >= counts[e] zero.
    """
    E, M = values.shape[0], values.shape[1]
    _, K = _check_packed(values, meta)
    cap = xq.shape[1]
    if tuple(xq.shape) != (E, cap, K):
        raise ValueError(f"activations: shape {tuple(xq.shape)}, expected ({E}, capacity, {K})")
    w = decompress(values, meta).double()  # [E, M, K]
    sw = scale_w.reshape(E, M).float()
    sx = scale_x.reshape(E, cap).float()
    cnt = counts.to("cpu", torch.int64).clamp(0, cap).tolist()
    out = torch.zeros(E, cap, M, dtype=torch.bfloat16, device=values.device)
    for e, c in enumerate(cnt):
        if c == 0:
            continue
        acc = (xq[e, :c].double() @ w[e].T).float()  # products of two e4m3 are exact; float64 sums nearly so
        out[e, :c] = ((acc * sw[e]) * sx[e, :c, None]).to(torch.bfloat16)
    return out


def error_bound(ref: torch.Tensor, absdot: torch.Tensor, fast_accum: bool = False) -> torch.Tensor:
    """Allowed |kernel - reference|: one bf16 ulp of the result plus the tensor cores' accumulation error, which
    scales with absdot = (sum_k |w_k x_k|) * scale_w * scale_x (fp8 MMAs add with fewer bits than fp32;
    the default kernels promote to fp32 every 256 columns of K, fast accumulation never does)."""
    return ref.abs() * 2**-7 + absdot * (2**-6 if fast_accum else 2**-8)


# ------------------------------------------------------------------------------------------------ weights


@dataclass
class S24Fp8Weights:
    """A stack of E experts' weights in the kernel's layout (one projection of one layer)."""

    values: torch.Tensor  # float8_e4m3fn [E, M, K/2]
    meta: torch.Tensor  # uint8 [E, ceil(K/128), roundup(M, 64), 16]
    scale: torch.Tensor  # float32 [E, M]
    K: int

    @property
    def E(self) -> int:
        return self.values.shape[0]

    @property
    def M(self) -> int:
        return self.values.shape[1]

    @property
    def device(self) -> torch.device:
        return self.values.device

    def nbytes(self) -> int:
        """Bytes the kernel streams for the weights (values + metadata, padding included, + scales)."""
        return sum(t.numel() * t.element_size() for t in (self.values, self.meta, self.scale))


def check_kernel_shape(M: int, K: int) -> None:
    if M <= 0 or M % M_MULTIPLE:
        raise ValueError(f"s24-fp8 kernel: M = {M} output features is not a positive multiple of {M_MULTIPLE}")
    if K <= 0 or K % K_MULTIPLE:
        raise ValueError(f"s24-fp8 kernel: K = {K} input features is not a positive multiple of {K_MULTIPLE}")


def prepare_weights(values: torch.Tensor, meta: torch.Tensor, scale: torch.Tensor,
                    device: torch.device | str | None = None) -> S24Fp8Weights:
    """Packed s24-fp8 tensors ([M, ...] one expert or [E, M, ...] a stack) -> S24Fp8Weights on `device`."""
    if values.dim() == 2:
        values, meta, scale = values.unsqueeze(0), meta.unsqueeze(0), scale.unsqueeze(0)
    M, K = _check_packed(values, meta)
    E = values.shape[0]
    check_kernel_shape(M, K)
    if scale.numel() != E * M or scale.dtype != torch.float32:
        raise ValueError(f"weight_scale: expected float32 with {E}x{M} entries, got {scale.dtype} {tuple(scale.shape)}")
    device = torch.device(device) if device is not None else values.device
    v = values.view(torch.float8_e4m3fn).to(device).contiguous()
    m = relayout_meta(meta.to(device), K)
    s = scale.reshape(E, M).to(device).contiguous()
    return S24Fp8Weights(v, m, s, K)


# ------------------------------------------------------------------------------------------------ GPU side

_checked_devices: set[int] = set()


def native_module():
    """The `_moesq_native` extension (pybind11; built on first use, see moesq_core.serving.kernels.native_build)."""
    from moesq_core.serving.kernels.native_build import load_extension

    return load_extension()


def check_device(device: torch.device | int | None = None) -> None:
    """Raise RuntimeError unless `device` is a CUDA GPU these kernels run on (sm_90) and the module loads."""
    if not torch.cuda.is_available():
        raise RuntimeError("s24-fp8 kernel: no CUDA GPU is available (it needs an H100/H200, sm_90a)")
    idx = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if idx.type != "cuda":
        raise RuntimeError(f"s24-fp8 kernel: tensors must be on a CUDA device, got {idx}")
    index = idx.index if idx.index is not None else torch.cuda.current_device()
    if index in _checked_devices:
        return
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) != (9, 0):
        raise RuntimeError(f"s24-fp8 kernel: {torch.cuda.get_device_name(index)} is sm_{major}{minor}; the kernel "
                           "needs Hopper (sm_90a: H100/H200)")
    native_module().s24_check_device(index)
    _checked_devices.add(index)


@dataclass(frozen=True)
class Variant:
    index: int
    name: str
    tile_m: int
    tile_n: int
    tile_k: int
    cluster_m: int
    cluster_n: int
    pingpong: bool
    fast_accum: bool
    stages: int
    smem_bytes: int


def variants() -> list[Variant]:
    return [Variant(**v) for v in native_module().s24_variants()]


def _variant_index(v: int | str) -> int:
    if isinstance(v, int):
        return v
    for var in variants():
        if var.name == v:
            return var.index
    raise ValueError(f"unknown s24-fp8 kernel variant {v!r}; have: {', '.join(x.name for x in variants())}")


def _check_call(w: S24Fp8Weights, xq: torch.Tensor, sx: torch.Tensor, counts: torch.Tensor, out: torch.Tensor) -> None:
    E, M, K = w.E, w.M, w.K
    if xq.dim() != 3 or xq.shape[0] != E or xq.shape[2] != K:
        raise ValueError(f"activations: shape {tuple(xq.shape)}, expected ({E}, capacity, {K})")
    cap = xq.shape[1]
    if cap < 1:
        raise ValueError("activations: capacity must be >= 1")
    checks = [
        ("activations", xq, torch.float8_e4m3fn, (E, cap, K)),
        ("activation scales", sx, torch.float32, (E, cap)),
        ("counts", counts, torch.int32, (E,)),
        ("out", out, torch.bfloat16, (E, cap, M)),
    ]
    for name, t, dtype, shape in checks:
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
        if t.device != w.device:
            raise ValueError(f"{name} is on {t.device}, the weights on {w.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned")


def launch_variant(w: S24Fp8Weights, xq: torch.Tensor, sx: torch.Tensor, counts: torch.Tensor, out: torch.Tensor,
                   variant: int, max_clusters: int = 0) -> None:
    """One kernel launch on the current stream (the extension re-checks every tensor; see grouped_gemm)."""
    native_module().s24_gemm(int(variant), w.values, w.meta, xq, w.scale, sx, counts, out, int(max_clusters))


def grouped_gemm(w: S24Fp8Weights, xq: torch.Tensor, sx: torch.Tensor, counts: torch.Tensor,
                 out: torch.Tensor | None = None, *, variant: int | str | None = None, fast_accum: bool = False,
                 max_clusters: int = 0) -> torch.Tensor:
    """Y[e, n] = bf16((W_e @ X[e, n]) * scale_w[e] * scale_x[e, n]) for n < counts[e]; see the module docstring.

    xq float8_e4m3fn [E, cap, K], sx float32 [E, cap], counts int32 [E] (device), out bf16 [E, cap, M] or None.
    variant: a name or index from `variants()`, or None for the autotuner. The autotuner only considers variants
    that promote the fp8 tensor-core sums to fp32 every 256 columns of K, unless fast_accum=True allows the
    fast-accumulation variants too (faster at large N; slightly larger error, see error_bound).
    Never synchronises with the host; CUDA-graph capturable (tune once before capturing).
    """
    check_device(w.device)
    if out is None:
        out = torch.empty(w.E, xq.shape[1], w.M, dtype=torch.bfloat16, device=w.device)
    _check_call(w, xq, sx, counts, out)
    idx = AUTOTUNER.choose(w, xq, sx, counts, out, fast_accum) if variant is None else _variant_index(variant)
    launch_variant(w, xq, sx, counts, out, idx, max_clusters)
    return out


def cutlass_compress(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CUTLASS's own sm90 compressor on the GPU: dense e4m3 [E, M, K] (2:4) -> (values [E, M, K/2], meta as
    relayout_meta produces). Used to check relayout_meta against CUTLASS bit for bit."""
    check_device(dense.device)
    E, M, K = dense.shape
    check_kernel_shape(M, K)
    values = torch.zeros(E, M, K // 2, dtype=torch.uint8, device=dense.device)
    meta = torch.zeros(E, -(-K // META_BLOCK_K), -(-M // META_BLOCK_M) * META_BLOCK_M, META_BLOCK_K // 8,
                       dtype=torch.uint8, device=dense.device)
    native_module().s24_compress(dense.contiguous().view(torch.uint8), values, meta)
    return values.view(torch.float8_e4m3fn), meta


# ------------------------------------------------------------------------------------------------ autotuner


def capacity_bucket(cap: int) -> int:
    b = 16
    while b < cap:
        b *= 2
    return b


class Autotuner:
    """Fastest variant per (GPU, M, K, E, capacity bucket, fast_accum), timed on the caller's data on first use."""

    def __init__(self, path: Path | None = None, reps: int = 5):
        env = os.environ.get("MOESQ_AUTOTUNE_CACHE")
        self.path = path or (Path(env) if env else Path.home() / ".cache" / "moesq" / "s24_autotune.json")
        self.reps = reps
        self.cache: dict[str, str] = {}
        self.timings: dict[str, dict[str, float]] = {}
        self._loaded = False
        self._lock = threading.Lock()

    def key(self, w: S24Fp8Weights, cap: int, fast_accum: bool) -> str:
        name = torch.cuda.get_device_name(w.device).replace(" ", "_")
        return f"{name}|M{w.M}|K{w.K}|E{w.E}|cap{capacity_bucket(cap)}|fa{int(fast_accum)}"

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        try:
            self.cache.update(json.loads(self.path.read_text()))
        except (OSError, ValueError):
            pass

    def _save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.cache, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only home only costs re-tuning

    @staticmethod
    def heuristic(cands: list[Variant], cap: int) -> Variant:
        """Used while a CUDA graph is being captured and nothing is cached: smallest tile_n covering cap."""
        fitting = [v for v in cands if v.tile_n >= min(cap, 128) and not v.pingpong]
        pool = fitting or cands
        return min(pool, key=lambda v: (v.tile_n, v.cluster_m * v.cluster_n))

    def candidates(self, fast_accum: bool) -> list[Variant]:
        """fast_accum=False: only fp32-promoted variants; True: every variant (fast accumulation allowed)."""
        return [v for v in variants() if fast_accum or not v.fast_accum]

    def choose(self, w, xq, sx, counts, out, fast_accum: bool = False) -> int:
        cands = self.candidates(fast_accum)
        if not cands:
            raise RuntimeError(f"no s24-fp8 kernel variant with fast_accum={fast_accum} is built")
        by_name = {v.name: v for v in cands}
        key = self.key(w, xq.shape[1], fast_accum)
        with self._lock:
            self._load()
            if self.cache.get(key) in by_name:
                return by_name[self.cache[key]].index
        if torch.cuda.is_current_stream_capturing():
            return self.heuristic(cands, xq.shape[1]).index
        times = self.time_variants(cands, w, xq, sx, counts, out)
        best = min(times, key=times.get)
        with self._lock:
            self.cache[key] = best
            self.timings[key] = times
            self._save()
        return by_name[best].index

    def time_variants(self, cands, w, xq, sx, counts, out) -> dict[str, float]:
        """Median µs of `reps` launches per variant (after one warm-up launch each)."""
        stream = torch.cuda.current_stream(w.device)
        times = {}
        for v in cands:
            launch_variant(w, xq, sx, counts, out, v.index)
            samples = []
            for _ in range(self.reps):
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record(stream)
                launch_variant(w, xq, sx, counts, out, v.index)
                b.record(stream)
                b.synchronize()
                samples.append(a.elapsed_time(b) * 1e3)
            times[v.name] = statistics.median(samples)
        return times


AUTOTUNER = Autotuner()
