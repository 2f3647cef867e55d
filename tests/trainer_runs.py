"""Trainer runs shared by the trainer tests, launched in batches (`tests/harness/trainer_batch.py`).

A test module declares the runs it reads with ``trainer_run(...)`` at import and marks each test
with the runs it needs (``needs(...)``); conftest's ``trainer_log`` fixture hands a run's log to
the test. Every run of the same world size whose tests are selected goes into one launch
(`tests/harness/fork_launch.py`): on 2 CPU cores each launch's start (imports, rendezvous) costs
seconds, often more than a run itself.

A run that reads another's output (a checkpoint) names it in ``after``: it is launched in the
same batch after it when both have the same world size, otherwise in a later launch; with
``fresh_process`` it is always in a later launch (what a new process must see, such as torch's
on-disk compile caches).
"""

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from harness.fork_launch import ForkServer

REPO = Path(__file__).resolve().parent.parent
TESTS_DIR = REPO / "tests"
# What every test run adds to its command line: small batches, plain log lines.
SMALL = [
    "--training.seq_len=64",
    "--training.local_batch_size=2",
    "--metrics.disable_color_printing",
]
# Most runs train 2 of the llama4 debug model's 6 layers, one dense and one MoE (the flavor
# tests/harness/trainer_batch.py registers): 4-5 s a 4-rank run instead of 11-16 s, 16-21 s
# instead of 51 s the seed's 8-rank run. Six layers: the README job, the bf16-vs-fp8 curves, the
# model families.
TWO_LAYERS = "--model.flavor=debugmodel_2layers"


@dataclass(frozen=True)
class TrainerRun:
    name: str
    ranks: int
    config: str
    # torchtitan overrides; "{out}" is this run's own folder, "{out[NAME]}" run NAME's.
    overrides: tuple[str, ...]
    log_rank: int = 0  # the rank whose log the test reads (the last stage's under PP)
    after: tuple[str, ...] = ()
    fresh_process: bool = False
    env: tuple[tuple[str, str], ...] = ()
    # A folder copied before the run, as (source, destination), placeholders as in overrides.
    copy: tuple[str, str] | None = None
    bf16: bool = False  # the config without the converter: the bf16 baseline


@dataclass
class TrainerLog:
    run: TrainerRun
    out: Path  # the run's own folder ({out}): its dump folder where the overrides say so
    text: str  # the log of run.log_rank

    def losses(self) -> dict[int, float]:
        return losses(self.text)


def losses(log: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"step: +(\d+) +loss: +(\S+)", log)}


def bf16_config_text(config: str) -> str:
    """``config`` (a float8_moe train config) without the converter."""
    text = (REPO / config).read_text()
    assert 'converters = ["float8_moe"]' in text, config
    return text.replace('converters = ["float8_moe"]', "converters = []")


REGISTRY: dict[str, TrainerRun] = {}


def trainer_run(
    name: str,
    ranks: int,
    config: str,
    *overrides: str,
    log_rank: int = 0,
    after: tuple[str, ...] = (),
    fresh_process: bool = False,
    env: dict[str, str] | None = None,
    copy: tuple[str, str] | None = None,
    bf16: bool = False,
) -> str:
    """Declare a run (at import); returns its name."""
    if name in REGISTRY:
        raise ValueError(f"trainer run {name!r} is declared twice")
    missing = [a for a in after if a not in REGISTRY]
    if missing:
        raise ValueError(f"trainer run {name!r}: declare {missing} before it")
    REGISTRY[name] = TrainerRun(
        name,
        ranks,
        config,
        tuple(overrides),
        log_rank,
        tuple(after),
        fresh_process,
        tuple(sorted((env or {}).items())),
        copy,
        bf16,
    )
    return name


def needs(*names: str):
    """Mark a test (or a pytest.param) with the trainer runs it reads."""
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise ValueError(f"undeclared trainer runs {unknown}")
    return pytest.mark.trainer_runs(*names)


def launch_stage(run: TrainerRun) -> int:
    """How many launches must come before the one holding ``run``."""
    stage = 0
    for name in run.after:
        before = REGISTRY[name]
        separate = run.fresh_process or before.ranks != run.ranks
        stage = max(stage, launch_stage(before) + int(separate))
    return stage


