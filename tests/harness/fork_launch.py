"""Starts the ranks of a test launch as forks of a process that has done the imports already.

    python tests/harness/fork_launch.py --nproc N [--preimport MODULE,...] SCRIPT [ARGS...]

Each rank is what ``torchrun --standalone --nproc_per_node=N SCRIPT ARGS`` would start: the same
environment variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT), its own
process and its own gloo process group, with SCRIPT's ``main()`` run there. The difference is the
start: importing torch and torchtitan costs about 12 CPU seconds a process (measured on the CI
machine). Run as above, a launch pays it once instead of once per rank (an 8-rank launch of
tests/harness/dist_worker.py: 20 s instead of 55 s on 2 cores). The test session goes further:
``ForkServer`` keeps one process that has imported everything the test launches need, and each
launch is a fork of it, so the imports are paid once per session. Like torchrun, a rank that
fails stops the others. The launches of users' commands (`scripts/run_train.sh`) keep torchrun:
tests/test_multinode_launch.py and the killed-run test start it.

Only imports run before a fork: no thread pool, process group or tensor op exists yet, so each
rank starts as a fresh process would after its imports.
"""

import argparse
import ctypes
import importlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

PR_SET_PDEATHSIG = 1  # linux/prctl.h
# What every launch's processes need before their imports: one thread per rank (2 cores), no
# Hugging Face network access (read at import), and torch.cuda.is_available() by NVML: its
# default check initializes the CUDA driver, and a fork of a process whose driver is initialized
# cannot use CUDA ("CUDA error: initialization error" at the ranks' first pinned copy).
LAUNCH_ENV = {
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
}
SERVER_START_TIMEOUT_S = 300
_scripts: dict[str, object] = {}  # path -> the script's module, imports done


def _die_with_parent() -> None:
    """A killed parent (a test's timeout, the session's end) takes this process with it."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _load_script(path: str):
    path = os.path.abspath(path)
    if path not in _scripts:
        sys.path.insert(0, os.path.dirname(path))
        name = f"fork_launch_{Path(path).stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)  # its imports; ``__name__`` is not "__main__"
        _scripts[path] = module
    return _scripts[path]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(script, argv: list[str], rank: int, world: int, port: int) -> None:
    """In the child: torchrun's variables, then the script's main; never returns."""
    _die_with_parent()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    sys.argv = argv
    code = 0
    try:
        script.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported, then the launch stops
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--preimport", default="")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    return parser.parse_args(argv)


def _preimport(names: str) -> None:
    for name in filter(None, names.split(",")):
        importlib.import_module(name)


def launch(argv: list[str]) -> int:
    """Fork the ranks of ``argv`` (this file's command line), wait for them; the exit status."""
    options = _parse(argv)
    _preimport(options.preimport)
    script = _load_script(options.script)
    port = _free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    children = {}
    for rank in range(options.nproc):
        pid = os.fork()
        if pid == 0:
            _run_rank(script, [options.script, *options.args], rank, options.nproc, port)
        children[pid] = rank
    status = 0
    while children:
        pid, wait_status = os.wait()
        rank = children.pop(pid)
        code = os.waitstatus_to_exitcode(wait_status)
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code
            print(
                f"fork_launch: rank {rank} exited with {code}; stopping the other ranks",
                file=sys.stderr,
            )
            for other in children:
                os.kill(other, signal.SIGKILL)
    return status


def serve(socket_path: str, preimport: str, scripts: list[str]) -> None:
    """The session's fork server: imports once, then forks one launch per request, in turn.
    Request: one JSON line {"argv", "env", "cwd", "stdout", "stderr"}; answer: the launch's
    pid, then its exit status, one line each."""
    _die_with_parent()
    _preimport(preimport)
    for path in scripts:
        _load_script(path)
    server = socket.socket(socket.AF_UNIX)
    server.bind(socket_path)
    server.listen(1)
    while True:
        conn, _ = server.accept()
        with conn:
            request = json.loads(conn.makefile().readline())
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                _die_with_parent()
                os.environ.clear()
                os.environ.update(request["env"])
                os.chdir(request["cwd"])
                for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
                    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
                code = 1
                try:
                    code = launch(request["argv"])
                except BaseException:  # noqa: BLE001 - reported in the launch's output
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            conn.sendall(f"{pid}\n".encode())
            _, wait_status = os.waitpid(pid, 0)
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(wait_status)}\n".encode())
            except OSError:
                pass  # the test gave up waiting (its timeout) and killed the launch


class ForkServer:
    """The pytest side: starts ``serve`` on first use; ``run`` is ``subprocess.run`` of this
    file's command line in the test process's environment with LAUNCH_ENV and ``env`` on top,
    the output captured."""

    def __init__(self, folder: Path, preimport: str, scripts: list[str]):
        self.folder, self.preimport, self.scripts = folder, preimport, scripts
        self.socket_path = str(folder / "fork_server.sock")
        self.process: subprocess.Popen | None = None
        self.launches = 0

    def _start(self) -> None:
        command = [sys.executable, __file__, "--serve", self.socket_path, self.preimport]
        self.process = subprocess.Popen(
            command + self.scripts, env=dict(os.environ, **LAUNCH_ENV), cwd=self.folder
        )

    def _connect(self) -> socket.socket:
        if self.process is None:
            self._start()
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"fork server exited with {self.process.returncode}")
            conn = socket.socket(socket.AF_UNIX)
            try:
                conn.connect(self.socket_path)
                return conn
            except (FileNotFoundError, ConnectionRefusedError):
                conn.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def run(self, argv: list[str], env: dict[str, str], cwd, timeout: float):
        env = dict(os.environ, **LAUNCH_ENV, **env)
        self.launches += 1
        out = {name: self.folder / f"launch{self.launches}.{name}" for name in ("stdout", "stderr")}
        request = {"argv": argv, "env": env, "cwd": str(cwd), **{k: str(v) for k, v in out.items()}}
        with self._connect() as conn:
            conn.sendall((json.dumps(request) + "\n").encode())
            conn.settimeout(timeout)
            answers = conn.makefile()
            pid = int(answers.readline())
            try:
                returncode = int(answers.readline())
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)  # its ranks die with it
                raise subprocess.TimeoutExpired(argv, timeout) from None
        text = {name: path.read_text() for name, path in out.items()}
        return subprocess.CompletedProcess(argv, returncode, text["stdout"], text["stderr"])

    def close(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()


if __name__ == "__main__":
    # The tests folder, whose modules launches preimport (--preimport, as the test session had
    # them on its path); run as a script, only this folder is on the path.
    sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
    if sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        sys.exit(launch(sys.argv[1:]))
