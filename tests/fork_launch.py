"""Starts the ranks of a test launch as forks of one process that has done the imports already.

    python tests/fork_launch.py --nproc N [--preimport MODULE,...] SCRIPT [ARGS...]

Each rank is what ``torchrun --standalone --nproc_per_node=N SCRIPT ARGS`` would start: the same
environment variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT), its own
process and its own gloo process group, with SCRIPT's ``main()`` run there. The difference is the
start: importing torch and torchtitan costs about 12 CPU seconds a process (measured on the CI
machine), paid here once per launch instead of once per rank: on 2 cores an 8-rank launch starts
about 40 s sooner. Like torchrun, a rank that fails stops the others. The launches of users'
commands (`scripts/run_train.sh`) keep torchrun: tests/test_multinode_launch.py and the killed-run
test start it.

Only imports run before the fork: no thread pool, process group or tensor op exists yet, so each
child starts as a fresh process would after its imports.
"""

import argparse
import ctypes
import importlib
import importlib.util
import os
import signal
import socket
import sys
import traceback

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _load_script(path: str):
    spec = importlib.util.spec_from_file_location("fork_launch_main", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)  # its imports; ``__name__`` is not "__main__"
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(script, argv: list[str], rank: int, world: int, port: int) -> None:
    """In the child: torchrun's variables, then the script's main; never returns."""
    # Die with the launcher (a test's timeout kills it): no rank is left training.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--preimport", default="")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(options.script)))
    for name in filter(None, options.preimport.split(",")):
        importlib.import_module(name)
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


if __name__ == "__main__":
    sys.exit(main())