@dataclass
class BatchLauncher:
    root: Path
    server: ForkServer
    wanted: set[str] = field(default_factory=set)  # runs the selected tests need
    _logs: dict[str, TrainerLog] = field(default_factory=dict)
    _failures: dict[str, str] = field(default_factory=dict)

    def want(self, names) -> None:
        todo = list(names)
        while todo:
            name = todo.pop()
            if name not in self.wanted:
                self.wanted.add(name)
                todo += REGISTRY[name].after

    def out(self, name: str) -> Path:
        return self.root / name

    def get(self, name: str) -> TrainerLog:
        if name not in self._logs and name not in self._failures:
            self._launch(REGISTRY[name])
        if name in self._failures:
            pytest.fail(self._failures[name], pytrace=False)
        return self._logs[name]

    def _batch_of(self, run: TrainerRun) -> list[TrainerRun]:
        key = (run.ranks, launch_stage(run))
        return [
            r
            for r in REGISTRY.values()
            if (r.name in self.wanted or r.name == run.name)
            and (r.ranks, launch_stage(r)) == key
            and r.name not in self._logs
        ]

    def _config_file(self, run: TrainerRun) -> str:
        if not run.bf16:
            return run.config
        path = self.root / "bf16" / Path(run.config).name
        if not path.exists():
            path.parent.mkdir(exist_ok=True)
            path.write_text(bf16_config_text(run.config))
        return str(path)

    def _resolve(self, text: str, run: TrainerRun) -> str:
        return text.format(out=_Folders(self, run.name))

    def _launch(self, run: TrainerRun) -> None:
        batch = []
        for r in self._batch_of(run):
            for name in r.after:
                if name not in self._logs and name not in self._failures:
                    if all(b.name != name for b in batch):
                        self._launch(REGISTRY[name])  # a launch before this one
            failed = [name for name in r.after if name in self._failures]
            if failed:
                self._failures[r.name] = f"trainer run {r.name} needs {failed}, which failed"
            else:
                batch.append(r)
        if not batch:
            return
        specs = []
        for r in batch:
            overrides = list(r.overrides)
            if not any(o.startswith("--job.dump_folder") for o in overrides):
                overrides.append("--job.dump_folder={out}")
            log_dir = self.out(r.name)
            log_dir.mkdir(parents=True, exist_ok=True)
            specs.append(
                {
                    "name": r.name,
                    "args": [
                        f"--job.config_file={self._config_file(r)}",
                        *SMALL,
                        *(self._resolve(o, r) for o in overrides),
                    ],
                    "log_dir": str(log_dir),
                    "env": {k: self._resolve(v, r) for k, v in r.env},
                    "copy": [self._resolve(p, r) for p in r.copy] if r.copy else None,
                }
            )
        names = "-".join(sorted(r.name for r in batch))[:80]
        spec_path = self.root / f"batch-w{run.ranks}-{len(self._logs)}-{names}.json"
        spec_path.write_text(json.dumps({"runs": specs}, indent=1))
        args = [
            f"--nproc={run.ranks}",
            str(TESTS_DIR / "harness" / "trainer_batch.py"),
            str(spec_path),
        ]
        proc = self.server.run(args, {}, REPO, timeout=600 * len(batch))
        for r in batch:
            log_path = self.out(r.name) / f"rank{r.log_rank}.log"
            text = log_path.read_text() if log_path.exists() else ""
            if f"trainer_batch: run {r.name} finished" in text:
                self._logs[r.name] = TrainerLog(r, self.out(r.name), text)
            else:
                self._failures[r.name] = (
                    f"trainer run {r.name} ({r.ranks} ranks, launched with "
                    f"{[b.name for b in batch]}) did not finish; exit status "
                    f"{proc.returncode}.\nIts log (rank {r.log_rank}):\n{text[-6000:]}\n"
                    f"launch output:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
                )


class _Folders:
    """``{out}`` and ``{out[NAME]}`` in a run's overrides."""

    def __init__(self, launcher: BatchLauncher, name: str):
        self.launcher, self.name = launcher, name

    def __format__(self, spec: str) -> str:
        return str(self.launcher.out(self.name))

    def __getitem__(self, name: str) -> str:
        return str(self.launcher.out(name))
