"""The compiled variants of the p48 sparse-tensor-core kernel (native/src/p48_gemm.cu), defined once: P48_VARIANTS.

A row's index is the kernel's `variant` argument (p48_mma.MmaConfig.variant). The native build renders the table
into `p48_variants.inc` (`variants_include`): the X-macro `MOESQ_P48_VARIANTS(X)`, one `X(index, template)` line per
row, which p48_gemm.cu expands into its launch and info switches, and one static_assert per row that the
instantiated template's constants are the row's fields (a reordered or reinterpreted template parameter fails the
build). p48_mma.pick_config reads the rows' properties; the GPU tests compare `_moesq_native.p48_variants()` with
the table. Only variants that pick_config picks are compiled (native/docs/p48.md lists the designs measured and
not kept). No torch here, so the build imports the table without the runtime.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass

MMA_SP, WGMMA_SP = "mma.sp", "wgmma.sp"
MAX_ORDER_EXPERTS = 4096  # experts a CTA can sort or list (kMaxOrderE in p48_gemm.cu; the include asserts it)
INCLUDE_NAME = "p48_variants.inc"

# Per instruction: the C++ template and its parameters in declaration order, each with its default (None: none).
# mma.sp: Variant<NB, R, W, S, KC, RK, P = 1, DEAL = 0>; wgmma.sp: WgVariant<NB, WG, S, KC, RK, TW = 0, ORDER = false>.
TEMPLATES: dict[str, tuple[str, tuple[tuple[str, int | bool | None], ...]]] = {
    MMA_SP: ("Variant", (("NB", None), ("R", None), ("W", None), ("S", None), ("KC", None), ("RK", None),
                         ("P", 1), ("DEAL", 0))),
    WGMMA_SP: ("WgVariant", (("NB", None), ("WG", None), ("S", None), ("KC", None), ("RK", None), ("TW", 0),
                             ("ORDER", False))),
}


@dataclass(frozen=True)
class P48Variant:
    """One compiled kernel variant: every template argument (named after the kernel's constants) and what Python
    reads of it."""

    instruction: str  # MMA_SP (warp-level mma.sp m16n8k32, template Variant) or WGMMA_SP (wgmma.sp, WgVariant)
    tokens_per_block: int  # NB: tokens staged per pass (the N of each weight pass)
    warps: int  # W: warps per CTA (wgmma.sp: 4 per warpgroup, the template takes warpgroups)
    row_tiles_per_warp: int  # R: 16-row tiles per warp (wgmma.sp: 1)
    stages: int  # S: weight-ring stages per warp
    k_chunk: int  # KC: activation columns staged at a time
    records_per_step: int  # RK: consecutive K records per row tile and ring step
    row_groups_per_unit: int = 1  # P: row groups (of rows_per_cta rows) per unit of work (wgmma.sp: 1)
    deal: int = 0  # DEAL: 0 units b, b + G, ... to CTA b; 1 (mma.sp) the list deal by 8-token tiles;
    # 2 (wgmma.sp, the template's ORDER) the units by decreasing token count in a snake
    token_width_step: int = 0  # TW (wgmma.sp): the wgmma's N rounded up from the block's tokens in these steps (0: NB)
    summary: str = ""  # what the variant is for (a comment in the generated include)

    def __post_init__(self):
        if self.instruction not in TEMPLATES:
            raise ValueError(f"p48 variant: instruction {self.instruction!r} is not one of {', '.join(TEMPLATES)}")
        if self.instruction == WGMMA_SP:
            if (self.warps % 4 or self.row_tiles_per_warp != 1 or self.row_groups_per_unit != 1
                    or self.deal not in (0, 2)):
                raise ValueError("p48 wgmma.sp variant: warps a multiple of 4 (whole warpgroups), one row tile per "
                                 f"warp, one row group per unit, deal 0 or 2; got {self}")
        elif self.token_width_step or self.deal not in (0, 1):
            raise ValueError(f"p48 mma.sp variant: no token width step, deal 0 or 1; got {self}")

    @property
    def rows_per_cta(self) -> int:
        """Output rows of one row group: 16 per row tile."""
        return 16 * self.warps * self.row_tiles_per_warp

    @property
    def orders_experts(self) -> bool:
        """Whether each CTA orders (sorts or lists) the experts in the kernel: at most MAX_ORDER_EXPERTS of them."""
        return self.deal != 0

    def template_values(self) -> dict[str, int | bool]:
        """The template's arguments by parameter name (TEMPLATES)."""
        if self.instruction == MMA_SP:
            return {"NB": self.tokens_per_block, "R": self.row_tiles_per_warp, "W": self.warps, "S": self.stages,
                    "KC": self.k_chunk, "RK": self.records_per_step, "P": self.row_groups_per_unit, "DEAL": self.deal}
        return {"NB": self.tokens_per_block, "WG": self.warps // 4, "S": self.stages, "KC": self.k_chunk,
                "RK": self.records_per_step, "TW": self.token_width_step, "ORDER": self.deal == 2}

    def template(self) -> str:
        """The C++ type, trailing default arguments left out: e.g. `Variant<16, 2, 8, 3, 1024, 2>`."""
        name, params = TEMPLATES[self.instruction]
        values = self.template_values()
        args = [values[p] for p, _ in params]
        while args and params[len(args) - 1][1] is not None and args[-1] == params[len(args) - 1][1]:
            args.pop()
        return f"{name}<{', '.join(_cpp(a) for a in args)}>"

    def constants(self) -> dict[str, int | bool]:
        """The static constants every instantiated template has, with the values this row implies (checked by the
        generated static_asserts): the template's parameters as the kernel reads them, SWZ (the wgmma kernel)
        and ORDER (the experts ordered in the kernel)."""
        out = {"NB": self.tokens_per_block, "R": self.row_tiles_per_warp, "W": self.warps, "S": self.stages,
               "KC": self.k_chunk, "RK": self.records_per_step, "P": self.row_groups_per_unit, "DEAL": self.deal,
               "SWZ": self.instruction == WGMMA_SP, "ORDER": self.orders_experts}
        if self.instruction == WGMMA_SP:
            out["TW"] = self.token_width_step
        return out


def _cpp(v: int | bool) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


_DECODE = dict(instruction=MMA_SP, tokens_per_block=16, warps=8, row_tiles_per_warp=2, stages=3, k_chunk=1024,
               records_per_step=2)
_WARPGROUPS = dict(instruction=WGMMA_SP, warps=16, row_tiles_per_warp=1, stages=3, records_per_step=2)

P48_VARIANTS: tuple[P48Variant, ...] = (
    P48Variant(**_DECODE, summary="decode: up to 16 tokens per pass, 2 row tiles per warp (256 rows per CTA), two "
               "consecutive records per row tile and step, the bulk-copy ring, the trimmed per-unit staging and "
               "epilogue, the chunk's row start and count from the cursor"),
    P48Variant(**_WARPGROUPS, tokens_per_block=64, k_chunk=512,
               summary="wgmma.sp with 4 warpgroups (256 rows per CTA), 64 tokens per pass, the lean staging (each "
               "thread cp.async-copies its units of the next chunk into a raw buffer, K-permuted at the chunk "
               "boundary)"),
    P48Variant(**_WARPGROUPS, tokens_per_block=128, k_chunk=256, summary="1 with 128 tokens per pass"),
    P48Variant(**_WARPGROUPS, tokens_per_block=128, k_chunk=256, token_width_step=32, deal=2,
               summary="2 with the units dealt to the CTAs by decreasing token count in a snake (ORDER) and the "
               "wgmma's N per token block rounded up from its token count in steps of 32 (TW)"),
    P48Variant(**_DECODE, row_groups_per_unit=2,
               summary="0 with two row groups per unit (P), the second re-using the staged chunk when it holds the "
               "unit's K slice (Qwen3-30B-A3B down, K = 768)"),
    P48Variant(**_DECODE, deal=1,
               summary="0 with DEAL 1 (deal_by_tiles: past round 0 the units of the experts with tokens, listed by "
               "decreasing 8-token tiles; not combined with 4's row-group pairs, which it made slower)"),
)


def variants_include(variants: tuple[P48Variant, ...] | None = None) -> str:
    """The text of p48_variants.inc: the X-macro of `variants` (default P48_VARIANTS; index = position) and the
    static_asserts that tie each instantiated template to its row."""
    variants = P48_VARIANTS if variants is None else variants
    lines = ["// Generated by the native build from P48_VARIANTS in moesq_core/serving/kernels/p48_variants.py: edit",
             "// the table there, not this file.", "//"]
    for i, v in enumerate(variants):
        lines += textwrap.wrap(f"{i}: {v.summary}", 116, initial_indent="// ", subsequent_indent="//   ",
                               break_on_hyphens=False)
    body = [f"  X({i}, {v.template()})" for i, v in enumerate(variants)]
    lines.append("#define MOESQ_P48_VARIANTS(X) \\")
    lines += [b + " \\" for b in body[:-1]] + body[-1:]
    lines += ["", "// Each template's constants are its row's fields, and the kernel's expert bound is the table's."]
    for i, v in enumerate(variants):
        checks = " && ".join(f"P48Row{i}::{name} == {_cpp(value)}" for name, value in v.constants().items())
        lines += [f"using P48Row{i} = {v.template()};",
                  f'static_assert({checks}, "p48 variant {i} is not its row of P48_VARIANTS");']
    lines.append(f'static_assert(kMaxOrderE == {MAX_ORDER_EXPERTS}, '
                 '"kMaxOrderE is not p48_variants.MAX_ORDER_EXPERTS");')
    return "\n".join(lines) + "\n"
