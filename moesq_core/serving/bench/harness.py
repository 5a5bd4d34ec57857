"""Timing harness for grouped MoE GEMMs: token-count patterns, CUDA-graph timing, vendor baselines.

Every GEMM implementation (a `TimedGemm`) is timed the same way: a few eager warm-up calls, then a CUDA graph
holding R back-to-back calls (R copies of the weights when one copy would fit in L2, so replays stream weights
from HBM as a real model does), replayed `repeats` times; each replay is timed with CUDA events and the median
over replays, divided by R, is reported. Effective TFLOP/s = 2·M·K·ΣN / t (dense-equivalent work, as the paper
reports), weight bytes/s = the bytes of its weight representation / t.

Baselines (same process, same data, same token counts):
  bf16_grouped_mm     torch._grouped_mm, bf16 activations and weights, tokens packed by offsets
  fp8_grouped_mm      torch._scaled_grouped_mm, e4m3 rowwise-scaled (per token x per channel) -> bf16
  cusparselt_fp8_loop torch._cslt_sparse_mm (cuSPARSELt 2:4 e4m3) looped over experts, per-channel alpha;
                      each expert's token count padded to 16 (cuSPARSELt's minimum for 8-bit dense operands);
                      the per-token activation scale is not applied (the library has no per-column scale)
"""
from __future__ import annotations

import math
import os
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

L2_ROTATE_BYTES = 256 << 20  # rotate weight copies until one graph replay touches at least this much
MAX_COPIES = 16
# The paper's Table 8 layers (M, K): every kernel benchmark's default shapes.
PAPER_SHAPES: dict[str, tuple[int, int]] = {
    "Qwen3-30B-A3B gate/up": (1536, 2048),
    "Qwen3-30B-A3B down": (2048, 768),
    "Kimi-K2.5 gate/up": (4096, 7168),
    "Kimi-K2.5 down": (7168, 2048),
}


