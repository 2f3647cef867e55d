"""End-to-end: torchtitan's trainer, bf16 vs float8_moe, with and without torch.compile.

    python scripts/bench_train.py [--ngpu 1] [--config train_configs/llama4_scout_2layers.toml]
        [--variants bf16,float8_moe,bf16+compile,float8_moe+compile] [--repeat 3]
        [--out outputs/benchmarks/h200_train.json] [-- extra torchtitan overrides]

Variant suffixes: ``+compile`` (torch.compile), ``+cache`` (``--float8_moe.cache_fp8_weights``),
``+fp8ag`` (``--float8_moe.fp8_all_gather``: FSDP gathers fp8 payloads), ``+blockwise``
(``--float8_moe.recipe=blockwise``), ``+always`` (``--float8_moe.policy=always``: every selected
weight in fp8, where the default ``auto`` may keep some bf16), ``+dense`` (torchtitan's fp8 rowwise
``quantize.linear.float8`` on the dense linears as well).

``--memory-cap-gib X`` caps each trainer process's CUDA caching allocator at X GiB
(``torch.cuda.set_per_process_memory_fraction``, through a ``sitecustomize.py``): the allocator
then frees its cached blocks and retries before it reserves more, so a run that passes shows the
memory it needs, not what it chose to keep cached; a run that needs more fails with CUDA out of
memory. A run whose log does not say the cap was set counts as failed.

Runs each variant through scripts/run_train.sh with the same seed and data, printing a line per
training step as the trainer logs it, and reads each run's numbers from torchtitan's metrics
output: the TensorBoard event file it writes with ``--metrics.enable_tensorboard`` (torchtitan
depends on tensorboard; its other output, wandb, is a service). It reports over the steps after
warm-up the median tokens/s per device, the peak reserved memory and the CUDA allocator's retries
(``retries``, the most of any run: at the memory limit they slow a run), the loss curve, and the
speedup over bf16 of the same compile setting.
With ``--repeat N`` every variant runs N times, interleaved (bf16, fp8, bf16, fp8, ...) so that
drift of the machine hits all variants alike; a variant's tokens/s is then the median of its
runs' medians, with the spread (min, max) and every run's value beside it, and its speedup by
round (run i against bf16's run i) with the median of those. Writes the rows as
JSON and the raw logs next to it.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: torchtitan depends on tomli instead
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
ANSI_COLOR = re.compile(r"\x1b\[[0-9;]*m")
# The console lines below only show progress (and are kept in each run's log); the numbers come
# from the metrics' event file (metric_records).
# A training step's line ("validate step:" lines are validation's).
STEP_LINE = re.compile(
    r"(?<!validate )step: +(\d+) +loss: +(\S+).*?memory: +([\d.]+)GiB.*?tps: +([\d,]+)"
)
RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:")


# torchtitan's metrics (components/metrics.py) under the names of its event file.
METRIC_TAGS = {
    "loss": "loss_metrics/global_avg_loss",
    "reserved_gib": "memory/max_reserved(GiB)",
    "tokens_per_s": "throughput(tps)",
    "alloc_retries": "memory/num_alloc_retries",
}


def metric_records(folder: Path) -> dict[int, tuple[float, float, float, int]]:
    """Each logged training step's (loss, peak reserved GiB, tokens/s per device, the CUDA
    allocator's retries up to it) from the TensorBoard event files under ``folder``, which the
    metrics rank (rank 0, or the last pipeline stage's first rank) writes. Steps missing any of
    the four are left out."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    values: dict[int, dict[str, float]] = {}
    wanted = {tag: name for name, tag in METRIC_TAGS.items()}
    for path in sorted(folder.rglob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag not in wanted:
                    continue
                number = (
                    value.simple_value
                    if value.WhichOneof("value") == "simple_value"
                    else value.tensor.float_val[0]
                )
                values.setdefault(event.step, {})[wanted[value.tag]] = number
    return {
        # at the console's precision, tokens/s to 0.1 (the console rounds it to an integer)
        step: (
            round(m["loss"], 5),
            round(m["reserved_gib"], 2),
            round(m["tokens_per_s"], 1),
            int(m["alloc_retries"]),
        )
        for step, m in sorted(values.items())
        if len(m) == len(METRIC_TAGS)
    }


class Progress:
    """A line per training step of one rank's console output, as the trainer logs it."""

    def __init__(self, label: str, steps: int):
        self.label, self.steps, self.rank = label, steps, None

    def line(self, text: str) -> str | None:
        found = STEP_LINE.search(text)
        if not found:
            return None
        rank = prefix[1] if (prefix := RANK_PREFIX.match(text)) else None
        if self.rank is None:
            self.rank = rank
        if rank != self.rank:
            return None
        step, loss, memory, tps = found.groups()
        return (
            f"{self.label}: step {int(step)}/{self.steps}  loss {loss}  "
            f"{tps} tokens/s  {float(memory):.2f} GiB reserved"
        )


def retries_after_warmup(steps: dict[int, tuple[float, float, int, int]], warmup: int) -> int:
    """The allocator's retries in the logged steps after ``warmup``: the count at the last step
    less the count at the last logged warm-up step (none logged: every retry, start-up's too)."""
    warm = [record[3] for step, record in steps.items() if step <= warmup]
    return steps[max(steps)][3] - max(warm, default=0)


def dense_fp8(variant: str) -> list[str]:
    """``+dense``: torchtitan's own fp8 rowwise converter on the dense linears (attention
    projections), beside ours on the experts unless the variant is bf16; the router, the output
    layer and the shared expert stay out of it."""
    converters = "quantize.linear.float8" + ("" if variant.startswith("bf16") else ",float8_moe")
    return [
        f"--model.converters={converters}",
        "--quantize.linear.float8.recipe_name=rowwise",
        "--quantize.linear.float8.filter_fqns=output,router.gate,shared_expert",
    ]


def _without_converters(config: str, folder: Path) -> Path:
    """The config with its model converters removed (torchtitan's CLI cannot empty a list)."""
    text = (REPO / config).read_text()
    if 'converters = ["float8_moe"]' not in text:
        raise SystemExit(f'{config}: expected a line converters = ["float8_moe"]')
    path = (folder / f"{Path(config).stem}_bf16.toml").resolve()
    path.write_text(text.replace('converters = ["float8_moe"]', "converters = []"))
    return path


CAP_VARIABLE = "BENCH_TRAIN_MEMORY_CAP_GIB"
CAP_APPLIED = "bench_train: CUDA allocator capped at"


def _memory_cap_site(folder: Path) -> Path:
    """A folder whose ``sitecustomize.py`` caps the CUDA allocator of each trainer process at
    ``$BENCH_TRAIN_MEMORY_CAP_GIB`` and says so in the log. Only torchrun's workers (they have
    LOCAL_RANK) take it, and they drop the variable, so that their own children (inductor's
    compile workers) start no CUDA context. It shadows any other sitecustomize on the path."""
    site = (folder / "memory_cap_site").resolve()
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import os\n"
        f"cap = os.environ.pop({CAP_VARIABLE!r}, None) if 'LOCAL_RANK' in os.environ else None\n"
        "if cap is not None:\n"
        "    import sys\n"
        "    import torch\n"
        "    device = int(os.environ['LOCAL_RANK'])\n"
        "    total = torch.cuda.get_device_properties(device).total_memory\n"
        "    torch.cuda.set_per_process_memory_fraction(float(cap) * 2**30 / total, device)\n"
        f"    print({CAP_APPLIED!r}, cap, 'GiB', file=sys.stderr, flush=True)\n"
    )
    return site


def loader_workers(config, extra: list[str]) -> int:
    """The data loader processes a run has: an override's, else the config's (torchtitan's
    default 0 builds each batch on the training process, between steps)."""
    flag = "--training.dataloader.num_workers="
    for argument in extra:
        if argument.startswith(flag):
            return int(argument[len(flag) :])
    with open(REPO / config, "rb") as f:
        return tomllib.load(f).get("training", {}).get("dataloader", {}).get("num_workers", 0)


def run_variant(variant: str, args, extra: list[str], run: int) -> dict:
    config = args.config
    if variant.startswith("bf16"):
        config = _without_converters(args.config, Path(args.out).parent)
    dump_folder = f"outputs/bench_train/{variant}"
    metrics_folder = REPO / dump_folder / f"tb_run{run}"
    shutil.rmtree(metrics_folder, ignore_errors=True)  # an earlier invocation's
    overrides = [
        f"--training.steps={args.steps}",
        f"--job.dump_folder={dump_folder}",
        "--metrics.enable_tensorboard",
        f"--metrics.save_tb_folder={metrics_folder.name}",
        *(["--compile.enable"] if "+compile" in variant else []),
        *(["--float8_moe.cache_fp8_weights"] if "+cache" in variant else []),
        *(["--float8_moe.fp8_all_gather"] if "+fp8ag" in variant else []),
        *(["--float8_moe.recipe=blockwise"] if "+blockwise" in variant else []),
        *(["--float8_moe.policy=always"] if "+always" in variant else []),
        *(dense_fp8(variant) if "+dense" in variant else []),
        *extra,
    ]
    env = dict(os.environ, NGPU=str(args.ngpu), CONFIG_FILE=str(config))
    if args.memory_cap_gib:
        env[CAP_VARIABLE] = str(args.memory_cap_gib)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(_memory_cap_site(Path(args.out).parent))]
            + [p for p in [os.environ.get("PYTHONPATH")] if p]
        )
    suffix = f"_run{run}" if args.repeat > 1 else ""
    log_path = Path(args.out).with_name(
        f"{Path(args.out).stem}_{variant.replace('+', '_')}{suffix}.log"
    )
    label = f"{variant} (run {run + 1} of {args.repeat})"
    print(f"{label}: starting", flush=True)
    progress = Progress(label, args.steps)
    started = time.perf_counter()
    lines = []
    with (
        subprocess.Popen(
            ["./scripts/run_train.sh", *overrides],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        ) as proc,
        log_path.open("w") as log_file,
    ):
        for raw in proc.stdout:
            line = ANSI_COLOR.sub("", raw)
            log_file.write(line)
            lines.append(line)
            if shown := progress.line(line):
                print(shown, flush=True)
    log = "".join(lines)
    wall_s = round(time.perf_counter() - started, 1)
    print(f"{label}: exit code {proc.returncode}, {wall_s:.0f} s", flush=True)
    steps = metric_records(metrics_folder)
    timed = [steps[s] for s in steps if s > args.warmup]
    row = {
        "variant": variant,
        "run": run,
        "ngpu": args.ngpu,
        "returncode": proc.returncode,
        "wall_s": wall_s,
        # run_train.sh sets expandable segments unless either variable is set here.
        "alloc_conf": {
            name: os.environ.get(name) for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
        },
        "memory_cap_gib": args.memory_cap_gib,
        "dataloader_workers": loader_workers(config, extra),
        "out_of_memory": "OutOfMemoryError" in log or "CUDA out of memory" in log,
        "steps_logged": len(steps),
        "log": log_path.name,
        "metrics": str(metrics_folder.relative_to(REPO)),
        "overrides": overrides,
    }
    if args.memory_cap_gib and CAP_APPLIED not in log:
        row["error"] = f"--memory-cap-gib {args.memory_cap_gib} was not applied (see the log)"
    elif timed:
        row.update(
            tokens_per_s_median=statistics.median(t[2] for t in timed),
            memory_max_reserved_gib=max(t[1] for t in timed),
            alloc_retries=steps[max(steps)][3],
            alloc_retries_timed=retries_after_warmup(steps, args.warmup),
            final_loss=steps[max(steps)][0],
            losses={s: steps[s][0] for s in sorted(steps)},
        )
    else:
        row["error"] = (
            f"no steps after warm-up in the metrics under {metrics_folder}:\n{log[-3000:]}"
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ngpu", type=int, default=1)
    parser.add_argument("--config", default="train_configs/llama4_scout_2layers.toml")
    parser.add_argument("--variants", default="bf16,float8_moe,bf16+compile,float8_moe+compile")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the medians")
    parser.add_argument("--repeat", type=int, default=1, help="runs per variant, interleaved")
    parser.add_argument("--out", default="outputs/benchmarks/h200_train.json")
    parser.add_argument("--memory-cap-gib", type=float, default=None)
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    variants = args.variants.split(",")
    runs: list[dict] = []
    for run in range(args.repeat):
        for variant in variants:
            runs.append(run_variant(variant, args, extra, run))
            Path(args.out).write_text(json.dumps(runs, indent=1) + "\n")
    rows = [_summary([r for r in runs if r["variant"] == v]) for v in variants]
    baselines = {
        ("+compile" if "+compile" in r["variant"] else ""): r.get("tokens_per_s_median")
        for r in rows
        if r["variant"].startswith("bf16")
    }
    print(
        f"{'variant':22} {'tokens/s':>10} {'min-max':>15} {'vs bf16':>8} {'mem GiB':>8} "
        f"{'retries':>7} {'final loss':>10}"
    )
    for r in rows:
        # fp8 against bf16 of the same compile setting (+cache is fp8-only).
        base = baselines.get("+compile" if "+compile" in r["variant"] else "")
        tps = r.get("tokens_per_s_median")
        if tps is not None and base:
            r["speedup_vs_bf16"] = round(tps / base, 3)
        spread = f"{r['tokens_per_s_min']}-{r['tokens_per_s_max']}" if tps else "-"
        print(
            f"{r['variant']:22} {tps or 'failed':>10} {spread:>15} "
            f"{r.get('speedup_vs_bf16', '-'):>8} {r.get('memory_max_reserved_gib', '-'):>8} "
            f"{max(r.get('alloc_retries_timed_runs', ['-'])):>7} {r.get('final_loss', '-'):>10}"
        )
    for r in rows:
        r.update(round_ratios(runs, r["variant"]))
        if "speedup_rounds" in r:
            rounds = " / ".join(f"{x:.3f}" for x in r["speedup_rounds"])
            print(f"{r['variant']:22} rounds {rounds}: median {r['speedup_median_of_rounds']:.3f}")
    Path(args.out).write_text(json.dumps({"variants": rows, "runs": runs}, indent=1) + "\n")


def round_ratios(runs: list[dict], variant: str) -> dict:
    """``variant``'s tokens/s over bf16's (same compile setting) round by round: run i of each,
    interleaved, so that both saw the machine alike; and the median of those ratios. Rounds
    where either run failed are left out; nothing for bf16 itself."""
    if variant.startswith("bf16"):
        return {}
    baseline = "bf16+compile" if "+compile" in variant else "bf16"
    tokens = {
        (r["variant"], r["run"]): r["tokens_per_s_median"]
        for r in runs
        if "tokens_per_s_median" in r
    }
    ratios = [
        round(tps / tokens[(baseline, run)], 3)
        for (name, run), tps in sorted(tokens.items(), key=lambda item: item[0][1])
        if name == variant and (baseline, run) in tokens
    ]
    if not ratios:
        return {}
    return {"speedup_rounds": ratios, "speedup_median_of_rounds": statistics.median(ratios)}


def _summary(runs: list[dict]) -> dict:
    """One variant over its runs: the median of the runs' tokens/s, their spread, the peak
    memory, and the first run's losses (the runs share seed and data)."""
    done = [r for r in runs if "tokens_per_s_median" in r]
    row = {"variant": runs[0]["variant"], "runs": len(runs), "runs_ok": len(done)}
    if done:
        per_run = [r["tokens_per_s_median"] for r in done]
        row.update(
            tokens_per_s_median=statistics.median(per_run),
            tokens_per_s_min=min(per_run),
            tokens_per_s_max=max(per_run),
            tokens_per_s_runs=per_run,
            memory_max_reserved_gib=max(r["memory_max_reserved_gib"] for r in done),
            alloc_retries_timed_runs=[r["alloc_retries_timed"] for r in done],
            final_loss=done[0]["final_loss"],
            losses=done[0]["losses"],
        )
    return row


if __name__ == "__main__":
    main()
