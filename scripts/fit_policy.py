"""Fit the auto policy's cost model (torchtitan_fp8_moe/policy.py) to the preset benchmark.

    python scripts/fit_policy.py [--json docs/benchmarks/presets/h200.json]

For every preset, token count, mode and run of ``scripts/bench_presets.py`` with both a bf16 and
a float8_moe row, the measured wall time float8_moe saves (bf16 - float8_moe) is the sum of the
model's terms over the layer's converted projections (routed w1, w3, w2 or GPT-OSS's mlp1, mlp2,
and the shared expert's w1, w3, w2). Prints the least-squares coefficients per mode (eager,
compiled), then each row's measured and estimated saving with the coefficients policy.py ships.
"""

import argparse
import json
from pathlib import Path

import torch

from torchtitan_fp8_moe.policy import H200, fp8_gain_ms


def layer_projections(row: dict) -> list[tuple[int, tuple[int, int, int]]]:
    """(rows, weight shape [E, N, K]) of each projection float8_moe converts in the layer."""
    dim, hidden, experts = row["dim"], row["hidden"], row["experts"]
    routed = row["routed_rows"]
    if row["module"] == "GptOssMoE":
        shapes = [(experts, 2 * hidden, dim), (experts, dim, hidden)]
    else:
        shapes = [(experts, hidden, dim)] * 2 + [(experts, dim, hidden)]
    projections = [(routed, shape) for shape in shapes]
    shared = row.get("shared_hidden") or 0
    if shared:
        shared_shapes = [(1, shared, dim)] * 2 + [(1, dim, shared)]
        projections += [(row["tokens"], shape) for shape in shared_shapes]
    return projections


def measured_pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(bf16 row, float8_moe row) of every case measured with both."""
    cases: dict[tuple, dict] = {}
    for row in rows:
        key = (row["preset"], row["tokens"], row["mode"], row["label"])
        cases.setdefault(key, {})[row["impl"]] = row
    return [
        (c["bf16"], c["float8_moe"]) for c in cases.values() if {"bf16", "float8_moe"} <= set(c)
    ]


def estimated_gain_ms(row: dict) -> float:
    compiled = row["mode"] == "compiled"
    return sum(fp8_gain_ms(m, shape, compiled) for m, shape in layer_projections(row))


def _features(row: dict) -> list[float]:
    """The model's terms per unit coefficient, summed over the layer (policy.py's order)."""
    total = [0.0] * 4
    for m, (e, n, k) in layer_projections(row):
        terms = [m * n * k / 1e12, -m * (n + k) / 1e9, -e * n * k / 1e9, -1.0]
        total = [t + x for t, x in zip(total, terms, strict=True)]
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default="docs/benchmarks/presets/h200.json")
    args = parser.parse_args()
    pairs = measured_pairs(json.loads(Path(args.json).read_text()))
    for mode in ("eager", "compiled"):
        chosen = [(b, f) for b, f in pairs if b["mode"] == mode]
        features = torch.tensor([_features(b) for b, _ in chosen], dtype=torch.float64)
        saved = torch.tensor([b["wall_ms"] - f["wall_ms"] for b, f in chosen], dtype=torch.float64)
        fit = torch.linalg.lstsq(features, saved[:, None]).solution.flatten().tolist()
        names = ("gemm_saving", "activation_cast", "weight_cast", "call_overhead")
        print(
            f"{mode} ({len(chosen)} cases): "
            + ", ".join(f"{n}={v:.3f}" for n, v in zip(names, fit, strict=True))
        )
        print(f"  shipped: {H200[mode]}")
        for bf16, fp8 in chosen:
            measured = bf16["wall_ms"] - fp8["wall_ms"]
            print(
                f"  {bf16['preset']:16s} {bf16['tokens']:6d} {bf16['label']:5s} measured "
                f"{measured:7.2f} ms, estimated {estimated_gain_ms(bf16):7.2f}"
            )


if __name__ == "__main__":
    main()
