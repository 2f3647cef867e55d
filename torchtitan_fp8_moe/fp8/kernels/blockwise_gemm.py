"""Blockwise fp8 grouped GEMMs (DeepSeek-V3 style) in Triton, as torch custom ops.

Operands come from the blockwise recipe's quantizers (``recipes/blockwise/``): fp8 data with fp32
power-of-2 multiplier scales, one per 1x128 tile of an activation, per 128x128 block of a weight,
per 128x1 tile (along the tokens) of a weight-gradient operand. Each 128-wide step of the
contraction is one ``tl.dot`` of fp8 tiles into fp32, multiplied by the inverses of its two
scales (exact: powers of 2) and added to an fp32 accumulator, so fp8's limited in-MMA
accumulation never spans more than 128 products.

Groups follow ``torch._grouped_mm``: ``offs`` holds int32 cumulative END offsets of the G token
groups along M, rows past ``offs[-1]`` belong to no group and come out 0. The kernels read ``offs``
on the device only (no host sync), so they run under torch.compile and CUDA graphs.

- ``blockwise_grouped_mm(a, a_scale, b, b_scale, offs)``: ``y[M, N] = a[M, K] . b_g[K, N]`` for
  the rows of group g; the forward, and the input gradient with the weight's transposed data and
  transposed scale (``b`` may have any strides).
- ``blockwise_grouped_mm_wgrad(a, a_scale, g, g_scale, offs)``: ``dW_g[K, N] = a_g^T . g_g``, over
  the tokens of group g, per 128-token block (global blocks: group starts must be 128-aligned,
  as they are for these to be each group's own blocks); empty groups give 0.
Any strides work; fp8 MMA on Hopper runs several times faster when both operands have the
contraction dim contiguous:
``a`` row-major and ``b`` with K contiguous; for the weight gradient, both token-contiguous.
``triton_blockwise.py`` writes them so.
- ``blockwise_mm``, ``blockwise_mm_wgrad``: the dense (one group, no ``offs``) forms.
CUDA only (and Triton's CPU interpreter in the tests).
"""

import os

import torch
import triton
import triton.language as tl

from ..opaque import compile_triton, launcher
from .triton_blockwise import BLOCK, blocks

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _configs() -> list[triton.Config]:
    """Each config costs a compile (seconds on a cold machine) at the first call of a shape.
    These four hold every winner of the eight 64/128-row tiles x 4/8 warps x 3/4 stages on an
    H200 at Scout's and DeepSeek-V3's shapes (GEMMs: 128 rows, 8 warps; weight gradient: 64
    rows, 4 warps, 3 stages).
    Triton's interpreter cannot benchmark, so it gets one (with a tile that spans groups)."""
    if _INTERPRETED:
        return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": block_m, "BLOCK_N": 128}, num_warps=warps, num_stages=stages)
        for block_m, warps, stages in ((128, 8, 3), (128, 8, 4), (64, 4, 3), (64, 4, 4))
    ]


