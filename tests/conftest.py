import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).parent
_launch_cache: dict[tuple[str, int], list[dict]] = {}


def launch_suite(
    suite: str, world_size: int, tmp_root: Path, timeout_s: int = 120, env: dict | None = None
) -> list[dict]:
    """Run ``tests/dist_worker.py SUITE`` under torchrun once per (suite, world size) and
    return every rank's results (cached for the session). ``env``: extra variables."""
    key = (suite, world_size)
    if key not in _launch_cache:
        out_dir = tmp_root / f"{suite}-w{world_size}"
        out_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, DIST_TIMEOUT_S=str(timeout_s), OMP_NUM_THREADS="1", **(env or {}))
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={world_size}",
            "--standalone",
            str(TESTS_DIR / "dist_worker.py"),
            suite,
            str(out_dir),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s * 3)
        results = []
        for rank in range(world_size):
            path = out_dir / f"rank{rank}.json"
            if not path.exists():
                pytest.fail(
                    f"rank {rank} of {suite} at world size {world_size} wrote no results:\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
                )
            results.append(json.loads(path.read_text()))
        _launch_cache[key] = results
    return _launch_cache[key]


@pytest.fixture(scope="session")
def dist_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    return lambda suite, world_size, **kw: launch_suite(suite, world_size, root, **kw)
