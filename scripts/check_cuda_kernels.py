"""Train with every CUDA fp8 step checked against the emulation, to find a kernel that is wrong.

    torchrun --nproc_per_node 1 scripts/check_cuda_kernels.py --out check.json \
        --job.config_file train_configs/deepseek_v3_debug.toml --training.steps=8

Runs torchtitan's trainer with float8_moe's CUDA path, and on every call recomputes the same step
from the same inputs the slow, exact way: each quantization with the plain torch rules of
``fp8/recipes/rowwise/torch_quantizers.py``, each fp8 GEMM as a per-group fp32 matmul of the
dequantized operands. Only the rows that belong to a group are compared (the CUDA grouped GEMMs
leave the others unwritten, as ``torch._grouped_mm`` does). Writes one row per distinct (step
kind, shapes) with the worst SQNR seen and the calls whose result was not finite where the
reference was, and prints the rows below ``--bar`` dB. Arguments after the script's own are the
trainer's.
"""

import argparse
import json
import sys
from collections import defaultdict

import torch

WORST: dict[str, dict] = defaultdict(lambda: {"calls": 0, "worst_sqnr_db": float("inf")})


def _record(kind: str, shapes, got: torch.Tensor, want: torch.Tensor, groups: list[int]) -> None:
    from torchtitan_fp8_moe.fp8.sqnr import sqnr

    row = WORST[f"{kind} {shapes}"]
    row["calls"] += 1
    got, want = got.float(), want.float()
    bad = (~torch.isfinite(got) & torch.isfinite(want)).sum().item()
    if bad:
        row.setdefault("non_finite", []).append({"elements": bad, "group_sizes": groups})
    finite = torch.isfinite(got) & torch.isfinite(want)
    if want[finite].abs().max().item() == 0:
        sqnr_db = float("inf") if got[finite].abs().max().item() == 0 else float("-inf")
    else:
        sqnr_db = sqnr(want[finite], got[finite])
    if sqnr_db < row["worst_sqnr_db"]:
        row.update(worst_sqnr_db=sqnr_db, worst_group_sizes=groups)


def _sizes(offs: torch.Tensor) -> list[int]:
    return torch.diff(offs, prepend=offs.new_zeros(1)).tolist()


def _reference_grouped(a, b, offs) -> torch.Tensor:
    out = a.new_zeros((a.shape[0], b.shape[-1]), dtype=torch.float32)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end].float() @ b[g].float()
        start = end
    return out


def _reference_wgrad(a, grad, offs) -> torch.Tensor:
    out = a.new_zeros((offs.numel(), a.shape[1], grad.shape[1]), dtype=torch.float32)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[g] = a[start:end].float().t() @ grad[start:end].float()
        start = end
    return out


def _patch() -> None:
    from torchtitan_fp8_moe.fp8 import gemm
    from torchtitan_fp8_moe.fp8.quantize import dequantize
    from torchtitan_fp8_moe.fp8.recipes import recipe_named

    rowwise = recipe_named("rowwise")
    torch_quantizers, triton_quantizers = rowwise.quantizers(True), rowwise.quantizers(False)
    cuda_grouped_mm, cuda_wgrad = rowwise.grouped_mm, rowwise.grouped_wgrad_mm

    def grouped_mm(a, a_scale, b, b_scale, offs, out_dtype, emulate, backend="torch"):
        out = cuda_grouped_mm(a, a_scale, b, b_scale, offs, out_dtype, emulate, backend)
        if not emulate:
            rows = int(offs[-1])
            want = _reference_grouped(dequantize(a, a_scale), dequantize(b, b_scale), offs)
            shapes = (tuple(a.shape), tuple(b.shape))
            _record("gemm", shapes, out[:rows], want[:rows], _sizes(offs))
        return out

    def grouped_wgrad_mm(a, a_scale, grad, grad_scale, offs, out_dtype, emulate, backend="torch"):
        out = cuda_wgrad(a, a_scale, grad, grad_scale, offs, out_dtype, emulate, backend)
        if not emulate:
            groups = gemm.token_groups(offs, a.shape[0])
            a_hp = a.float() * gemm.per_token(a_scale.reciprocal(), groups)
            grad_hp = grad.float() * gemm.per_token(grad_scale.reciprocal(), groups)
            want = _reference_wgrad(a_hp, grad_hp, offs)
            shapes = (tuple(a.shape), tuple(grad.shape))
            _record("wgrad_gemm", shapes, out, want, _sizes(offs))
        return out

    rowwise.grouped_mm, rowwise.grouped_wgrad_mm = grouped_mm, grouped_wgrad_mm

    def pair_values(result, offs):
        groups = gemm.token_groups(offs, result[0].shape[0])
        rows = int(offs[-1])
        return [
            dequantize(data, gemm.per_token(scales, groups))[:rows]
            for data, scales in (result[:2], result[2:])
        ]

    def checked(name):
        cuda_fn, torch_fn = getattr(triton_quantizers, name), getattr(torch_quantizers, name)

        def quantize(*args, **kwargs):
            got = cuda_fn(*args, **kwargs)
            if name == "weight_transposed":
                # From the torch rules' own amax, so a wrong amax from the CUDA forward shows.
                round_to = kwargs.get("round_to", args[2] if len(args) > 2 else None)
                amax = torch_quantizers.weight(args[0], round_to)[2]
                want = torch_fn(args[0], amax, round_to)
            else:
                want = torch_fn(*args, **kwargs)
            if name == "weight":
                _record("quantize.weight amax over N", tuple(args[0].shape), got[2], want[2], [])
            if name in ("per_group_pair", "tokens_per_group_pair"):
                pairs = zip(pair_values(got, args[-1]), pair_values(want, args[-1]), strict=True)
            else:
                # data and scales (the weight's forward cast also returns an amax)
                pairs = [(dequantize(*got[:2]), dequantize(*want[:2]))]
            for got_hp, want_hp in pairs:
                _record(f"quantize.{name}", tuple(args[0].shape), got_hp, want_hp, [])
            return got

        setattr(triton_quantizers, name, quantize)

    for name in ("rows", "weight", "weight_transposed", "per_group_pair", "tokens_per_group_pair"):
        checked(name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--bar", type=float, default=40.0)
    args, trainer_args = parser.parse_known_args()
    # Before torchtitan is imported: its config parser binds sys.argv when its module loads.
    sys.argv = [sys.argv[0], *trainer_args]
    _patch()
    from torchtitan_fp8_moe import train

    try:
        train.run()
    finally:
        rows = [{"check": key, **value} for key, value in sorted(WORST.items())]
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
        for row in rows:
            flag = "LOW " if row["worst_sqnr_db"] < args.bar or "non_finite" in row else "ok  "
            print(
                f"{flag}{row['check']}: {row['calls']} calls, worst {row['worst_sqnr_db']:.1f} dB"
                + (f", non-finite in {len(row['non_finite'])} calls" if "non_finite" in row else "")
            )


if __name__ == "__main__":
    main()
