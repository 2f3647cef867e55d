"""fp8 grouped GEMM kernels from registry packages against torch's, at the per-GPU expert shapes.

    python scripts/bench_grouped_backends.py [--quick | --shapes S,..] [--repeat N] [--align 16]
        [--out outputs/benchmarks/grouped_backends.json]

For each shape (routed rows M, local experts G, K -> N) and each GEMM of an expert projection
(forward ``x [M, K] . W_g [K, N]``; the input gradient has the same form with K and N swapped, so
the w1/w2 rows of a model cover both) it times, on operands quantized beforehand (the GEMM alone):

- ``bf16``: ``torch._grouped_mm`` (what an unconverted model runs);
- ``torch_rowwise``: ``torch._scaled_grouped_mm`` on float8_moe's quantizers' operands (its kernel);
- ``torch_rowwise_3d_2d``: the same kernel on the transposed product ``W_g . x_g^T``;
- ``torch_rowwise_per_group``: one dense ``torch._scaled_mm`` per group, group bounds read on the
  host beforehand (what a caller that synced once per layer could run);
- ``torch_rowwise_dense``: one dense ``_scaled_mm`` of all M rows by one expert: the same FLOPs
  at the dense kernel's rate, a bound (its SQNR against the grouped product means nothing);
- ``fbgemm_rowwise``: fbgemm-gpu-genai's CUTLASS ``f8f8bf16_rowwise_grouped_stacked``;
- ``fbgemm_triton_rowwise``: fbgemm-gpu-genai's Triton ``grouped_gemm_fp8_rowwise``;
- ``fbgemm_blockwise``: fbgemm-gpu-genai's CUTLASS ``f8f8bf16_groupwise_grouped`` (1x128 / 128x128);
- and the weight-gradient GEMM (``dW_g^T = dy_g^T . x_g``, over each group's tokens, as
  float8_moe computes it, on float8_moe's quantizers' operands): bf16, torch_rowwise,
  torch_rowwise_swapped (``x_g^T . dy_g``), torch_rowwise_per_group.

Each result is checked against the bf16 product (SQNR, dB) before it is timed; a backend that does
not import or fails on this machine is reported with its error. Times are triton ``do_bench``
medians; with ``--repeat N`` the backends are timed N times, interleaved, and the row keeps the
median and the spread. Groups are uneven multiples of ``--align`` rows (routing pads to 16).
Needs CUDA with fp8 (sm89+); fbgemm-gpu-genai is optional.
"""

import argparse
import json
import statistics
import traceback
from pathlib import Path

import torch
from triton.testing import do_bench

from torchtitan_fp8_moe.fp8 import triton_quantize
from torchtitan_fp8_moe.fp8.gemm import column_major
from torchtitan_fp8_moe.fp8.sqnr import sqnr

