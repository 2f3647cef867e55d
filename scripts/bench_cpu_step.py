"""CPU step time of torchtitan's trainer, bf16 vs float8_moe (emulated fp8), on MoE debug models.

    python3 scripts/bench_cpu_step.py [--repeat 2] [--steps 6] [--warmup 2] [--ngpu 2]
        [--seq-len 128] [--local-batch-size 2] [--models llama4,qwen3,deepseek_v3]

Runs torchtitan's real trainer through scripts/run_train.sh (gloo on CPU, the emulated fp8 path)
on train_configs/llama4_debug.toml, switching model and flavor with torchtitan overrides. The bf16
baseline is the same config with ``converters = []``. Variants are interleaved (bf16 and
float8_moe alternate, and which goes first alternates between repeats) so that a change in the
machine's load hits both alike. A step's time is the gap between the timestamps of its log line
and the previous step's; each run's median over the steps after ``--warmup`` is its time, and a
variant's time is the median over its runs (spread: the lowest and highest run). Writes
--out (default outputs/benchmarks/cpu_step.json) and a .md beside it, and every run's log under
outputs/bench_cpu_step/.
"""

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = "train_configs/llama4_debug.toml"
# The debug flavors all have vocab 2048, the bundled tokenizer's size, so the config's
# hf_assets_path serves them all.
MODELS = {
    "llama4": ("llama4 debugmodel", []),
    "qwen3": ("qwen3 debugmodel_moe", ["--model.name=qwen3", "--model.flavor=debugmodel_moe"]),
    "deepseek_v3": (
        "deepseek_v3 debugmodel",
        ["--model.name=deepseek_v3", "--model.flavor=debugmodel"],
    ),
}
VARIANTS = ("bf16", "float8_moe")
ANSI_COLOR = re.compile(r"\x1b\[[0-9;]*m")
# torchtitan's per-step metrics line, with its logger's timestamp (milliseconds).
STEP_LINE = re.compile(
    r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?"
    r"step: +(\d+) +loss: +(\S+).*?tps: +([\d,]+)"
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeat", type=int, default=2, help="runs of each variant")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    parser.add_argument("--ngpu", type=int, default=2, help="trainer processes")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--local-batch-size", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    parser.add_argument("--out", default="outputs/benchmarks/cpu_step.json")
    parser.add_argument("--logs", default="outputs/bench_cpu_step")
    args = parser.parse_args()
    if args.steps < args.warmup + 2:
        parser.error("--steps must exceed --warmup by at least 2 (one timed step gap)")
    return args


def cpu_capability() -> str:
    """The vector ISA torch's CPU kernels use here (bf16 matmuls are slow without AVX512-BF16 or
    AMX, which the fp32 GEMMs of the fp8 emulation do not need)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def bf16_config(folder: Path) -> Path:
    """The config without its model converter (torchtitan's CLI cannot empty a list)."""
    text = (REPO / CONFIG).read_text()
    if 'converters = ["float8_moe"]' not in text:
        raise SystemExit(f'{CONFIG}: expected a line converters = ["float8_moe"]')
    path = folder / "llama4_debug_bf16.toml"
    path.write_text(text.replace('converters = ["float8_moe"]', "converters = []"))
    return path


def train(config: Path, overrides: list[str], args, log_path: Path) -> tuple[int, str]:
    """Run the trainer; (return code, log). A run past --timeout is killed with its workers."""
    env = dict(os.environ, NGPU=str(args.ngpu), CONFIG_FILE=str(config), LOG_RANK="0")
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            ["./scripts/run_train.sh", *overrides],
            cwd=REPO,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        try:
            returncode = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            # run_train.sh execs torchrun, whose agent stops its workers when it gets SIGTERM.
            proc.terminate()
            returncode = proc.wait()
    return returncode, ANSI_COLOR.sub("", log_path.read_text())


def step_times(log: str) -> tuple[dict[int, float], dict[int, float]]:
    """({step: seconds since the previous step's log line}, {step: loss}) from rank 0's log."""
    stamps, losses = {}, {}
    for stamp, step, loss, _tps in STEP_LINE.findall(log):
        when = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        stamps[int(step)], losses[int(step)] = when, float(loss)
    gaps = {s: round(stamps[s] - stamps[s - 1], 3) for s in stamps if s - 1 in stamps}
    return gaps, losses


def first_error(log: str) -> str:
    """The last exception line of a failed run's log (the root cause torchrun re-raises)."""
    lines = [line.split("]:", 1)[-1].strip() for line in log.splitlines()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b.*:", line)]
    return errors[-1] if errors else "\n".join(lines[-15:])


def run_variant(model: str, variant: str, repeat: int, args, bf16: Path) -> dict:
    config = bf16 if variant == "bf16" else REPO / CONFIG
    logs = REPO / args.logs
    overrides = [
        *MODELS[model][1],
        f"--training.steps={args.steps}",
        f"--training.seq_len={args.seq_len}",
        f"--training.local_batch_size={args.local_batch_size}",
        f"--job.dump_folder={logs / 'dump' / f'{model}_{variant}'}",
        "--metrics.disable_color_printing",
    ]
    log_path = logs / f"{model}_{variant}_r{repeat}.log"
    load_avg = round(os.getloadavg()[0], 2)  # other jobs on the machine slow a run down
    started = time.time()
    returncode, log = train(config, overrides, args, log_path)
    gaps, losses = step_times(log)
    timed = [gaps[s] for s in sorted(gaps) if s > args.warmup]
    run = {
        "repeat": repeat,
        "returncode": returncode,
        "wall_s": round(time.time() - started, 1),
        "load_avg_at_start": load_avg,
        "log": os.path.relpath(log_path, REPO),
        "losses": losses,
        "step_s": gaps,
    }
    if returncode == 0 and timed:
        run["median_step_s"] = round(statistics.median(timed), 3)
        run["best_step_s"] = min(timed)
    else:
        run["error"] = first_error(log)
    print(
        f"  {model:12} {variant:10} run {repeat}: "
        f"{run.get('median_step_s', 'failed: ' + run.get('error', ''))}",
        flush=True,
    )
    return run


def summarize(runs: list[dict]) -> dict:
    medians = [r["median_step_s"] for r in runs if "median_step_s" in r]
    summary = {"runs": runs}
    if medians:
        # best_step_s: the fastest timed step of any run, the one least slowed by other jobs.
        summary.update(
            median_step_s=round(statistics.median(medians), 3),
            spread_s=[min(medians), max(medians)],
            best_step_s=min(r["best_step_s"] for r in runs if "best_step_s" in r),
        )
    return summary


def compare(result: dict) -> None:
    """float8_moe / bf16: of the medians, of the best steps, and of each repeat's pair of runs
    (run back to back, so under about the same load)."""
    bf16, fp8 = result["bf16"], result["float8_moe"]
    if "median_step_s" not in bf16 or "median_step_s" not in fp8:
        return
    result["ratio"] = round(fp8["median_step_s"] / bf16["median_step_s"], 3)
    result["ratio_best_step"] = round(fp8["best_step_s"] / bf16["best_step_s"], 3)
    fp8_runs = {r["repeat"]: r for r in fp8["runs"] if "median_step_s" in r}
    result["ratio_per_repeat"] = [
        round(fp8_runs[b["repeat"]]["median_step_s"] / b["median_step_s"], 3)
        for b in bf16["runs"]
        if "median_step_s" in b and b["repeat"] in fp8_runs
    ]
    result["within_2x"] = result["ratio"] <= 2.0


def _seconds(summary: dict) -> str:
    if "median_step_s" not in summary:
        return "failed"
    return f"{summary['median_step_s']:.2f} ({summary['best_step_s']:.2f})"


def _spread(summary: dict) -> str:
    return "{:.2f}-{:.2f}".format(*summary["spread_s"]) if "spread_s" in summary else "-"


def table(results: dict) -> list[str]:
    rows = [
        "| model | bf16 s/step median (best) | float8_moe s/step median (best) "
        "| spread of runs bf16 / float8_moe (s) | float8_moe / bf16: median, best step "
        "| per repeat |",
        "|---|---|---|---|---|---|",
    ]
    for model, result in results.items():
        bf16, fp8 = result["bf16"], result["float8_moe"]
        ratios, per_repeat = "-", "-"
        if "ratio" in result:
            ratios = f"**{result['ratio']:.2f}x**, {result['ratio_best_step']:.2f}x"
            per_repeat = ", ".join(f"{r:.2f}x" for r in result["ratio_per_repeat"])
        rows.append(
            f"| {MODELS[model][0]} | {_seconds(bf16)} | {_seconds(fp8)} "
            f"| {_spread(bf16)} / {_spread(fp8)} | {ratios} | {per_repeat} |"
        )
    return rows


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        "# CPU step time: bf16 vs float8_moe (emulated fp8)",
        "",
        f"{report['date']}, {report['host']['cpus']} CPU cores ("
        f"{report['host']['cpu_capability']}; shared with other jobs), torch "
        f"{report['host']['torch']}, torchtitan {report['host']['torchtitan']}; load average "
        f"{report['host']['load_avg_start']} at the start, {report['host']['load_avg_end']} at "
        "the end.",
        "",
        "    " + report["command"],
        "",
        f"Runs done: {report['runs_done']}.",
        "",
        f"torchtitan's trainer through `scripts/run_train.sh` on `{s['config']}` (model and flavor "
        f"by overrides), NGPU={s['ngpu']} CPU processes over gloo, seq_len {s['seq_len']}, local "
        f"batch {s['local_batch_size']}, {s['steps']} steps; bf16 is the same config with "
        "`converters = []`. Time per step: the gap between consecutive step log lines, median "
        f"over steps {s['warmup'] + 1}-{s['steps']} of a run, then the median over "
        f"{s['repeat']} runs per variant (bf16 and float8_moe interleaved); best: the fastest "
        "timed step of any run, the one least slowed by other jobs on the machine; spread: the "
        "lowest and highest run median; per repeat: the ratio of the two runs made back to back.",
        "",
        *table(report["results"]),
        "",
    ]
    failures = [
        f"- {MODELS[m][0]} {v} run {r['repeat']}: `{r['error']}`"
        for m, result in report["results"].items()
        for v in VARIANTS
        for r in result[v]["runs"]
        if "error" in r
    ]
    if failures:
        lines += ["Failed runs:", "", *failures, ""]
    return "\n".join(lines)


def write_report(report: dict, runs: dict, args) -> None:
    """Summarize the runs so far into ``report`` and write its JSON and markdown."""
    done = sum(len(r) for by_variant in runs.values() for r in by_variant.values())
    report["runs_done"] = f"{done} of {len(runs) * len(VARIANTS) * args.repeat}"
    report["host"]["load_avg_end"] = round(os.getloadavg()[0], 2)
    report["results"] = {}
    for model, by_variant in runs.items():
        result = {v: summarize(by_variant[v]) for v in VARIANTS}
        compare(result)
        report["results"][model] = result
    out = REPO / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))


