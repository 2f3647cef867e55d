"""Runs a test module's check function in a fresh process: in Triton's CPU interpreter, or with
process-wide settings a check must not leave behind.

The interpreter is chosen when a kernel is defined (at import), so an interpreted check runs in a
fresh process with ``TRITON_INTERPRET=1``; a check's failure fails the calling test with the
process's stderr. The process imports the package from this checkout (an editable install of
another worktree would otherwise win in a process started outside pytest's rootdir)."""

import os
import subprocess
import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = TESTS_DIR.parent


def run_interpreted(module: str, check: str, timeout_s: int = 600) -> None:
    """``module.check()`` (a module of tests/) in a fresh interpreted process."""
    run_in_fresh_process(module, check, timeout_s, TRITON_INTERPRET="1")


def run_in_fresh_process(module: str, check: str, timeout_s: int = 600, **env: str) -> None:
    """``module.check()`` (a module of tests/) in a fresh process with ``env`` set."""
    result = subprocess.run(
        [sys.executable, "-c", f"import {module} as t; t.{check}()"],
        cwd=TESTS_DIR,
        env=dict(os.environ, **env, PYTHONPATH=_python_path()),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert result.returncode == 0, result.stderr[-4000:]


def _python_path() -> str:
    inherited = os.environ.get("PYTHONPATH")
    return str(REPO_ROOT) if not inherited else f"{REPO_ROOT}{os.pathsep}{inherited}"