# name: (routed rows M on one GPU, local experts G, K, N)
SHAPES = {
    "scout_tp8_w1": (16384, 16, 5120, 1024),
    "scout_tp8_w2": (16384, 16, 1024, 5120),
    "qwen3_30b_w1": (131072, 128, 2048, 768),
    "qwen3_30b_w2": (131072, 128, 768, 2048),
    "dsv3_16e_w1": (65536, 16, 7168, 2048),
    "dsv3_16e_w2": (65536, 16, 2048, 7168),
    "scout_16e_w1": (16384, 16, 5120, 8192),
    "scout_16e_w2": (16384, 16, 8192, 5120),
    "scout_16e_64k_w1": (65536, 16, 5120, 8192),
    # scripts/bench_train.py's Scout-width trainer: 4 x 8192 tokens a step, top 1.
    "scout_16e_32k_w1": (32768, 16, 5120, 8192),
    "scout_16e_32k_w2": (32768, 16, 8192, 5120),
}
QUICK = ("scout_tp8_w1", "qwen3_30b_w1", "dsv3_16e_w1")
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def _group_sizes(m: int, groups: int, align: int) -> torch.Tensor:
    """Uneven, ``align``-multiple group sizes summing to ``m`` (seeded)."""
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(groups, generator=gen) + 0.5
    sizes = (weights / weights.sum() * (m // align)).floor().long() * align
    sizes[-1] += m - sizes.sum()
    return sizes


def _rowwise(x: torch.Tensor, dim: int):
    """fp8 data and dequantization scales (amax / 448) along ``dim`` (keepdim)."""
    amax = x.abs().amax(dim=dim, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _blockwise_act(x: torch.Tensor):
    """1x128 tiles: data [M, K] and dequantization scales [M, K/128]."""
    m, k = x.shape
    tiles = x.float().view(m, k // 128, 128)
    scale = tiles.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (tiles / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(m, k), scale.squeeze(-1)


def _blockwise_weight(w: torch.Tensor):
    """128x128 blocks of ``w [G, N, K]``: data and dequantization scales [G, N/128, K/128]."""
    g, n, k = w.shape
    blocks = w.float().view(g, n // 128, 128, k // 128, 128)
    scale = blocks.abs().amax(dim=(2, 4), keepdim=True).clamp(min=1e-12) / FP8_MAX
    data = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(g, n, k)
    return data, scale.view(g, n // 128, k // 128)


def _fbgemm():
    import fbgemm_gpu.experimental.gen_ai  # noqa: F401  (registers torch.ops.fbgemm)

    return torch.ops.fbgemm


def _forward_backends(x, w_nk, sizes, offs):
    """name -> zero-argument callable computing ``x . W_g^T`` per group (bf16 out)."""
    xq, xs = _rowwise(x, -1)
    wq, ws = _rowwise(w_nk, -1)  # [G, N, K], scales [G, N, 1]
    a, a_scale = triton_quantize.rows(x)
    b, b_scale, _ = triton_quantize.weight(w_nk.transpose(-2, -1))
    b = column_major(b)
    a_inverse, b_inverse = a_scale.reciprocal(), b_scale.reciprocal()
    backends = {
        "bf16": lambda: torch._grouped_mm(x, w_nk.transpose(-2, -1), offs=offs),
        "torch_rowwise": lambda: _grouped(a, b, a_inverse.squeeze(-1), b_inverse.squeeze(-2), offs),
        # The same product transposed, ``W_g . x_g^T`` ([N, M], offsets along M): torch's
        # 3d x 2d form, whose kernel takes the experts' N as its M.
        "torch_rowwise_3d_2d": lambda: _grouped(
            b.transpose(-2, -1), a.t(), b_inverse.squeeze(-2), a_inverse.squeeze(-1), offs
        ).t(),
        "torch_rowwise_per_group": _per_group_forward(a, a_inverse, b, b_inverse, sizes),
        # One dense GEMM of all M rows by expert 0: the rate the grouped GEMM could reach.
        "torch_rowwise_dense": lambda: _dense(a, b[0], a_inverse, b_inverse[0]),
    }
    try:
        ops = _fbgemm()
        xbq, xbs = _blockwise_act(x)
        wbq, wbs = _blockwise_weight(w_nk)
        backends["fbgemm_rowwise"] = lambda: ops.f8f8bf16_rowwise_grouped_stacked(
            xq, wq, xs.view(-1), ws.view(ws.shape[0], -1), sizes
        )
        backends["fbgemm_blockwise"] = lambda: ops.f8f8bf16_groupwise_grouped(
            xbq, wbq, xbs, wbs.transpose(-2, -1).contiguous(), sizes
        )
    except Exception as error:  # an optional package: report why it is missing
        backends["fbgemm_rowwise"] = error
    try:
        from fbgemm_gpu.experimental.gemm.triton_gemm.grouped_gemm import (
            grouped_gemm_fp8_rowwise,
        )

        w_flat = wq.reshape(-1, wq.shape[-1])
        backends["fbgemm_triton_rowwise"] = lambda: grouped_gemm_fp8_rowwise(
            xq, w_flat, sizes.to(torch.int32), xs.view(-1), ws.view(-1)
        )
    except Exception as error:
        backends["fbgemm_triton_rowwise"] = error
    return backends


def _dense(a, b, a_inverse, b_inverse, out=None):
    return torch._scaled_mm(
        a, b, a_inverse, b_inverse, out_dtype=torch.bfloat16, use_fast_accum=True, out=out
    )


def _grouped(a, b, a_inverse, b_inverse, offs):
    """torch's fp8 grouped GEMM as float8_moe calls it: bf16 out, fast accumulation."""
    return torch._scaled_grouped_mm(
        a, b, a_inverse, b_inverse, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True
    )


def _bounds(sizes: torch.Tensor) -> list[tuple[int, int, int]]:
    """(group, first row, end row) of each non-empty group, on the host (one sync, outside
    the timed call, as a caller that synced once per layer would have them)."""
    ends = sizes.cumsum(0).tolist()
    pairs = enumerate(zip(sizes.tolist(), ends, strict=True))
    return [(g, end - size, end) for g, (size, end) in pairs if size]


def _per_group_forward(a, a_inverse, b, b_inverse, sizes):
    """The grouped forward as one dense ``_scaled_mm`` per group into slices of one output."""
    bounds = _bounds(sizes)

    def run():
        out = a.new_empty((a.shape[0], b.shape[-1]), dtype=torch.bfloat16)
        for g, start, end in bounds:
            _dense(a[start:end], b[g], a_inverse[start:end], b_inverse[g], out=out[start:end])
        return out

    return run


def _wgrad_backends(x, dy, offs, sizes):
    """name -> callable computing ``dW_g^T = dy_g^T . x_g`` ([G, N, K])."""
    xq, xs, gq, gs = triton_quantize.per_group_pair(x, dy, offs)  # column-major data
    xq = column_major(xq)
    gs_inverse, xs_inverse = gs.reciprocal(), xs.reciprocal()
    bounds = _bounds(sizes)

    def per_group():
        out = x.new_zeros((offs.shape[0], dy.shape[1], x.shape[1]))
        for g, start, end in bounds:
            _dense(
                gq.t()[:, start:end],
                xq[start:end],
                gs_inverse[g].view(-1, 1),
                xs_inverse[g].view(1, -1),
                out=out[g],
            )
        return out

    return {
        "bf16": lambda: torch._grouped_mm(dy.t(), x, offs=offs),
        "torch_rowwise": lambda: _grouped(
            gq.t(), xq, gs_inverse.reshape(-1), xs_inverse.reshape(-1), offs
        ),
        # The transposed product ``x_g^T . dy_g`` ([G, K, N]): the operands' roles swapped.
        "torch_rowwise_swapped": lambda: _grouped(
            xq.t(), gq, xs_inverse.reshape(-1), gs_inverse.reshape(-1), offs
        ).transpose(-2, -1),
        "torch_rowwise_per_group": per_group,
    }


def _time_all(backends: dict, reference: torch.Tensor, repeat: int, flops: float) -> dict:
    rows = {}
    for name, fn in backends.items():
        if isinstance(fn, Exception):
            rows[name] = {"error": f"{type(fn).__name__}: {fn}"[:300]}
            continue
        try:
            out = fn()
            torch.cuda.synchronize()
            rows[name] = {"sqnr_db": round(sqnr(reference.float(), out.float()), 2), "ms": []}
        except Exception as error:
            rows[name] = {"error": traceback.format_exception_only(error)[-1].strip()[:300]}
    for _ in range(repeat):
        for name, fn in backends.items():
            if "ms" in rows[name]:
                rows[name]["ms"].append(do_bench(fn, warmup=10, rep=50))
    for row in rows.values():
        if "ms" in row:
            row["median_ms"] = statistics.median(row["ms"])
            row["spread_ms"] = max(row["ms"]) - min(row["ms"])
            row["tflops"] = round(flops / row["median_ms"] / 1e9, 1)
    bf16 = rows["bf16"]["median_ms"]
    for row in rows.values():
        if "median_ms" in row:
            row["speedup_vs_bf16"] = round(bf16 / row["median_ms"], 3)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--shapes", help="comma-separated names of SHAPES (default: all)")
    parser.add_argument(
        "--align", type=int, default=16, help="row multiple of each group (routing pads to 16)"
    )
    parser.add_argument("--out", default="outputs/benchmarks/grouped_backends.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "align": args.align,
        "shapes": {},
    }
    names = args.shapes.split(",") if args.shapes else QUICK if args.quick else tuple(SHAPES)
    print(
        f"{'shape':14} {'gemm':6} {'backend':22} {'ms':>8} {'spread':>7} {'TFLOP/s':>8} "
        f"{'x bf16':>7} {'SQNR':>6}"
    )
    for name in names:
        m, g, k, n = SHAPES[name]
        sizes = _group_sizes(m, g, args.align).cuda()
        offs = sizes.cumsum(0).to(torch.int32)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w_nk = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * m * k * n
        fwd = _forward_backends(x, w_nk, sizes, offs)
        fwd_rows = _time_all(fwd, fwd["bf16"](), args.repeat, flops)
        wgrad = _wgrad_backends(x, dy, offs, sizes)
        wgrad_rows = _time_all(wgrad, wgrad["bf16"](), args.repeat, flops)
        results["shapes"][name] = {
            "M": m,
            "G": g,
            "K": k,
            "N": n,
            "forward": fwd_rows,
            "wgrad": wgrad_rows,
        }
        for gemm, rows in (("fwd", fwd_rows), ("wgrad", wgrad_rows)):
            for backend, row in rows.items():
                if "error" in row:
                    print(f"{name:14} {gemm:6} {backend:22} {row['error']}")
                else:
                    print(
                        f"{name:14} {gemm:6} {backend:22} {row['median_ms']:8.3f} "
                        f"{row['spread_ms']:7.3f} {row['tflops']:8.1f} "
                        f"{row['speedup_vs_bf16']:7.3f} {row['sqnr_db']:6.1f}"
                    )
        del x, w_nk, dy, fwd, wgrad
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
