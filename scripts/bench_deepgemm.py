"""DeepGEMM's sm90 fp8 grouped GEMMs at the blockwise recipe's scale granularity (activations and
gradients 1x128, weights 128x128, the weight gradient's operands 1x128 along each expert's
tokens), against bf16 ``torch._grouped_mm`` at the same shapes, in one process.

    python scripts/bench_deepgemm.py [--shapes dsv3_671b_ep16,...] [--repeat 3]
        [--out outputs/benchmarks/deepgemm.json]

Needs DeepGEMM (``deepinfer-gemm``, built against the running torch: docs/gemm_backends.md) and
an sm90 GPU. Per shape (M rows in G equal expert groups, K -> N), three GEMMs of one expert
projection, each checked against the bf16 result (``calc_diff``, DeepGEMM's own measure) and
timed by ``triton.testing.do_bench`` in ``--repeat`` interleaved rounds (median and spread):
- forward ``[M, K] x [G, N, K]^T`` and input gradient ``[M, N] x [G, K, N]^T``:
  ``m_grouped_fp8_gemm_nt_contiguous`` (rows of group g marked g in the row-to-group indices);
- weight gradient ``grad_g^T x_g`` per group: ``k_grouped_fp8_gemm_nt_contiguous`` (sm90's
  k-grouped form), operands per group token-contiguous.
Scales are passed in the layout the kernels read (``get_mn_major_tma_aligned_tensor``), so the
times are the GEMMs' own; ``relayout_ms`` is what that relayout of the forward's scales costs.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton.testing

SHAPES = {  # name: (tokens per expert, experts, dim, hidden)
    "dsv3_671b_ep16": (4096, 16, 7168, 2048),
    "dsv3_671b_ep8": (4096, 32, 7168, 2048),
    "qwen3_235b_ep8": (8192, 16, 4096, 1536),
    "scout": (1024, 16, 5120, 8192),
}


def tflops(m, n, k, ms):
    return 2 * m * n * k / ms / 1e9


def shape_rows(name: str, repeat: int) -> list[dict]:
    """The rows of one shape: each GEMM's error against bf16 and both kernels' times."""
    import deep_gemm
    from deep_gemm.testing import calc_diff
    from deep_gemm.utils import per_block_cast_to_fp8, per_token_cast_to_fp8

    tma = deep_gemm.get_mn_major_tma_aligned_tensor
    rows = []
    per_group, groups, dim, hidden = SHAPES[name]
    m = per_group * groups
    x = torch.randn(m, dim, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(groups, hidden, dim, device="cuda", dtype=torch.bfloat16) / dim**0.5
    grad = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    offs = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * per_group
    layout = torch.arange(groups, device="cuda", dtype=torch.int32).repeat_interleave(per_group)

    def blocks(weights):
        fp8, scales = zip(
            *(per_block_cast_to_fp8(wg, use_ue8m0=False) for wg in weights), strict=True
        )
        return torch.stack(fp8), torch.stack(scales)

    x_fp8, x_s = per_token_cast_to_fp8(x, use_ue8m0=False)
    g_fp8, g_s = per_token_cast_to_fp8(grad, use_ue8m0=False)
    w_fp8, w_s = blocks(w)  # [G, N, K]: the forward's K-major weight
    wt_fp8, wt_s = blocks(w.transpose(1, 2).contiguous())  # [G, K, N]: the input gradient's
    # Weight gradient dW[g] [N, K] = grad_g^T [N, T] @ x_g [T, K]: both operands per group
    # token-contiguous ([N, T] and [K, T] blocks one after the other), 1x128 along tokens.
    g_t = torch.cat([grad[i * per_group : (i + 1) * per_group].t() for i in range(groups)], 1)
    x_t = torch.cat([x[i * per_group : (i + 1) * per_group].t() for i in range(groups)], 1)
    gt_fp8, gt_s = per_token_cast_to_fp8(g_t, use_ue8m0=False)  # [N, sum T], 1x128 over T
    xt_fp8, xt_s = per_token_cast_to_fp8(x_t, use_ue8m0=False)

    # The k-grouped kernel reads group g's [N, T_g] block contiguous, and the scales as one
    # [N, sum T / 128] matrix (what the cast of the concatenated blocks gives).
    def per_group_blocks(t_fp8):
        return torch.cat(
            [t_fp8[:, i * per_group : (i + 1) * per_group].reshape(-1) for i in range(groups)]
        )

    gk_fp8, xk_fp8 = per_group_blocks(gt_fp8), per_group_blocks(xt_fp8)
    ks = [per_group] * groups
    ks_dev = torch.tensor(ks, device="cuda", dtype=torch.int32)

    fwd_out = torch.empty(m, hidden, device="cuda", dtype=torch.bfloat16)
    dgrad_out = torch.empty(m, dim, device="cuda", dtype=torch.bfloat16)
    wgrad_out = torch.zeros(groups, hidden, dim, device="cuda", dtype=torch.float32)
    x_s_t, g_s_t = tma(x_s), tma(g_s)

    cases = {
        "forward": (
            lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous(
                (x_fp8, x_s_t), (w_fp8, w_s), fwd_out, layout, disable_ue8m0_cast=True
            ),
            lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs),
            lambda: fwd_out,
            (m, hidden, dim),
        ),
        "input_grad": (
            lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous(
                (g_fp8, g_s_t), (wt_fp8, wt_s), dgrad_out, layout, disable_ue8m0_cast=True
            ),
            lambda: torch._grouped_mm(grad, w, offs=offs),
            lambda: dgrad_out,
            (m, dim, hidden),
        ),
        "weight_grad": (
            lambda: deep_gemm.k_grouped_fp8_gemm_nt_contiguous(
                (gk_fp8, gt_s), (xk_fp8, xt_s), wgrad_out, ks, ks_dev, wgrad_out
            ),
            lambda: torch._grouped_mm(grad.t(), x, offs=offs),
            lambda: wgrad_out,
            (hidden, dim, m),
        ),
    }
    for gemm, (fp8_call, bf16_call, result, (mm, nn, kk)) in cases.items():
        row = {"shape": name, "gemm": gemm, "m": mm, "n": nn, "k": kk, "groups": groups}
        try:
            wgrad_out.zero_()
            fp8_call()
            ref = bf16_call().float()
            row["diff"] = float(calc_diff(result().float(), ref))
            fp8_ms, bf16_ms = [], []
            for _ in range(repeat):  # interleaved
                bf16_ms.append(triton.testing.do_bench(bf16_call, warmup=25, rep=100))
                fp8_ms.append(triton.testing.do_bench(fp8_call, warmup=25, rep=100))
            for label, times in (("bf16", bf16_ms), ("deepgemm", fp8_ms)):
                med = statistics.median(times)
                row[f"{label}_ms"] = med
                row[f"{label}_tflops"] = tflops(mm, nn, kk, med)
                row[f"{label}_spread_pct"] = 100 * (max(times) - min(times)) / med
        except Exception as error:  # noqa: BLE001 - a failing kernel is a result
            row["error"] = f"{type(error).__name__}: {error}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    relayout = triton.testing.do_bench(lambda: tma(x_s), warmup=25, rep=100)
    rows.append({"shape": name, "gemm": "relayout_forward_scales", "ms": relayout})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="outputs/benchmarks/deepgemm.json")
    args = parser.parse_args()

    import deep_gemm

    torch.manual_seed(0)
    print(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"deep_gemm {deep_gemm.__version__}, SMs {deep_gemm.get_num_sms()}"
    )
    rows = []
    for name in args.shapes.split(","):
        rows += shape_rows(name, args.repeat)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(
        f"\n{'shape':16} {'gemm':12} {'bf16 TF':>8} {'DeepGEMM TF':>11} {'x bf16':>7} {'diff':>8}"
    )
    for row in rows:
        if "bf16_ms" in row:
            print(
                f"{row['shape']:16} {row['gemm']:12} {row['bf16_tflops']:8.0f} "
                f"{row['deepgemm_tflops']:11.0f} {row['bf16_ms'] / row['deepgemm_ms']:7.2f} "
                f"{row['diff']:8.5f}"
            )
        elif "error" in row:
            print(f"{row['shape']:16} {row['gemm']:12} error: {row['error'][:120]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
