"""Paired 4:8 as 2:4: the load-time re-layout of packed p48-nvfp4 weights into a 2:4 sparse operand for
Hopper's sparse tensor cores (which take 2:4 element sparsity for bf16/fp8, but no FP4 and no block scales).

Paired 4:8 is not 2:4 as stored, but it is under a fixed permutation of K inside every 8-column group:

    [e0, e1, e2, e3, e4, e5, e6, e7]  ->  [e0, e2, e4, e6,  e1, e3, e5, e7]          (K_PERM_8)

The group's 4 pairs (e0,e1) (e2,e3) (e4,e5) (e6,e7) put their first elements in the first half and their
second elements in the second half, both at the pair's index. Exactly 2 pairs are kept, so each half keeps
exactly the 2 positions of the kept pairs: both halves are 2:4 with the same 2-bit indices. The activations
take the same permutation (`k_permutation`): gather the expert input's columns; for down_proj, permute the
rows of gate/up once at load time (`permute_rows`) so the SwiGLU output already arrives in permuted order.
The permutation stays inside 32-column blocks, so the UE4M3 block scales and the global scale are unchanged.

The operand (`P48As24`), per row of a weight [..., M, K]:

    codes  uint8 [..., M, K/4]  the E2M1 codes of the 2 kept values of every permuted 4-group, in permuted K
                                order, two per byte (lower K in the low nibble): still 2 bits/weight
    meta   uint8 [..., M, K/8]  per permuted 4-group the nibble i0 | i1 << 2 (i0 < i1, kept positions), two
                                groups per byte, low nibble first: the s24-fp8 logical metadata layout
                                (moesq_core.formats.s24_fp8), which is also PTX's 2-bit sparse index order
    scales float8_e4m3fn [..., M, K/32] and global_scale float32 [..., 1]: as packed

Per 8-group the transform is a nibble transpose of the 2 packed pair bytes (a, b): out0 = lo(a) | lo(b) << 4,
out1 = hi(a) | hi(b) << 4, and meta byte = n | n << 4 with n the pair-mask nibble's 2 set bits as i0 | i1 << 2:
cheap enough for a kernel to do on the fly from the stored layout, or once at load time (here). A kernel then
decodes e2m1(code) * scale into bf16 (exact: <= 6 significant bits), runs the 2:4 sparse bf16 MMA against
the permuted activations and applies 1/global_scale (and the activation scales) in the epilogue.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moesq_core.formats import e2m1_decode
from moesq_core.formats.pack_common import bytes_to_nibbles, nibble_popcount, nibble_positions, nibbles_to_bytes

K_PERM_8 = (0, 2, 4, 6, 1, 3, 5, 7)
P48_SUFFIXES = ("weight_sparse_packed", "weight_sparse_mask", "weight_scale", "weight_global_scale")
SCALE_BLOCK = 32
# 2:4 nibble i0 | i1 << 2 -> pair-mask nibble (bit i0 and bit i1); 0 for invalid nibbles
_S24_TO_PAIR = torch.tensor([(1 << (n & 3)) | (1 << (n >> 2)) if (n & 3) < (n >> 2) else 0 for n in range(16)],
                            dtype=torch.uint8)


def k_permutation(k: int, device=None) -> torch.Tensor:
    """int64 [k]: x_permuted = x[..., perm] (k a multiple of 8)."""
    if k % 8:
        raise ValueError(f"the paired 4:8 -> 2:4 permutation needs a multiple of 8 columns, got {k}")
    base = torch.tensor(K_PERM_8, dtype=torch.int64, device=device)
    return (torch.arange(0, k, 8, device=device)[:, None] + base).reshape(-1)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


@dataclass
class P48As24:
    """A packed p48 weight (one linear [M, K] or a stack [..., M, K]) as a 2:4 operand in permuted K order."""

    codes: torch.Tensor  # uint8 [..., M, K/4]
    meta: torch.Tensor  # uint8 [..., M, K/8]
    scales: torch.Tensor  # float8_e4m3fn [..., M, K/32]
    global_scale: torch.Tensor  # float32 [..., 1]

    @property
    def in_features(self) -> int:
        return self.codes.shape[-1] * 4

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.meta, self.scales, self.global_scale))


def _check(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    missing = [s for s in P48_SUFFIXES if s not in tensors]
    if missing:
        raise ValueError(f"p48-nvfp4 weight: missing {', '.join(missing)}")
    packed, mask = tensors["weight_sparse_packed"], tensors["weight_sparse_mask"]
    if packed.dtype != torch.uint8 or mask.dtype != torch.uint8 or packed.dim() < 2:
        raise ValueError("weight_sparse_packed / weight_sparse_mask: expected uint8 [..., M, K/4] / [..., M, K/16]")
    K = packed.shape[-1] * 4
    if K % SCALE_BLOCK or tuple(mask.shape) != (*packed.shape[:-1], K // 16):
        raise ValueError(f"weight_sparse_mask: shape {tuple(mask.shape)}, expected {(*packed.shape[:-1], K // 16)} "
                         f"for K = {K} (a multiple of {SCALE_BLOCK})")
    nib = bytes_to_nibbles(mask)  # [..., M, K/8]: bit i = pair i of the 8-group kept
    bad = nibble_popcount(nib) != 2
    if bool(bad.any()):
        raise ValueError(f"weight_sparse_mask: {int(bad.sum())} 8-groups do not keep exactly 2 pairs (not paired 4:8)")
    return packed, nib


def p48_to_2to4(tensors: dict[str, torch.Tensor]) -> P48As24:
    """Packed p48-nvfp4 tensors (release layout) -> the 2:4 operand in permuted K order (exact, no rounding)."""
    packed, nib = _check(tensors)
    *lead, M, cols = packed.shape
    pos = nibble_positions(nib)  # [..., M, K/8, 2]: kept pair indices a < b
    s24_nib = (pos[..., 0] | (pos[..., 1] << 2)).to(torch.uint8)
    pa, pb = packed.reshape(*lead, M, cols // 2, 2).unbind(-1)  # the 2 kept pair bytes of each 8-group, K order
    lo = (pa & 0xF) | ((pb & 0xF) << 4)  # first elements of the kept pairs -> first half of the permuted group
    hi = (pa >> 4) | (pb & 0xF0)  # second elements -> second half
    codes = torch.stack((lo, hi), -1).reshape(*lead, M, cols)
    meta = s24_nib | (s24_nib << 4)
    return P48As24(codes.contiguous(), meta.contiguous(), tensors["weight_scale"], tensors["weight_global_scale"])


def to_p48(op: P48As24) -> dict[str, torch.Tensor]:
    """Inverse of p48_to_2to4 (the release layout back, byte for byte)."""
    lo_nib, hi_nib = op.meta & 0xF, op.meta >> 4
    if not torch.equal(lo_nib, hi_nib):
        raise ValueError("meta: the two halves of an 8-group must keep the same positions (paired 4:8)")
    pair_nib = _S24_TO_PAIR.to(op.meta.device)[lo_nib.long()]
    if bool((pair_nib == 0).any()):
        raise ValueError("meta: invalid 2:4 nibble (needs i0 < i1)")
    *lead, M, cols = op.codes.shape
    lo, hi = op.codes.reshape(*lead, M, cols // 2, 2).unbind(-1)
    pa = (lo & 0xF) | ((hi & 0xF) << 4)
    pb = (lo >> 4) | (hi & 0xF0)
    packed = torch.stack((pa, pb), -1).reshape(*lead, M, cols)
    return {"weight_sparse_packed": packed.contiguous(), "weight_sparse_mask": nibbles_to_bytes(pair_nib).contiguous(),
            "weight_scale": op.scales, "weight_global_scale": op.global_scale}


def dense_codes(op: P48As24) -> torch.Tensor:
    """uint8 [..., M, K]: the E2M1 codes in permuted K order, 0 at the pruned positions."""
    *lead, M, cols = op.codes.shape
    K = cols * 4
    vals = bytes_to_nibbles(op.codes).reshape(*lead, M, K // 4, 2)  # 2 kept codes per permuted 4-group
    pos = nibble_positions(_S24_TO_PAIR.to(op.meta.device)[bytes_to_nibbles(op.meta).long()])  # [..., K/4, 2]
    out = torch.zeros(*lead, M, K // 4, 4, dtype=torch.uint8, device=op.codes.device)
    out.scatter_(-1, pos, vals)
    return out.reshape(*lead, M, K)


def unscaled_weight(op: P48As24) -> torch.Tensor:
    """float32 [..., M, K] in permuted K order: e2m1(code) * UE4M3 scale (exact in bf16), the values the sparse
    MMA multiplies; the weight is this / global_scale."""
    return e2m1_decode(dense_codes(op)) * op.scales.float().repeat_interleave(SCALE_BLOCK, dim=-1)


def permute_rows(tensors: dict[str, torch.Tensor], perm: torch.Tensor) -> dict[str, torch.Tensor]:
    """A packed p48 weight with its output rows reordered (row i of the result = row perm[i]): applied to gate
    and up with k_permutation(intermediate) so that SwiGLU's output arrives in down_proj's permuted K order."""
    out = dict(tensors)
    for s in ("weight_sparse_packed", "weight_sparse_mask", "weight_scale"):
        out[s] = tensors[s].index_select(-2, perm.to(tensors[s].device)).contiguous()
    return out
