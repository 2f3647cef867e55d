"""scripts/run_train.sh's multi-node launch, emulated on one machine: two "nodes" of two CPU
processes each, two torchruns meeting at a c10d rendezvous on the loopback interface."""

import math
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from test_train import _process_tree, losses

REPO = Path(__file__).resolve().parent.parent
LAUNCHER = "./scripts/run_train.sh"
OVERRIDES = [
    "--training.steps=2",
    "--training.seq_len=64",
    "--training.local_batch_size=2",
    "--metrics.disable_color_printing",
]
# Variables of the launch that a caller's environment must not leak into these runs.
LAUNCH_VARS = (
    "NNODES",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RDZV_ID",
    "LOCAL_ADDR",
    "LOG_RANK",
    "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE",
)
TRAIN_TIMEOUT_S = 600


def _env(**launch: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return dict(env, CONFIG_FILE="train_configs/llama4_debug.toml", **launch)


def _free_port() -> int:
    """A port nothing listens on now (the OS's pick for port 0), for node 0's rendezvous store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILL each still-running launcher with its torchrun and workers. The tree is listed
    before anything dies: a killed parent's children are re-parented and could not be found."""
    trees = [_process_tree(p.pid) for p in procs if p.poll() is None]
    for pid in (pid for tree in trees for pid in tree):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait(timeout=30)


@pytest.mark.slow
def test_two_nodes_of_two_processes_train_as_one_world_of_4(tmp_path):
    """Both nodes exit 0; torchtitan builds a 4-way FSDP mesh and the converter plans its
    shards over 4 ranks; each node's local rank 0 logs the same finite losses (torchtitan logs
    the loss averaged over all 4 ranks) under its global rank: 0 on one node, 2 on the other."""
    port = _free_port()
    # Loopback only: the store and workers' addresses (LOCAL_ADDR) and gloo's interface.
    launch = {
        "NNODES": "2",
        "NGPU": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RDZV_ID": f"test-multinode-{port}",
        "LOCAL_ADDR": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    logs = [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    procs: list[subprocess.Popen] = []
    start = time.monotonic()
    try:
        for rank, log in enumerate(logs):
            with log.open("w") as out:
                # Output to files, not pipes: two unread pipes could fill and stall a node.
                procs.append(
                    subprocess.Popen(
                        [LAUNCHER, *OVERRIDES],
                        cwd=REPO,
                        env=_env(NODE_RANK=str(rank), **launch),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        text=True,
                    )
                )
        for p in procs:
            p.wait(timeout=max(1.0, start + TRAIN_TIMEOUT_S - time.monotonic()))
    finally:
        _kill(procs)
    texts = [log.read_text() for log in logs]
    for rank, (p, text) in enumerate(zip(procs, texts, strict=True)):
        assert p.returncode == 0, f"node {rank} exited {p.returncode}:\n{text[-8000:]}"

    prefixes = set()
    for rank, text in enumerate(texts):
        assert "dp_replicate=1, dp_shard=4" in text, f"node {rank}: no 4-way FSDP mesh"
        assert re.search(r"layers\.1\.moe\.shared_experts\.w1\.weight +\[512, 256\] +4 ", text)
        prefixes |= {int(r) for r in re.findall(r"\[rank(\d+)\]:.*step: +\d+ +loss", text)}
    assert prefixes == {0, 2}, "each node's local rank 0 logs under its global rank"
    curves = [losses(text) for text in texts]
    assert sorted(curves[0]) == [1, 2], texts[0][-4000:]
    assert all(math.isfinite(v) for v in curves[0].values()), curves
    assert curves[0] == curves[1], curves


@pytest.mark.parametrize(
    "missing, message",
    [
        ("MASTER_ADDR", "NNODES=2 is set but MASTER_ADDR is not"),
        ("NODE_RANK", "with NNODES=2, NODE_RANK must be set to 0..1"),
    ],
)
def test_nnodes_without_the_rendezvous_address_or_node_rank_fails_at_once(missing, message):
    """A node without MASTER_ADDR or NODE_RANK would wait for a rendezvous it cannot join (or
    host one nobody else joins): the script refuses before starting anything."""
    launch = {"NNODES": "2", "NGPU": "2", "MASTER_ADDR": "127.0.0.1", "NODE_RANK": "1"}
    del launch[missing]
    start = time.monotonic()
    proc = subprocess.run(
        [LAUNCHER, *OVERRIDES],
        cwd=REPO,
        env=_env(**launch),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr, proc.stderr
    assert time.monotonic() - start < 5, "checked before torch is imported"
    assert "torchrun" not in proc.stdout + proc.stderr


@pytest.fixture
def torchrun_argv(tmp_path):
    """Run the launcher with a stand-in `torchrun` first on PATH that prints its arguments (and
    the log prefix template it was given) instead of training: the command line it would run."""
    stub = tmp_path / "torchrun"
    stub.write_text(
        '#!/bin/sh\necho "prefix=${TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE:-}"\nprintf "%s\\n" "$@"\n'
    )
    stub.chmod(0o755)

    def argv(*args: str, **launch: str) -> list[str]:
        env = _env(**launch)
        env["PATH"] = f"{tmp_path}{os.pathsep}{env['PATH']}"
        proc = subprocess.run(
            [LAUNCHER, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.splitlines()

    return argv


# The end of the launcher's torchrun command line for ``torchrun_argv("--training.steps=2")``,
# single- and multi-node alike: torchrun's output options, then the training module.
TORCHRUN_OUTPUT_OPTIONS = ["--local-ranks-filter", "0", "--role", "rank", "--tee", "3"]
TRAIN_TWO_STEPS = [
    "-m",
    "torchtitan_fp8_moe.train",
    "--job.config_file",
    "train_configs/llama4_debug.toml",
    "--training.steps=2",
]


@pytest.mark.slow  # each command line test starts torchrun: about 3.5 s
def test_without_nnodes_the_command_line_is_the_single_node_one(torchrun_argv):
    assert torchrun_argv("--training.steps=2", NGPU="2") == [
        "prefix=",
        "--nproc_per_node=2",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint=localhost:0",
        *TORCHRUN_OUTPUT_OPTIONS,
        *TRAIN_TWO_STEPS,
    ]


@pytest.mark.slow
@pytest.mark.parametrize("node_rank, is_host", [("0", "1"), ("1", "0")])
def test_with_nnodes_the_command_line_joins_the_rendezvous(torchrun_argv, node_rank, is_host):
    """Node 0, and only node 0, hosts the rendezvous store; the id defaults to SLURM's job id."""
    argv = torchrun_argv(
        "--training.steps=2",
        NNODES="2",
        NODE_RANK=node_rank,
        NGPU="8",
        MASTER_ADDR="127.0.0.1",
        SLURM_JOB_ID="4242",
    )
    assert argv[0] == "prefix=[rank${rank}]:"
    assert argv[1:7] == [
        "--nnodes=2",
        "--nproc_per_node=8",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=127.0.0.1:29500",
        "--rdzv_id=4242",
        f"--rdzv_conf=is_host={is_host}",
    ]
    assert argv[7:] == [*TORCHRUN_OUTPUT_OPTIONS, *TRAIN_TWO_STEPS]
