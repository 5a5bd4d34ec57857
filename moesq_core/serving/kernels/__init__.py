"""Python side of the kernels: CPU references, load-time re-layouts and bindings to native/.

    s24_fp8        grouped 2:4 sparse FP8 GEMM for Hopper (CUTLASS, native/): API, reference, re-layout
    native_build   builds (on first use, cached) and loads the `_moesq_native` pybind11 module from native/
    s24_route      fused Triton routing / e4m3 quantization / SwiGLU / combine kernels of the s24-fp8 experts
    verify_kernel  runs every packed s24-fp8 expert of a model directory through the kernel
    p48_reference  CPU reference of the p48-nvfp4 serving numerics (W4A16, W4A4 emulation)
    p48_triton     Triton grouped GEMM streaming the packed 2.75-bit p48 weights (Hopper)
    p48_sparse24   load-time re-layout of packed p48 weights into a 2:4 operand (K permuted in 8-groups)
    relax_triton   fused Gumbel-softmax pattern relaxation (forward + backward) for refinement on the GPU
    swiglu_quant_triton  fused SwiGLU + NVFP4 activation fake-quantization (forward + backward) for refinement
    triton_support Triton where installed, and its interpreter on the CPU

Nothing here needs a GPU at import time (Triton is imported when installed); GPU entry points raise RuntimeError
with the reason (no CUDA, not sm_90, library not built) when they cannot run.
"""