def token_counts(N: int, G: int) -> list[int]:
    """Imbalanced tokens per expert: {N, 3N/4, N/2, N/4} repeated over G experts (each at least 1)."""
    pattern = [N, (3 * N) // 4, N // 2, N // 4]
    return [max(1, pattern[g % 4]) for g in range(G)]


def effective_tflops(M: int, K: int, counts: list[int], seconds: float) -> float:
    return 2.0 * M * K * sum(counts) / seconds / 1e12


@dataclass
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    copies: int
    replays: int
    samples_us: list[float] = field(repr=False, default_factory=list)


def copies_for(weight_bytes: int) -> int:
    return max(1, min(MAX_COPIES, math.ceil(L2_ROTATE_BYTES / max(1, weight_bytes))))


def graph_time(calls: list[Callable[[], object]], repeats: int = 50, warmup: int = 2) -> Timing:
    """Median µs per call of a CUDA graph that runs `calls` back to back (one per weight copy)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            for c in calls:
                c()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for c in calls:
            c()
    torch.cuda.synchronize()
    graph.replay()  # first replay uploads the graph
    torch.cuda.synchronize()
    samples = []
    cur = torch.cuda.current_stream()
    for _ in range(repeats):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record(cur)
        graph.replay()
        b.record(cur)
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1e3 / len(calls))
    del graph
    q = statistics.quantiles(samples, n=10) if len(samples) >= 2 else [samples[0]] * 9
    return Timing(statistics.median(samples), q[0], q[-1], len(calls), repeats, samples)


# ------------------------------------------------------------------------------------------------ problem data


@dataclass
class Problem:
    """One grouped GEMM: G experts with weights [M, K] each, counts[g] tokens routed to expert g."""

    M: int
    K: int
    counts: list[int]
    seed: int = 0

    @property
    def G(self) -> int:
        return len(self.counts)

    @property
    def tokens(self) -> int:
        return sum(self.counts)

    @property
    def capacity(self) -> int:
        return max(self.counts)

    def offsets(self, device) -> torch.Tensor:
        """int32 end offsets of each expert's rows, as torch's grouped GEMMs take them."""
        return torch.tensor(self.counts, device=device, dtype=torch.int32).cumsum(0, dtype=torch.int32)


REPO_ROOT = Path(__file__).resolve().parents[3]


def git_commit() -> str:
    """HEAD of this checkout (+"-dirty"), or $MOESQ_COMMIT where the tree was copied without its .git (device
    runs); "unknown" when the tree is a copy inside another checkout, whose HEAD is not ours."""
    if os.environ.get("MOESQ_COMMIT"):
        return os.environ["MOESQ_COMMIT"]
    try:
        def git(*args):
            return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True,
                                  check=True).stdout.strip()

        if Path(git("rev-parse", "--show-toplevel")).resolve() != REPO_ROOT:
            return "unknown"
        head = git("rev-parse", "--short", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_header(fmt: str, device, repeats: int) -> dict:
    """What every kernel benchmark's result starts with: the format, date, GPU, software and commit."""
    import datetime
    import platform


    return {"format": fmt, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(device),
            "sm_count": torch.cuda.get_device_properties(device).multi_processor_count,
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "commit": git_commit(), "repeats": repeats}


def new_row(name: str, M: int, K: int, G: int, N: int, seed: int, device) -> tuple[Problem, torch.Generator, dict]:
    """One sweep point: its problem, a generator seeded from the shape (rows are reproducible one by one) and
    the result row the methods' records go into."""
    prob = Problem(M, K, token_counts(N, G), seed)
    gen = torch.Generator(device=device).manual_seed(seed * 1000003 + M * 31 + K * 17 + G * 7 + N)
    return prob, gen, {"shape": name, "M": M, "K": K, "G": G, "N": N, "tokens": prob.tokens, "methods": {}}


def random_2to4_dense_e4m3(G: int, M: int, K: int, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """2:4-sparse e4m3 weights [G, M, K] (keeping the 2 largest of each 4-group of a normal draw) and fp32
    per-channel scales [G, M]; values span the e4m3 range like quantized weights do, none of them zero.
    Built one expert at a time so the float32 draw never exceeds one expert's size."""
    q = torch.empty(G, M, K, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty(G, M, dtype=torch.float32, device=device)
    for g in range(G):
        w = torch.randn(M, K // 4, 4, generator=gen, device=device)
        keep = w.abs().topk(2, dim=-1).indices
        mask = torch.zeros_like(w, dtype=torch.bool).scatter_(-1, keep, True)
        w = torch.where(mask, w, torch.zeros_like(w)).view(M, K)
        amax = w.abs().amax(-1, keepdim=True)
        v = w / amax * 448.0
        # keep kept entries nonzero after rounding (tiny normals would round to 0 in e4m3)
        v = torch.where(mask.view(M, K) & (v.abs() < 2.0**-9), torch.full_like(v, 2.0**-9).copysign(v), v)
        q[g] = v.to(torch.float8_e4m3fn)
        scale[g] = amax.squeeze(-1) / 448.0 * 1e-2
    return q, scale


def random_e4m3(shape: tuple[int, ...], gen: torch.Generator, device, scale: float = 100.0) -> torch.Tensor:
    """Nonzero e4m3 values, drawn in bf16 (no float32 copy of large tensors)."""
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16) * scale
    x = torch.where(x == 0, torch.ones_like(x), x)
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


def pack_logical(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense 2:4 e4m3 [G, M, K] -> packed (values [G, M, K/2], meta [G, M, K/8]) as the s24 packer writes them
    (one expert at a time to bound the temporaries)."""
    G, M, K = dense.shape
    values = torch.empty(G, M, K // 2, dtype=torch.uint8, device=dense.device)
    meta = torch.empty(G, M, K // 8, dtype=torch.uint8, device=dense.device)
    slot = torch.arange(4, device=dense.device, dtype=torch.int16)
    for g in range(G):
        d = dense[g].view(torch.uint8).reshape(M, K // 4, 4)
        zero = (d & 0x7F) == 0
        # the two nonzero slots, lowest first (a group with fewer nonzeros keeps its lowest zero slots)
        pos = torch.argsort(zero.to(torch.int16) * 8 + slot, dim=-1)[..., :2].sort(-1).values
        values[g] = torch.gather(d, -1, pos).reshape(M, K // 2)
        nib = (pos[..., 0] | (pos[..., 1] << 2)).to(torch.uint8)
        meta[g] = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return values.view(torch.float8_e4m3fn), meta


# ------------------------------------------------------------------------------------------------ baselines


class TimedGemm:
    """One grouped-GEMM implementation the harness times (a vendor baseline). `make(copy)` builds one weight copy
    and returns a zero-argument call; `weight_bytes` is the bytes of one copy's weight representation (what a
    decode step must stream)."""

    name = ""
    description = ""
    note = ""  # a deviation found at run time, reported with the timing

    def __init__(self, prob: Problem, gen: torch.Generator, device):
        self.prob, self.gen, self.device = prob, gen, device

    weight_bytes: int = 0

    def make(self, copy: int) -> Callable[[], object]:
        raise NotImplementedError


class Bf16GroupedMM(TimedGemm):
    name = "bf16_grouped_mm"
    description = "torch._grouped_mm, bf16"

    def __init__(self, prob, gen, device):
        super().__init__(prob, gen, device)
        self.offs = prob.offsets(device)
        self.x = torch.randn(prob.tokens, prob.K, generator=gen, device=device, dtype=torch.bfloat16)
        self.weight_bytes = prob.G * prob.M * prob.K * 2

    def make(self, copy):
        p = self.prob
        w = torch.randn(p.G, p.M, p.K, generator=self.gen, device=self.device, dtype=torch.bfloat16) * 0.02
        wt = w.transpose(-2, -1)  # [G, K, M] column-major, as _grouped_mm wants the weights
        x, offs = self.x, self.offs
        return lambda: torch._grouped_mm(x, wt, offs=offs, out_dtype=torch.bfloat16)


class Fp8GroupedMM(TimedGemm):
    name = "fp8_grouped_mm"
    description = "torch._scaled_grouped_mm, e4m3 rowwise x channelwise scales, fast accumulation"

    def __init__(self, prob, gen, device):
        super().__init__(prob, gen, device)
        self.offs = prob.offsets(device)
        self.x = random_e4m3((prob.tokens, prob.K), gen, device)
        self.sx = torch.rand(prob.tokens, generator=gen, device=device) * 1e-2 + 1e-3
        self.weight_bytes = prob.G * prob.M * prob.K + prob.G * prob.M * 4

    def make(self, copy):
        p = self.prob
        w = random_e4m3((p.G, p.M, p.K), self.gen, self.device)
        sw = torch.rand(p.G, p.M, generator=self.gen, device=self.device) * 1e-2 + 1e-3
        wt = w.transpose(-2, -1)
        x, sx, offs = self.x, self.sx, self.offs
        return lambda: torch._scaled_grouped_mm(x, wt, sx, sw, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True)


class CusparseltFp8Loop(TimedGemm):
    name = "cusparselt_fp8_loop"
    description = ("torch._cslt_sparse_mm (cuSPARSELt 2:4 e4m3) looped over experts, per-channel alpha, "
                   "tokens padded to 16")

    def __init__(self, prob, gen, device):
        super().__init__(prob, gen, device)
        padded = [max(16, -(-c // 16) * 16) for c in prob.counts]
        self.xs = [random_e4m3((n, prob.K), gen, device) for n in padded]
        self.weight_bytes = prob.G * prob.M * (prob.K // 2 + prob.K // 8 + 4)  # estimate until built

    def make(self, copy):
        p = self.prob
        dense, scale = random_2to4_dense_e4m3(p.G, p.M, p.K, self.gen, self.device)
        comp = [torch._cslt_compress(dense[g]) for g in range(p.G)]
        alphas = [scale[g].contiguous() for g in range(p.G)]
        del dense
        self.weight_bytes = sum(c.numel() * c.element_size() for c in comp) + p.G * p.M * 4
        xs = self.xs
        try:  # per-channel alpha (vector scaling); some cuSPARSELt builds only take a scalar
            torch._cslt_sparse_mm(comp[0], xs[0].t(), alpha=alphas[0], out_dtype=torch.bfloat16, transpose_result=True)
        except RuntimeError:
            alphas = [None] * p.G
            self.note = "alpha vector rejected: run without the per-channel scale"

        def call():
            for g in range(p.G):
                torch._cslt_sparse_mm(comp[g], xs[g].t(), alpha=alphas[g], out_dtype=torch.bfloat16,
                                      transpose_result=True)

        return call


BASELINES: dict[str, type[TimedGemm]] = {m.name: m for m in (Bf16GroupedMM, Fp8GroupedMM, CusparseltFp8Loop)}


def time_gemm(gemm: TimedGemm, repeats: int) -> Timing:
    """Build enough weight copies to defeat L2, then graph-time them back to back."""
    copies = copies_for(gemm.weight_bytes)
    calls = [gemm.make(i) for i in range(copies)]
    return graph_time(calls, repeats)
