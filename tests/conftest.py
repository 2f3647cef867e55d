import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from harness.fork_launch import ForkServer

# What a job's custom_config_module does: registers float8_moe and the bundled models, which
# the tests build by name (importing the package alone registers nothing).
import torchtitan_fp8_moe.config  # noqa: F401

TESTS_DIR = Path(__file__).parent
DIST_WORKER = TESTS_DIR / "harness" / "dist_worker.py"
_launch_cache: dict[tuple[str, int], list[dict]] = {}
# Suites that share one launch at a world size (each process start costs seconds on 2 cores).
# The torchao seed suite goes last: it leaves the ranks out of step by design.
SHARED_LAUNCHES = {
    2: "fsdp+cache_writes+fp8_all_gather+measure",
    3: "fsdp+llama4+fp8_all_gather",
    4: "fsdp+parallel",
    8: "fsdp+torchao_seed",
}


def launch_suite(
    server: ForkServer,
    suite: str,
    world_size: int,
    tmp_root: Path,
    timeout_s: int = 600,
    env: dict | None = None,
) -> list[dict]:
    """Run ``tests/harness/dist_worker.py SUITE`` (``tests/harness/fork_launch.py``) once per
    (suite, world size), together with the suites it shares a launch with, and return every
    rank's results for SUITE (cached for the session). ``env``: extra variables."""
    shared = SHARED_LAUNCHES.get(world_size, "")
    launched = shared if suite in shared.split("+") else suite
    key = (launched, world_size)
    if key not in _launch_cache:
        out_dir = tmp_root / f"{launched}-w{world_size}"
        out_dir.mkdir(parents=True, exist_ok=True)
        env = dict(DIST_TIMEOUT_S=str(timeout_s), **(env or {}))
        args = [f"--nproc={world_size}", str(DIST_WORKER), launched, str(out_dir)]
        proc = server.run(args, env, TESTS_DIR.parent, timeout=timeout_s * 3)
        results = []
        for rank in range(world_size):
            path = out_dir / f"rank{rank}.json"
            if not path.exists():
                pytest.fail(
                    f"rank {rank} of {launched} at world size {world_size} wrote no results:\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
                )
            results.append(json.loads(path.read_text()))
        _launch_cache[key] = results
    return [
        ranks.get(suite, {"error": f"suite {suite} did not run"}) for ranks in _launch_cache[key]
    ]


@pytest.fixture(scope="session")
def fork_server(tmp_path_factory):
    """Every multi-process launch of the session is a fork of this server
    (tests/harness/fork_launch.py): torch and torchtitan are imported once."""
    scripts = [str(TESTS_DIR / "harness" / "trainer_batch.py"), str(DIST_WORKER)]
    server = ForkServer(tmp_path_factory.mktemp("fork_server"), "torchtitan.train", scripts)
    yield server
    server.close()


@pytest.fixture(scope="session")
def dist_results(tmp_path_factory, fork_server):
    root = tmp_path_factory.mktemp("dist")
    return lambda suite, world_size, **kw: launch_suite(fork_server, suite, world_size, root, **kw)


_trainer_runs_wanted: set[str] = set()


def pytest_configure(config):
    """torch.compile's on-disk caches start empty every session, as on a fresh CI machine: a
    kernel compiled by an earlier session can neither hide a compile failure nor its cost.
    (Trainer runs that compile set their own folder.)"""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchinductor-tests-")


def pytest_unconfigure(config):
    shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


def pytest_collection_finish(session):
    """The trainer runs the selected tests read (``trainer_runs.needs``): only these launch."""
    for item in session.items:
        for marker in item.iter_markers("trainer_runs"):
            _trainer_runs_wanted.update(marker.args)


@pytest.fixture(scope="session")
def trainer_log(tmp_path_factory, fork_server):
    """``trainer_log(NAME)``: the log of trainer run NAME (``trainer_runs.py``), launched on
    first use together with every other selected run of its world size."""
    from trainer_runs import BatchLauncher

    launcher = BatchLauncher(tmp_path_factory.mktemp("trainer"), fork_server)
    launcher.want(_trainer_runs_wanted)
    return launcher.get
