"""Blockwise fp8 (ours, Triton) against bf16, torch's fp8 rowwise and torchao's blockwise
prototype: each grouped GEMM alone and with its casts, and a whole routed expert layer.

    python scripts/bench_blockwise.py [--quick | --only scout_16k,...] [--repeat 3]
        [--out outputs/benchmarks/blockwise.json]

GEMM rows, per shape (token groups even and 128-aligned; Llama4 Scout's routed projection, 16
experts, 5120 -> 8192, at 16K and 64K routed tokens, and DeepSeek-V3's with 16 local experts,
7168 -> 2048, at 64K; ``--quick``: Scout 16K), for the forward ``y = x . W_g``, the input
gradient ``dx = dy . W_g^T`` and the weight gradient ``dW_g = x_g^T . dy_g``:
- ``bf16``: ``torch._grouped_mm``;
- ``blockwise``: our Triton GEMMs alone, on the operands our CUDA quantizers write (each GEMM's
  contraction dim contiguous); ``cublas``: the recipe's CUDA GEMMs on the same operands, cuBLAS's
  blockwise ``scaled_mm`` per group where the GPU has it (equal to ours bit for bit, checked);
  ``blockwise+cast``: the recipe's GEMMs (as ``cublas``) with the casts the training step
  makes for them (forward: activation and weight; input gradient: output gradient and the
  weight's transposed copy; weight gradient: both operands per group), through the recipe;
- ``rowwise``: ``torch._scaled_grouped_mm`` alone (the package's default recipe);
- ``torchao``: torchao's blockwise Triton GEMMs (``triton_fp8_gemm_1x128_128x128``,
  ``triton_fp8_gemm_1x128_128x1``), dense kernels, so one call per group.
Layer rows: a routed expert layer's forward and backward (``h = silu(x . w1) * (x . w3)``,
``y = h . w2``, the input and three weight gradients) at Scout's shapes, 16K and 64K routed
tokens: ``bf16`` (``torch._grouped_mm``) against ``blockwise`` (``fp8_grouped_mm``, the autograd
function training runs, ``recipe_named("blockwise")``, ``emulate=False``).

Times: triton ``do_bench`` medians (ms) after a first call that compiles and autotunes; the
implementations interleaved for ``--repeat`` rounds; the table gives the median of the rounds and
their spread (min-max); TFLOP/s counts 2*M*K*N per GEMM. Before timing, each GEMM shape checks
our casts against the torch rules (bit for bit), our GEMMs against fp64 math on the same fp8
values and SQNR against bf16. A failing case prints an error row and the run goes on. Needs
CUDA with fp8 (sm89+) and torch, triton (torchao for its rows); not torchtitan.
"""

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench


def _math_core_without_torchtitan() -> None:
    """The package's ``__init__`` registers with torchtitan; its math core (``fp8/``) needs torch
    only, so it is imported under a bare package."""
    if "torchtitan_fp8_moe" not in sys.modules:
        package = types.ModuleType("torchtitan_fp8_moe")
        package.__path__ = [str(Path(__file__).resolve().parents[1] / "torchtitan_fp8_moe")]
        sys.modules["torchtitan_fp8_moe"] = package


_math_core_without_torchtitan()
from torchtitan_fp8_moe.fp8 import fp8_grouped_mm, recipe_named  # noqa: E402
from torchtitan_fp8_moe.fp8.kernels import blockwise_cublas, blockwise_gemm  # noqa: E402
from torchtitan_fp8_moe.fp8.kernels.blockwise_gemm import (  # noqa: E402
    blockwise_grouped_mm,
    blockwise_grouped_mm_wgrad,
)
from torchtitan_fp8_moe.fp8.quantize import quantize_rowwise  # noqa: E402
from torchtitan_fp8_moe.fp8.recipes.blockwise.torch_quantizers import TORCH_QUANTIZERS as rules  # noqa: E402
from torchtitan_fp8_moe.fp8.recipes.blockwise.triton_quantizers import TRITON_QUANTIZERS as cuda  # noqa: E402
from torchtitan_fp8_moe.fp8.sqnr import sqnr  # noqa: E402