@triton.jit
def _tile_of(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program ``pid``, GROUP_M row tiles at a time, so consecutive
    programs share their column tile's operand in L2."""
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % size, (pid % width) // size


@triton.autotune(configs=_configs(), key=["N", "K", "GROUPED"])
@triton.jit
def _grouped_mm_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    offs_ptr,
    out_ptr,
    M,
    N,
    K,
    G,
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_bg,
    stride_bk,
    stride_bn,
    stride_bsg,
    stride_bsk,
    stride_bsn,
    GROUPED: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_of(tl.program_id(0), num_m, num_n, GROUP_M)
    first_row = pid_m * BLOCK_M
    rows = (first_row + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_mask = cols < N
    # BLOCK_N divides 128, so the tile's columns lie in one 128-block of b.
    n_block = (pid_n * BLOCK_N) // BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The groups that hold rows of this tile: ends are sorted, so those ending at or before its
    # first row come first, and those starting past its last row (any end < that row's) last.
    if GROUPED:
        group_index = tl.arange(0, BLOCK_G)
        ends = tl.load(offs_ptr + group_index, mask=group_index < G, other=2**31 - 1)
        first_group = tl.sum((ends <= first_row).to(tl.int32))
        stop_group = tl.minimum(tl.sum((ends < first_row + BLOCK_M).to(tl.int32)) + 1, G)
    else:
        first_group = 0
        stop_group = 1
    for group in range(first_group, stop_group):
        if GROUPED:
            start = tl.load(offs_ptr + group - 1, mask=group > 0, other=0)
            end = tl.load(offs_ptr + group)
        else:
            start = 0
            end = M
        row_mask = (rows >= start) & (rows < end)
        b_group = b_ptr + tl.cast(group, tl.int64) * stride_bg
        b_scales = b_scale_ptr + tl.cast(group, tl.int64) * stride_bsg + n_block * stride_bsn
        for k_block in range(0, tl.cdiv(K, BLOCK_K)):
            ks = (k_block * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
            k_mask = ks < K
            a = tl.load(
                a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak,
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            b = tl.load(
                b_group + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                mask=k_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            a_scale = tl.load(
                a_scale_ptr + rows * stride_asm + k_block * stride_ask, mask=row_mask, other=1.0
            )
            b_scale = tl.load(b_scales + k_block * stride_bsk)
            # Powers of 2: the product of the inverses is exact (unless below fp32's range).
            inverse = (1.0 / a_scale) * (1.0 / b_scale)
            acc += tl.dot(a, b) * inverse[:, None]
    out = out_ptr + rows[:, None] * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & col_mask[None, :])


@triton.jit
def _wgrad_step(
    acc, a_ptr, a_scale_ptr, g_ptr, g_scale_ptr, token_block, start, end, ks, ns, k_mask, n_mask,
    stride_am, stride_ak, stride_asm, stride_ask, stride_gm, stride_gn, stride_gsm, stride_gsn,
    BLOCK_T: tl.constexpr, MASK_TOKENS: tl.constexpr,
):  # fmt: skip
    """``acc`` plus one 128-token block's ``a^T . g``, unscaled by its two rows of scales."""
    tokens = (token_block * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    a_mask = k_mask[:, None]
    g_mask = n_mask[None, :]
    if MASK_TOKENS:
        # A mask that varies along the contiguous tokens stops vectorized loads: full blocks
        # (all but a group's last) go without one.
        token_mask = (tokens >= start) & (tokens < end)
        a_mask = a_mask & token_mask[None, :]
        g_mask = g_mask & token_mask[:, None]
    a_tile = a_ptr + ks[:, None] * stride_ak + tokens[None, :] * stride_am
    g_tile = g_ptr + tokens[:, None] * stride_gm + ns[None, :] * stride_gn
    a = tl.load(a_tile, mask=a_mask, other=0.0)
    g = tl.load(g_tile, mask=g_mask, other=0.0)
    a_scale = tl.load(
        a_scale_ptr + token_block * stride_asm + ks * stride_ask, mask=k_mask, other=1.0
    )
    g_scale = tl.load(
        g_scale_ptr + token_block * stride_gsm + ns * stride_gsn, mask=n_mask, other=1.0
    )
    return acc + tl.dot(a, g) * ((1.0 / a_scale)[:, None] * (1.0 / g_scale)[None, :])


@triton.autotune(configs=_configs(), key=["N", "K", "GROUPED"])
@triton.jit
def _wgrad_kernel(
    a_ptr,
    a_scale_ptr,
    g_ptr,
    g_scale_ptr,
    offs_ptr,
    out_ptr,
    M,
    K,
    N,
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_gm,
    stride_gn,
    stride_gsm,
    stride_gsn,
    GROUPED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Program (tile of [K, N], group): BLOCK_M rows of K (the output's rows), BLOCK_N of N.
    The group's start is a multiple of BLOCK_T, so only its last block can be partial."""
    pid_k, pid_n = _tile_of(tl.program_id(0), tl.cdiv(K, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    group = tl.program_id(1)
    if GROUPED:
        start = tl.load(offs_ptr + group - 1, mask=group > 0, other=0)
        end = tl.load(offs_ptr + group)
    else:
        start = 0
        end = M
    ks = (pid_k * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    ns = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    k_mask, n_mask = ks < K, ns < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for token_block in range(start // BLOCK_T, end // BLOCK_T):
        acc = _wgrad_step(
            acc, a_ptr, a_scale_ptr, g_ptr, g_scale_ptr, token_block, start, end, ks, ns,
            k_mask, n_mask, stride_am, stride_ak, stride_asm, stride_ask, stride_gm, stride_gn,
            stride_gsm, stride_gsn, BLOCK_T=BLOCK_T, MASK_TOKENS=False,
        )  # fmt: skip
    if (end % BLOCK_T != 0) & (end > start):
        acc = _wgrad_step(
            acc, a_ptr, a_scale_ptr, g_ptr, g_scale_ptr, end // BLOCK_T, start, end, ks, ns,
            k_mask, n_mask, stride_am, stride_ak, stride_asm, stride_ask, stride_gm, stride_gn,
            stride_gsm, stride_gsn, BLOCK_T=BLOCK_T, MASK_TOKENS=True,
        )  # fmt: skip
    # N-major: element (group, k, n) at (group * N + n) * K + k.
    out = out_ptr + (tl.cast(group, tl.int64) * N + ns[None, :]) * K + ks[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=k_mask[:, None] & n_mask[None, :])


def _expect(name: str, tensor: torch.Tensor, shape: tuple, dtype: torch.dtype | None) -> None:
    if tuple(tensor.shape) != tuple(shape) or (dtype is not None and tensor.dtype != dtype):
        raise ValueError(
            f"{name}: expected shape {tuple(shape)}{f' {dtype}' if dtype else ''}, got "
            f"{tuple(tensor.shape)} {tensor.dtype}; quantize it with the blockwise recipe's "
            "quantizers"
        )


def _check_offs(offs: torch.Tensor | None, groups: int) -> None:
    if offs is not None and (offs.shape != (groups,) or offs.dtype != torch.int32):
        raise ValueError(
            f"offs: expected int32 [{groups}] cumulative group ends, got "
            f"{tuple(offs.shape)} {offs.dtype}"
        )


def check_grouped_mm_operands(a, a_scale, b, b_scale, offs) -> None:
    """``a [M, K]`` with 1x128 tile scales, ``b [G, K, N]`` with 128x128 block scales."""
    m, k = a.shape
    groups, _, n = b.shape
    _expect("a_scale", a_scale, (m, blocks(k)), torch.float32)
    _expect("b", b, (groups, k, n), a.dtype)
    _expect("b_scale", b_scale, (groups, blocks(k), blocks(n)), torch.float32)
    _check_offs(offs, groups)


def check_wgrad_operands(a, a_scale, g, g_scale, offs) -> None:
    """``a [M, K]``, ``g [M, N]``, each with scales per 128-token tile."""
    m, k = a.shape
    n = g.shape[1]
    _expect("a_scale", a_scale, (blocks(m), k), torch.float32)
    _expect("g", g, (m, n), a.dtype)
    _expect("g_scale", g_scale, (blocks(m), n), torch.float32)
    _check_offs(offs, 1 if offs is None else offs.shape[0])


def empty_wgrad(groups: int, k: int, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The weight gradient ``[G, K, N]`` N-major, the layout of torchtitan's expert weights (a
    ``[G, N, K]`` parameter that the GEMM reads transposed), as the rowwise recipe returns it:
    autograd accumulates it without a copy (a strided copy of every expert weight otherwise, a
    large share of a layer call's time; docs/benchmarks/README.md)."""
    return torch.empty((groups, n, k), dtype=dtype, device=device).transpose(-2, -1)


def _grouped_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    offs: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``a [M, K]`` (1x128 tiles) times ``b [G, K, N]`` (128x128 blocks, any strides) -> ``[M, N]``
    of ``out_dtype``; without ``offs``, G is 1 and every row is in it."""
    check_grouped_mm_operands(a, a_scale, b, b_scale, offs)
    m, k = a.shape
    groups, _, n = b.shape
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if out.numel() == 0:
        return out

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    launcher(_grouped_mm_kernel, a)[grid](
        a, a_scale, b, b_scale, a_scale if offs is None else offs, out,
        m, n, k, groups, *a.stride(), *a_scale.stride(), *b.stride(), *b_scale.stride(),
        GROUPED=offs is not None, BLOCK_G=triton.next_power_of_2(groups), BLOCK_K=BLOCK,
        GROUP_M=8,
    )  # fmt: skip
    return out


def _wgrad(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    g: torch.Tensor,
    g_scale: torch.Tensor,
    offs: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``a [M, K]``, ``g [M, N]`` (128x1 tiles along M, any strides; column-major reads fastest)
    -> ``[G, K, N]`` of ``out_dtype`` (``empty_wgrad``'s layout), contracted over each group's
    tokens; G = 1 without offs."""
    check_wgrad_operands(a, a_scale, g, g_scale, offs)
    m, k = a.shape
    n = g.shape[1]
    groups = 1 if offs is None else offs.shape[0]
    out = empty_wgrad(groups, k, n, out_dtype, a.device)
    if out.numel() == 0:
        return out

    def grid(meta):
        return (triton.cdiv(k, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), groups)

    launcher(_wgrad_kernel, a)[grid](
        a, a_scale, g, g_scale, a_scale if offs is None else offs, out,
        m, k, n, *a.stride(), *a_scale.stride(), *g.stride(), *g_scale.stride(),
        GROUPED=offs is not None, BLOCK_T=BLOCK, GROUP_M=8,
    )  # fmt: skip
    return out


_grouped_mm_op = compile_triton("blockwise_grouped_mm", _grouped_mm)
_wgrad_op = compile_triton("blockwise_grouped_mm_wgrad", _wgrad)


def blockwise_grouped_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``[M, N]``: the rows of group g times ``b[g]``; rows past ``offs[-1]`` are 0."""
    return _grouped_mm_op(a, a_scale, b, b_scale, offs, out_dtype)


def blockwise_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dense ``a [M, K] . b [K, N]`` (``b_scale [ceil(K/128), ceil(N/128)]``) -> ``[M, N]``."""
    return _grouped_mm_op(a, a_scale, b[None], b_scale[None], None, out_dtype)


def blockwise_grouped_mm_wgrad(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    g: torch.Tensor,
    g_scale: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``[G, K, N]``: ``a_g^T . g_g`` over the tokens of each group (128-aligned starts)."""
    return _wgrad_op(a, a_scale, g, g_scale, offs, out_dtype)


def blockwise_mm_wgrad(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    g: torch.Tensor,
    g_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dense ``a^T [K, M] . g [M, N]`` -> ``[K, N]``, N-major (strides ``(1, K)``)."""
    return _wgrad_op(a, a_scale, g, g_scale, None, out_dtype)[0]