def main() -> None:
    args = parse_args()
    models = args.models.split(",")
    unknown = set(models) - set(MODELS)
    if unknown:
        raise SystemExit(f"unknown models {sorted(unknown)}; known: {list(MODELS)}")
    logs = REPO / args.logs
    logs.mkdir(parents=True, exist_ok=True)
    bf16 = bf16_config(logs)
    report = {
        "command": shlex.join(["python3", "scripts/bench_cpu_step.py", *sys.argv[1:]]),
        "date": datetime.now().strftime("%Y-%m-%d %H:%M"),
        "host": {
            "cpus": os.cpu_count(),
            "torch": version("torch"),
            "torchtitan": version("torchtitan"),
            "cpu_capability": cpu_capability(),
            "load_avg_start": round(os.getloadavg()[0], 2),
        },
        "settings": {
            "config": CONFIG,
            "ngpu": args.ngpu,
            "seq_len": args.seq_len,
            "local_batch_size": args.local_batch_size,
            "steps": args.steps,
            "warmup": args.warmup,
            "repeat": args.repeat,
        },
    }
    runs = {m: {v: [] for v in VARIANTS} for m in models}
    for repeat in range(args.repeat):
        # Alternate which variant goes first, so a drift in load favours neither.
        order = VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]
        for model in models:
            for variant in order:
                runs[model][variant].append(run_variant(model, variant, repeat, args, bf16))
                # Written after every run, so an interrupted benchmark keeps what it measured.
                write_report(report, runs, args)
    print("\n".join(table(report["results"])))


if __name__ == "__main__":
    main()
