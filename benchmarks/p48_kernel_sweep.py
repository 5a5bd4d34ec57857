"""The README's p48 kernel row: the native sparse-tensor-core grouped GEMM (W4A16, W4A4 through the NVFP4 pre-pass,
W4A4 quantized in the kernel) against torch's bf16 and fp8 grouped GEMMs, in one process on one Hopper GPU.

    python benchmarks/p48_kernel_sweep.py --out DIR

Shapes: the paper's Table 8 experts, Qwen3-30B-A3B (gate/up, down; 128 experts) and Kimi-K2.5 (gate/up, down; 48
experts); N = 1 ... 256 tokens per expert ({N, 3N/4, N/2, N/4} over the experts). This is
`moesq bench-kernel --format p48-nvfp4` with those shapes and the native columns only (the CLI's shape list
takes one G for all shapes and adds the Triton fallback's columns). Writes p48_kernel_bench.json / .md / .png.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moesq_core.serving.bench.p48_bench import MMA_METHODS, bench_p48  # noqa: E402

SHAPES = [(1536, 2048, 128), (2048, 768, 128), (4096, 7168, 48), (7168, 2048, 48)]  # (M, K, G)
NS = [1, 2, 4, 8, 16, 64, 128, 256]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--N", type=int, nargs="+", default=NS, help="tokens per expert (max of the pattern)")
    ap.add_argument("--repeats", type=int, default=20, help="CUDA-graph replays per timing (median)")
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    args = ap.parse_args(argv)
    bench_p48(shapes=SHAPES, G=[128], N=args.N, out_dir=args.out, repeats=args.repeats, methods=MMA_METHODS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