# (name, experts, K (in), N (out), routed tokens)
GEMM_SHAPES = [
    ("scout_16k", 16, 5120, 8192, 16384),
    ("scout_64k", 16, 5120, 8192, 65536),
    ("dsv3_ep16_64k", 16, 7168, 2048, 8192 * 8),
]
# (name, experts, dim, hidden, routed tokens)
LAYER_SHAPES = [
    ("scout_layer_16k", 16, 5120, 8192, 16384),
    ("scout_layer_64k", 16, 5120, 8192, 65536),
]
QUICK = {"scout_16k", "scout_layer_16k", "scout_layer_64k"}
OPS = ("fwd", "dgrad", "wgrad")
DEVICE = "cuda"
BLOCKWISE = recipe_named("blockwise")


def even_ends(tokens: int, experts: int) -> list[int]:
    """Cumulative ends of ``experts`` even groups, each a multiple of 128 tokens."""
    size = tokens // experts // 128 * 128
    ends = [size * (group + 1) for group in range(experts)]
    ends[-1] = tokens
    return ends


def column_major(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-2, -1).contiguous().transpose(-2, -1)


class GemmCase:
    """One shape's operands, bf16 and quantized, and the GEMM calls of every implementation."""

    def __init__(self, experts: int, k: int, n: int, tokens: int):
        self.k, self.n, self.tokens = k, n, tokens
        self.ends = even_ends(tokens, experts)
        self.offs = torch.tensor(self.ends, dtype=torch.int32, device=DEVICE)
        self.x = torch.randn(tokens, k, device=DEVICE, dtype=torch.bfloat16)
        self.dy = torch.randn(tokens, n, device=DEVICE, dtype=torch.bfloat16)
        # Stored as torchtitan stores experts, [E, out, in]; the GEMM sees [E, in, out].
        stored = torch.randn(experts, n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02
        self.w = stored.transpose(-2, -1)
        self.x_q, self.dy_q = cuda.rows(self.x), cuda.rows(self.dy)
        w_data, w_scale, state = cuda.weight(self.w)
        self.w_q, self.w_t_q = (w_data, w_scale), cuda.weight_transposed(self.w, state)
        self.pair = cuda.per_group_pair(self.x, self.dy, self.offs)

    def flops(self) -> float:
        return 2.0 * self.tokens * self.k * self.n

    def bf16(self):
        return {
            "fwd": lambda: torch._grouped_mm(self.x, self.w, offs=self.offs),
            "dgrad": lambda: torch._grouped_mm(self.dy, self.w.transpose(-2, -1), offs=self.offs),
            "wgrad": lambda: torch._grouped_mm(self.x.t(), self.dy, offs=self.offs),
        }

    def fwd(self, out_dtype=torch.bfloat16):
        return blockwise_grouped_mm(*self.x_q, *self.w_q, self.offs, out_dtype)

    def dgrad(self, out_dtype=torch.bfloat16):
        return blockwise_grouped_mm(*self.dy_q, *self.w_t_q, self.offs, out_dtype)

    def wgrad(self):
        blocks = self.tokens // 128  # the recipe's slice: the global 128-token blocks
        x, x_scale, dy, dy_scale = self.pair
        return blockwise_grouped_mm_wgrad(
            x, x_scale[:blocks], dy, dy_scale[:blocks], self.offs, torch.bfloat16
        )

    def blockwise(self):
        return {"fwd": self.fwd, "dgrad": self.dgrad, "wgrad": self.wgrad}

    def blockwise_with_casts(self):
        """The training step's calls: the recipe's CUDA quantizers and GEMMs."""
        offs, bf16 = self.offs, torch.bfloat16

        def fwd():
            data, scale, _ = cuda.weight(self.w)
            return BLOCKWISE.grouped_mm(*cuda.rows(self.x), data, scale, offs, bf16, False)

        def dgrad():
            w_t = cuda.weight_transposed(self.w, self.w_q[1])
            return BLOCKWISE.grouped_mm(*cuda.rows(self.dy), *w_t, offs, bf16, False)

        def wgrad():
            pair = cuda.per_group_pair(self.x, self.dy, offs)
            return BLOCKWISE.grouped_wgrad_mm(*pair, offs, bf16, False)

        return {"fwd": fwd, "dgrad": dgrad, "wgrad": wgrad}

    def rowwise(self):
        """torch's fp8 rowwise grouped GEMM, GEMM only (scales are our multipliers' inverses)."""
        x, x_s = quantize_rowwise(self.x, -1)
        dy, dy_s = quantize_rowwise(self.dy, -1)
        w, w_s = quantize_rowwise(self.w, -2)  # [G, K, N], scales [G, 1, N]
        w_t, w_t_s = quantize_rowwise(self.w.transpose(-2, -1), -2)  # [G, N, K], [G, 1, K]
        # Per column over all tokens, for the timing only (the recipe's are per group).
        x_c, x_c_s = quantize_rowwise(self.x, 0)
        dy_c, dy_c_s = quantize_rowwise(self.dy, 0)
        groups = len(self.ends)
        operands = {
            "fwd": (x, column_major(w), x_s.view(-1), w_s.squeeze(-2)),
            "dgrad": (dy, column_major(w_t), dy_s.view(-1), w_t_s.squeeze(-2)),
            "wgrad": (
                dy_c.t().contiguous(),
                column_major(x_c),
                dy_c_s.repeat(groups, 1).view(-1),
                x_c_s.repeat(groups, 1).view(-1),
            ),
        }

        def call(a, b, a_s, b_s):
            return torch._scaled_grouped_mm(
                a,
                b,
                a_s.reciprocal(),
                b_s.reciprocal(),
                offs=self.offs,
                out_dtype=torch.bfloat16,
                use_fast_accum=True,
            )

        return {op: (lambda args=operands[op]: call(*args)) for op in OPS}

    def cublas(self):
        """The recipe's CUDA GEMMs (``kernels/blockwise_cublas.py``: cuBLAS's blockwise
        ``scaled_mm`` per group where the GPU has it) on the same fp8 operands, their scale
        layouts and the group bounds' host read (once per offsets tensor) included."""
        x_c, x_c_s, dy_c, dy_c_s = self.pair
        blocks = self.tokens // 128
        bf16 = torch.bfloat16
        return {
            "fwd": lambda: blockwise_cublas.blockwise_grouped_mm(
                *self.x_q, *self.w_q, self.offs, bf16
            ),
            "dgrad": lambda: blockwise_cublas.blockwise_grouped_mm(
                *self.dy_q, *self.w_t_q, self.offs, bf16
            ),
            "wgrad": lambda: blockwise_cublas.blockwise_grouped_mm_wgrad(
                x_c, x_c_s[:blocks], dy_c, dy_c_s[:blocks], self.offs, bf16
            ),
        }

    def torchao(self):
        """torchao's dense blockwise kernels, one call per group (they multiply by
        reciprocals, and want the operands in the layouts below)."""
        from torchao.prototype.blockwise_fp8_training.kernels import (
            triton_fp8_gemm_1x128_128x1,
            triton_fp8_gemm_1x128_128x128,
        )

        spans = list(zip([0, *self.ends[:-1]], self.ends, strict=True))
        x, x_s = self.x_q[0], column_major(self.x_q[1].reciprocal())
        dy, dy_s = self.dy_q[0], column_major(self.dy_q[1].reciprocal())
        w, w_s = self.w_q[0], column_major(self.w_q[1].reciprocal())  # [G, K, N], K contiguous
        w_t, w_t_s = self.w_t_q[0], column_major(self.w_t_q[1].reciprocal())  # N contiguous
        # dW_g^T [N, K] = dy_g^T [N, M_g] . x_g [M_g, K]: 1x128 tiles of dy^T along the tokens,
        # 128x1 of x; our token-contiguous data and row-major scales are those layouts.
        x_c, x_c_s, dy_c, dy_c_s = self.pair
        dy_t, dy_t_s = dy_c.t(), dy_c_s.reciprocal().t()
        x_c_s = x_c_s.reciprocal()

        def fwd():
            return [
                triton_fp8_gemm_1x128_128x128(x[s:e], w[g], x_s[s:e], w_s[g], 128, torch.bfloat16)
                for g, (s, e) in enumerate(spans)
            ]

        def dgrad():
            return [
                triton_fp8_gemm_1x128_128x128(
                    dy[s:e], w_t[g], dy_s[s:e], w_t_s[g], 128, torch.bfloat16
                )
                for g, (s, e) in enumerate(spans)
            ]

        def wgrad():
            return [
                triton_fp8_gemm_1x128_128x1(
                    dy_t[:, s:e],
                    x_c[s:e],
                    dy_t_s[:, s // 128 : e // 128],
                    x_c_s[s // 128 : e // 128],
                    128,
                    torch.bfloat16,
                )
                for s, e in spans
            ]

        return {"fwd": fwd, "dgrad": dgrad, "wgrad": wgrad}


def check_gemms(case: GemmCase) -> dict:
    """Our casts against the torch rules (fp8 codes and scales equal), our GEMMs against fp64
    math on the same fp8 values (256 rows of the first and of the last group; those two groups'
    weight gradients), SQNR against bf16; raises when off."""
    result = {}
    for name, got, want in (
        ("rows", case.x_q, rules.rows(case.x)),
        ("weight", case.w_q, rules.weight(case.w)[:2]),
        ("weight_transposed", case.w_t_q, rules.weight_transposed(case.w, case.w_q[1])),
        ("per_group_pair", case.pair, rules.per_group_pair(case.x, case.dy, case.offs)),
    ):
        result[f"{name}_equals_torch_rules"] = all(
            torch.equal(g.view(torch.uint8), w.view(torch.uint8))
            if g.dtype != torch.float32
            else torch.equal(g, w)
            for g, w in zip(got, want, strict=True)
        )
    starts, ends = [0, *case.ends[:-1]], case.ends
    spot_groups = (0, len(ends) - 1)

    def error(got, want, magnitude):
        return ((got.double() - want).abs() / magnitude.clamp(min=1e-30)).max().item()

    def dequantized_blocks(data, scale):
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        return data.double() / full[: data.shape[0], : data.shape[1]]

    def spot_error(got, a, a_scale, w_data, w_scale):
        errors = []
        for g in spot_groups:
            rows = slice(ends[g] - 256, ends[g])
            a_g = a[rows].double() / a_scale[rows].repeat_interleave(128, 1)[:, : a.shape[1]]
            w = dequantized_blocks(w_data[g], w_scale[g])
            errors.append(error(got[rows], a_g @ w, a_g.abs() @ w.abs()))
        return max(errors)

    fp32 = torch.float32  # the error checks take the GEMMs' fp32 results, before bf16 rounding
    result["fwd_max_error_vs_fp64"] = spot_error(case.fwd(fp32), *case.x_q, *case.w_q)
    result["dgrad_max_error_vs_fp64"] = spot_error(case.dgrad(fp32), *case.dy_q, *case.w_t_q)
    x_c, x_c_s, dy_c, dy_c_s = case.pair
    blocks = case.tokens // 128
    dw = blockwise_grouped_mm_wgrad(x_c, x_c_s[:blocks], dy_c, dy_c_s[:blocks], case.offs)
    errors = []
    for g in spot_groups:
        rows = slice(starts[g], ends[g])
        x = x_c[rows].double() / x_c_s.repeat_interleave(128, 0)[rows]
        dy = dy_c[rows].double() / dy_c_s.repeat_interleave(128, 0)[rows]
        errors.append(error(dw[g], x.t() @ dy, x.t().abs() @ dy.abs()))
    result["wgrad_max_error_vs_fp64"] = max(errors)
    bf16 = case.bf16()
    for op, ours in (("fwd", case.fwd()), ("dgrad", case.dgrad()), ("wgrad", dw)):
        result[f"{op}_sqnr_vs_bf16"] = round(sqnr(bf16[op]().float(), ours.float()), 2)
    # A wrong scale, group or block errs by O(1); fp8 MMA accumulation by < 2**-8.
    bad = {key: value for key, value in result.items() if "error" in key and value > 2**-8}
    bad |= {key: value for key, value in result.items() if "sqnr" in key and value < 23}
    bad |= {key: value for key, value in result.items() if "equals" in key and not value}
    if bad:
        raise AssertionError(f"blockwise results off: {bad}")
    return result


class LayerCase:
    """A routed expert layer, forward and backward: ``y = (silu(x . w1) * (x . w3)) . w2``."""

    def __init__(self, experts: int, dim: int, hidden: int, tokens: int):
        self.tokens, self.dim, self.hidden = tokens, dim, hidden
        self.offs = torch.tensor(even_ends(tokens, experts), dtype=torch.int32, device=DEVICE)
        self.x = torch.randn(tokens, dim, device=DEVICE, dtype=torch.bfloat16)
        self.grad = torch.randn(tokens, dim, device=DEVICE, dtype=torch.bfloat16)

        def weight(out_features, in_features):  # [E, out, in], as torchtitan stores experts
            w = torch.randn(experts, out_features, in_features, device=DEVICE) * 0.02
            return w.bfloat16().requires_grad_()

        self.w1, self.w3, self.w2 = weight(hidden, dim), weight(hidden, dim), weight(dim, hidden)

    def flops(self) -> float:
        return 3 * 3 * 2.0 * self.tokens * self.dim * self.hidden  # 3 GEMMs, each fwd + 2 bwd

    def step(self, mm):
        """Forward and backward; the input and weight gradients (not accumulated)."""
        x = self.x.detach().requires_grad_()
        weights = (self.w1, self.w3, self.w2)
        w1, w3, w2 = (w.transpose(-2, -1) for w in weights)
        h = F.silu(mm(x, w1)) * mm(x, w3)
        y = mm(h, w2)
        return y, torch.autograd.grad(y, (x, *weights), self.grad)

    def impls(self):
        offs = self.offs
        return {
            "bf16": lambda: self.step(lambda a, b: torch._grouped_mm(a, b, offs=offs)),
            "blockwise": lambda: self.step(
                lambda a, b: fp8_grouped_mm(a, b, offs, BLOCKWISE, emulate=False)
            ),
        }

    def check(self) -> dict:
        """SQNR of the output and each gradient against bf16's."""
        impls = self.impls()
        want_y, want_grads = impls["bf16"]()
        got_y, got_grads = impls["blockwise"]()
        names = ("y", "dx", "dw1", "dw3", "dw2")
        pairs = zip(names, (want_y, *want_grads), (got_y, *got_grads), strict=True)
        return {
            f"{name}_sqnr_vs_bf16": round(sqnr(w.float(), g.float()), 2) for name, w, g in pairs
        }


def bench(fn, rep_ms: int) -> float:
    return do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:300]


def measure(calls: dict, repeat: int, rep_ms: int, flops: float) -> list[dict]:
    """``calls``: (impl, op) -> fn. First calls (compile, autotune) apart, then ``repeat``
    interleaved rounds; a call that fails gives an error row."""
    rows = {key: {"impl": key[0], "op": key[1], "samples_ms": []} for key in calls}
    for key, fn in calls.items():
        begin = time.perf_counter()
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as error:  # an unavailable baseline or a broken case: reported
            rows[key]["error"] = _error(error)
        rows[key]["first_call_s"] = round(time.perf_counter() - begin, 2)
    for _ in range(repeat):
        for key, fn in calls.items():
            if "error" not in rows[key]:
                try:
                    rows[key]["samples_ms"].append(round(bench(fn, rep_ms), 4))
                except Exception as error:
                    rows[key]["error"] = _error(error)
    for row in rows.values():
        if row["samples_ms"] and "error" not in row:
            samples = row["samples_ms"]
            row["ms"] = round(statistics.median(samples), 4)
            row["min_ms"], row["max_ms"] = min(samples), max(samples)
            row["tflops"] = round(flops / row["ms"] / 1e9, 1)
    for row in rows.values():
        base = rows.get(("bf16", row["op"]), {}).get("ms")
        if base and "ms" in row:
            row["vs_bf16"] = round(base / row["ms"], 3)
    return list(rows.values())


def print_table(title: str, rows: list[dict], checks: dict, notes: dict) -> None:
    print(f"\n{title}")
    if checks:
        print(f"  checks: {checks}")
    for key, note in notes.items():
        print(f"  {key}: {note}")
    print(f"  {'impl':<16}{'op':<10}{'ms':>9}{'min-max':>19}{'TFLOP/s':>9}{'vs bf16':>9}")
    for row in rows:
        if "ms" not in row:
            print(f"  {row['impl']:<16}{row['op']:<10}  ERROR {row.get('error', 'no samples')}")
            continue
        spread = f"{row['min_ms']:.3f}-{row['max_ms']:.3f}"
        speedup = f"{row['vs_bf16']:.2f}x" if "vs_bf16" in row else ""
        print(
            f"  {row['impl']:<16}{row['op']:<10}{row['ms']:>9.3f}{spread:>19}"
            f"{row['tflops']:>9.1f}{speedup:>9}"
        )


def run_gemm_shape(shape, repeat: int) -> dict:
    name, experts, k, n, tokens = shape
    entry = {"name": name, "experts": experts, "k": k, "n": n, "tokens": tokens, "notes": {}}
    entry["checks"], entry["rows"] = {}, []
    try:
        case = GemmCase(experts, k, n, tokens)
    except Exception as error:
        entry["notes"]["setup"] = _error(error)
        print_table(f"{name}: setup failed", [], {}, entry["notes"])
        return entry
    impls = {
        "bf16": case.bf16,
        "blockwise": case.blockwise,
        "blockwise+cast": case.blockwise_with_casts,
        "rowwise": case.rowwise,
        "torchao": case.torchao,
        "cublas": case.cublas,
    }
    calls = {}
    for impl, make in impls.items():
        try:
            calls |= {(impl, op): fn for op, fn in make().items()}
        except Exception as error:  # torchao not importable, say
            entry["notes"][impl] = _error(error)
    try:
        entry["checks"] = check_gemms(case)
    except Exception as error:
        entry["notes"]["checks"] = _error(error)
    try:
        cublas_calls = case.cublas()
        ours = {"fwd": case.fwd(), "dgrad": case.dgrad(), "wgrad": case.wgrad()}
        for op in OPS:
            same = torch.equal(cublas_calls[op](), ours[op])
            entry["checks"][f"cublas_{op}_equals_triton"] = same
    except Exception as error:
        entry["notes"]["cublas_check"] = _error(error)
    entry["rows"] = measure(calls, repeat, 100, case.flops())
    title = f"{name}: GEMMs, M={tokens} K={k} N={n} groups={experts}"
    print_table(title, entry["rows"], entry["checks"], entry["notes"])
    return entry


def run_layer_shape(shape, repeat: int) -> dict:
    name, experts, dim, hidden, tokens = shape
    entry = {"name": name, "experts": experts, "dim": dim, "hidden": hidden, "tokens": tokens}
    entry["notes"], entry["checks"], entry["rows"] = {}, {}, []
    try:
        case = LayerCase(experts, dim, hidden, tokens)
        calls = {(impl, "layer"): fn for impl, fn in case.impls().items()}
        entry["rows"] = measure(calls, repeat, 300, case.flops())
        entry["checks"] = case.check()
    except Exception as error:
        entry["notes"]["error"] = _error(error)
    title = f"{name}: expert layer fwd+bwd, M={tokens} dim={dim} hidden={hidden} experts={experts}"
    print_table(title, entry["rows"], entry["checks"], entry["notes"])
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only {sorted(QUICK)}")
    parser.add_argument("--only", default="", help="comma-separated shape names (default: all)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="outputs/benchmarks/blockwise.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_blockwise.py needs a CUDA device with fp8 (sm89+)")
    torch.manual_seed(0)
    started = time.perf_counter()
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "repeat": args.repeat,
        "gemms": [],
        "layers": [],
    }
    only = set(filter(None, args.only.split(",")))
    unknown = only - {shape[0] for shape in GEMM_SHAPES + LAYER_SHAPES}
    if unknown:
        raise SystemExit(f"--only: unknown shapes {sorted(unknown)}")

    def chosen(name: str) -> bool:
        return (name in only) if only else (not args.quick or name in QUICK)

    for shape in GEMM_SHAPES:
        if chosen(shape[0]):
            report["gemms"].append(run_gemm_shape(shape, args.repeat))
            torch.cuda.empty_cache()
    for shape in LAYER_SHAPES:
        if chosen(shape[0]):
            report["layers"].append(run_layer_shape(shape, args.repeat))
            torch.cuda.empty_cache()
    report["autotuned"] = {
        kernel.fn.__name__: {str(key): str(config) for key, config in kernel.cache.items()}
        for kernel in (blockwise_gemm._grouped_mm_kernel, blockwise_gemm._wgrad_kernel)
    }
    print("\nautotuned configs:", json.dumps(report["autotuned"], indent=1))
    report["wall_s"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out} ({report['wall_s']} s)")


if __name__ == "__main__":
    main()
