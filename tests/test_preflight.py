"""`python -m torchtitan_fp8_moe.preflight`: a launch's config, parallel dims and float8_moe
checks and shard plan for N GPUs, on the meta device of a machine without them."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from expert_modules import build_expert_module
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims

from torchtitan_fp8_moe import run_context
from torchtitan_fp8_moe.converter import Float8MoEConverter
from torchtitan_fp8_moe.preflight import main, planning_for

REPO = Path(__file__).resolve().parent.parent
SEED_CONFIG = "train_configs/llama4_grouped_shared_debug.toml"
SCOUT_CONFIG = "train_configs/llama4_17bx16e.toml"
SCOUT_AT_64_RANKS = ["--config", SCOUT_CONFIG, "--ngpu", "64"]


def _preflight_process(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchtitan_fp8_moe.preflight", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _preflight(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _rows(pattern: str, out: str) -> list[str]:
    return re.findall(pattern, out, flags=re.MULTILINE)


def test_seed_config_at_8_ranks_prints_the_padding_plan(capsys):
    """The seed bug's layout: ranks 1-7 hold only padding of every [1, ...] shared-expert
    weight; the 8 routed experts split one per rank."""
    rc, out, err = _preflight(
        capsys, "--config", SEED_CONFIG, "--ngpu", "8", "--float8_moe.policy=always"
    )
    assert rc == 0, out + err
    assert "world size 8 = dp_replicate 1 x dp_shard 8 x cp 1 x tp 1 x pp 1" in out
    assert "FSDP degree 8 (dp_shard x cp), ep 1, etp 1" in out
    # columns: FQN, logical shape, FSDP degree, shard dim, rows/rank, padding-only ranks,
    # padding bytes (7 zero rows of 512 x 256 bf16), fp8 path
    shared = _rows(
        r"^layers\.\d+\.moe\.shared_expert\.w[13] +\[1, 512, 256\] +8 +0 +1 +7 "
        r"+1835008 +cuda ",
        out,
    )
    shared += _rows(
        r"^layers\.\d+\.moe\.shared_expert\.w2 +\[1, 256, 512\] +8 +0 +1 +7 "
        r"+1835008 +cuda ",
        out,
    )
    routed = _rows(
        r"^layers\.\d+\.moe\.experts\.w\d +\[8, (512, 256|256, 512)\] +8 +0 +1 +0 "
        r"+0 +cuda ",
        out,
    )
    assert (len(shared), len(routed)) == (9, 9), out
    assert "totals: 18 converted weights, 16515072 padding bytes (15.8 MiB)" in out
    assert out.rstrip().splitlines()[-1].startswith("preflight OK")


def test_scout_at_64_ranks_plans_in_seconds(capsys):
    """Full-size Llama4 Scout (108B parameters) on 64 ranks, planned on the meta device: 16
    experts leave 48 ranks with only padding; the 8192 x 5120 shared experts split evenly. The
    config's hf assets are not on this machine: said, and not needed."""
    started = time.perf_counter()
    rc, out, err = _preflight(
        capsys,
        *SCOUT_AT_64_RANKS,
        # the config's own degrees today; kept explicit so the case stays a passing one
        "--parallelism.tensor_parallel_degree=1",
        "--parallelism.expert_tensor_parallel_degree=1",
        "--parallelism.data_parallel_shard_degree=-1",
    )
    seconds = time.perf_counter() - started
    assert rc == 0, out + err
    assert "world size 64 = dp_replicate 1 x dp_shard 64 x cp 1 x tp 1 x pp 1" in out
    assert "model: llama4 17bx16e, 107.77B parameters" in out
    assert re.search(r"hf_assets_path \S+ does not exist here", out)
    routed = _rows(
        r"^layers\.\d+\.moe\.experts\.w\d +\[16, \d+, \d+\] +64 +0 +1 +48 "
        r"+4026531840 +cuda ",
        out,
    )
    shared = _rows(
        r"^layers\.\d+\.moe\.shared_experts\.w\d\.weight +\[\d+, \d+\] +64 +0 "
        r"+(?:128|80) +0 +0 +cuda ",
        out,
    )
    assert (len(routed), len(shared)) == (48 * 3, 48 * 3), out[-3000:]
    assert "totals: 288 converted weights" in out
    assert seconds < 15, seconds  # under 1 s on an idle laptop core


@pytest.mark.parametrize(
    "config, policy, converted, kept",
    [
        # Qwen3-30B-A3B's 768-wide experts at 16K tokens: fp8 would be slower, auto keeps them
        ("train_configs/qwen3_30b_a3b_4layers.toml", "auto", 0, 12),
        ("train_configs/qwen3_30b_a3b_4layers.toml", "always", 12, 0),
        # "measure" times them at launch; without a GPU here preflight shows the estimates
        ("train_configs/qwen3_30b_a3b_4layers.toml", "measure", 0, 12),
        # Scout's 8192-wide experts (routed and shared) at 32K tokens: fp8 pays
        ("train_configs/llama4_scout_2layers.toml", "auto", 12, 0),
    ],
)
def test_one_gpu_trainer_configs_get_the_policy_verdicts_benchmarked(
    capsys, caplog, config, policy, converted, kept
):
    """The end-to-end benchmark's configs (scripts/bench_train.py, docs/benchmarks): which
    weights the default policy converts on one H200. The plan is printed once: the converter's
    own log line (a warning where it converts nothing) is the launch's, not preflight's."""
    rc, out, err = _preflight(
        capsys, "--config", config, "--ngpu", "1", f"--float8_moe.policy={policy}"
    )
    assert rc == 0, out + err
    assert (out + err).count("FSDP shard plan") == 1, out + err
    assert not [r for r in caplog.records if "FSDP shard plan" in r.getMessage()]
    bf16_rows = _rows(
        rf"^layers\.\d+\.moe\.\S+ .* bf16 \({policy}: fp8 est\. [\d.]+ ms slower\)", out
    )
    assert len(bf16_rows) == kept, out
    totals = f"totals: {converted} converted weights"
    assert totals + (f" ({kept} kept in bf16 by the {policy} policy)" if kept else ",") in out, out
    # auto's verdicts come with the GPU their cost model was fit on.
    calibrated = "policy auto (its cost model is fit on an H200 with torch 2.11"
    assert (calibrated in out) == (policy == "auto"), out
    timed_at_launch = "policy measure (each weight timed on the GPU at launch; the verdicts below"
    assert (timed_at_launch in out) == (policy == "measure"), out


@pytest.mark.slow  # the command line in a process of its own: about 12 s of imports
def test_unmatched_fqns_exit_with_the_converters_message():
    proc = _preflight_process("--config", SEED_CONFIG, "--ngpu", "8", "--float8_moe.fqns=router")
    assert proc.returncode == 2
    message = (
        r"^preflight FAILED: float8_moe: fqns \['router'\] match none of the model's "
        r"expert modules \[.*'layers\.1\.moe\.shared_expert'"
    )
    assert re.search(message, proc.stderr, re.MULTILINE), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_scout_preset_parallelism_tp8_etp8_at_64_ranks(capsys):
    """torchtitan's Scout preset (TP 8, ETP 8, FSDP over the rest) on 64 ranks: each rank
    multiplies a 1/8 slice of every expert weight; FSDP 8 shards those."""
    rc, out, err = _preflight(
        capsys,
        *SCOUT_AT_64_RANKS,
        "--parallelism.tensor_parallel_degree=8",
        "--parallelism.expert_tensor_parallel_degree=8",
        "--float8_moe.policy=always",
    )
    assert rc == 0, out + err
    assert "world size 64 = dp_replicate 1 x dp_shard 8 x cp 1 x tp 8 x pp 1" in out
    routed_w1 = _rows(
        r"^layers\.\d+\.moe\.experts\.w1 +\[16, 1024, 5120\] +8 +0 +2 +0 +0 +cuda +tp 8 \(dim 1\) "
        r"+\[16, 1024, 5120\]$",
        out,
    )
    shared_w2 = _rows(
        r"^layers\.\d+\.moe\.shared_experts\.w2\.weight +\[5120, 1024\] +8 +0 +640 +0 +0 "
        r"+cuda +tp 8 \(dim 1\) +\[5120, 1024\]$",
        out,
    )
    assert (len(routed_w1), len(shared_w2)) == (48, 48), out[-3000:]


def test_world_size_that_does_not_factor_gets_torchtitans_message(capsys):
    rc, out, err = _preflight(
        capsys, "--config", SEED_CONFIG, "--ngpu", "6", "--parallelism.data_parallel_shard_degree=4"
    )
    assert rc == 2
    assert (
        "Invalid parallel dims: dp_replicate(1) * dp_shard(4) * cp(1) * tp(1) * pp(1) != "
        "WORLD_SIZE(6)" in err
    )
    assert "float8_moe:" not in out  # stopped before the model


def test_degrees_above_the_world_size_are_named(capsys):
    """ParallelDims' assert for dp_shard = -1 leaving nothing has no message of its own."""
    rc, _, err = _preflight(
        capsys, "--config", SEED_CONFIG, "--ngpu", "6", "--parallelism.tensor_parallel_degree=8"
    )
    assert rc == 2
    assert "for 6 ranks: invalid degrees (dp_shard -1, dp_replicate 1, cp 1, tp 8" in err


def test_unknown_override_fails_through_torchtitans_parser(capsys):
    rc, _, err = _preflight(capsys, "--config", SEED_CONFIG, "--ngpu", "8", "--parallelism.bogus=1")
    assert rc == 2
    assert "Unrecognized options" in err


def test_pipeline_parallelism_plans_the_whole_model_and_says_so(capsys):
    rc, out, _ = _preflight(
        capsys, "--config", SEED_CONFIG, "--ngpu", "8", "--parallelism.pipeline_parallel_degree=2"
    )
    assert rc == 0
    assert "dp_shard 4 x cp 1 x tp 1 x pp 2" in out
    assert "the trainer converts the whole model, as here, then splits it into 2 stages" in out
    shared = _rows(r"^layers\.\d+\.moe\.shared_expert\.w\d +\[1, \d+, \d+\] +4 +0 +1 +3 ", out)
    assert len(shared) == 9, out


def test_target_cpu_plans_the_emulated_path(capsys):
    rc, out, _ = _preflight(capsys, "--config", SEED_CONFIG, "--ngpu", "8", "--target", "cpu")
    assert rc == 0
    assert "emulated path (no CUDA device)" in out
    assert len(_rows(r"^layers\.\S+ +\[.*\] +8 +0 .* emulated ", out)) == 18
    assert run_context.current() == run_context.RunContext()  # the trainer's behaviour is back


def _tiny_expert_converter(target: str) -> Float8MoEConverter:
    job_config = ConfigManager().parse_args(
        [
            "--job.custom_config_module=torchtitan_fp8_moe.config",
            "--model.converters=float8_moe",
            "--float8_moe.policy=always",
        ]
    )
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=8)
    with planning_for(target):
        return Float8MoEConverter(job_config, dims)


def test_cuda_target_runs_the_fp8_shape_check():
    """A [8, 6, 4] expert weight has no fp8 kernel layout: a CUDA launch refuses it, the
    emulated path takes it; neither needs a GPU to find out."""
    with pytest.raises(ValueError, match=r"experts\.w1 has shape \[8, 6, 4\].*multiples"):
        _tiny_expert_converter("cuda").convert(build_expert_module("tiny_routed", 8))
    converter = _tiny_expert_converter("cpu")
    converter.convert(build_expert_module("tiny_routed", 8))
    assert {row.path for row in converter.shard_plan} == {"emulated"}


DEBUG_CONFIG = "train_configs/llama4_debug.toml"
EP = "--parallelism.expert_parallel_degree"
TWO_EXPERTS = ["--model.name=llama4_grouped_shared", "--model.flavor=debugmodel_2experts"]
NO_FSDP = [
    "--parallelism.data_parallel_replicate_degree=2",
    "--parallelism.data_parallel_shard_degree=1",
]

# (ranks, overrides, the message): layouts torch or torchtitan rejects at start-up or at step 1
# (tests/test_preflight_layouts.py checks the verdicts against real launches).
REFUSED_LAYOUTS = {
    "EP above the ranks it borrows": (
        4,
        [f"{EP}=8"],
        r"expert_parallel_degree = 8 x expert_tensor_parallel_degree = 1 must divide the 4 "
        r"ranks .*\"The product of mesh_sizes=\(1, 1, 0, 8, 1\) is 0, but the original "
        r"dimension at dim=0 has size 4\"\. Set expert_parallel_degree x "
        r"expert_tensor_parallel_degree to a divisor of 4$",
    ),
    "EP not dividing 8 experts": (
        3,
        [f"{EP}=3"],
        r"layers\.1\.moe\.experts\.w1: parallelism\.expert_parallel_degree = 3 must divide its 8 "
        r"routed experts, which EP would split \[3, 3, 2\] over its ranks; .*\"Split sizes "
        r"doesn't match total dim 0 size\"\)\. Set expert_parallel_degree to one of \[1\]$",
    ),
    "EP above 2 experts": (
        4,
        [f"{EP}=4", *TWO_EXPERTS],
        r"must divide its 2 routed experts, which EP would split \[1, 1, 0, 0\] over its ranks;"
        r" the launch fails at start-up \(\"Shard\(1\) requires even sharding\"\).* one of "
        r"\[1, 2\]$",
    ),
    "uneven FSDP on dim 1": (
        6,  # efsdp 3 x EP 2 > 2 experts: torchtitan shards dim 1, 512 rows over 3 ranks
        [f"{EP}=2", *TWO_EXPERTS],
        r"experts\.w1: FSDP shards shape \[1, 512, 256\] on dim 1, which must split evenly over "
        r"3 ranks \(FSDP2 .*\"FSDP does not support uneven sharding on dim 1\"\)",
    ),
    "EP without FSDP": (
        2,
        [f"{EP}=2", "--parallelism.tensor_parallel_degree=2"],
        r"expert_parallel_degree = 2 needs FSDP .*\"Mesh '\['fsdp'\]' is not available",
    ),
    "DDP beside TP": (
        4,
        [*NO_FSDP, "--parallelism.tensor_parallel_degree=2"],
        r"data_parallel_replicate_degree = 2 without FSDP \(data_parallel_shard_degree 1\) is "
        r"DDP, which fails at step 1 with converted weights",
    ),
    "DDP of converted weights": (
        2,
        NO_FSDP,
        r"is DDP, which fails at step 1 with converted weights: it broadcasts them with "
        r"aten\.cat .* Shard with FSDP instead",
    ),
    "pipeline stages above microbatches": (
        2,
        ["--parallelism.pipeline_parallel_degree=2", "--training.local_batch_size=1"],
        r"pipeline schedule 1F1B, 2 stages over pipeline_parallel_degree 2, 1 microbatches "
        r"\(training\.local_batch_size 1 / pipeline_parallel_microbatch_size 1\): the "
        r"launch fails at start-up: Number of microbatches \(1\) must be greater than or "
        r"equal to the number of stages \(2\)\.",
    ),
    "pipeline stages above layers": (
        16,
        ["--parallelism.pipeline_parallel_degree=16"],
        r"pipeline split: Number of stages \(16\) cannot be greater than effective layers \(8\)",
    ),
    "context parallelism on CPU": (
        2,
        ["--parallelism.context_parallel_degree=2", "--target", "cpu"],
        r"context_parallel_degree = 2 fails on CPU at step 1, in bf16 too: .*_scaled_dot_"
        r"product_flash_attention_for_cpu.* Set it to 1 on CPU$",
    ),
    "sequence not split by TP x 2 CP": (
        4,
        ["--parallelism.tensor_parallel_degree=4", "--training.seq_len=100"],
        r"training\.seq_len 100 must be divisible by tensor_parallel_degree \(4\) x 2 x "
        r"context_parallel_degree \(1\) = 8",
    ),
    # Sizes below 1: the launch fails building its data loader or model, at step 1, or (with
    # float8_moe) in the converter, which takes its tokens per micro-batch from them.
    "no sequences per rank": (
        2,
        ["--training.local_batch_size=0"],
        r"^preflight FAILED: training\.local_batch_size = 0 must be at least 1 \(sequences per "
        r"rank and step\).*\"batch_size should be a positive integer value, but got "
        r"batch_size=0\"",
    ),
    "empty sequences": (
        2,
        ["--training.seq_len=0"],
        r"^preflight FAILED: training\.seq_len = 0 must be at least 1 \(tokens per sequence\)"
        r".*at step 1 \(\"cannot reshape tensor of 0 elements",
    ),
    "negative sequence length": (
        2,
        ["--training.seq_len=-64"],
        r"^preflight FAILED: training\.seq_len = -64 must be at least 1 .*building the model "
        r".*\"upper bound and lower bound inconsistent with step sign\"",
    ),
    "empty pipeline microbatches": (
        2,
        [
            "--parallelism.pipeline_parallel_degree=2",
            "--parallelism.pipeline_parallel_microbatch_size=0",
        ],
        r"^preflight FAILED: parallelism\.pipeline_parallel_microbatch_size = 0 must be at least "
        r"1 \(sequences per pipeline micro-batch\).*\"integer modulo by zero\"",
    ),
    "TP above the attention heads": (
        32,  # divides every expert dim (256, 512) but not the 16 heads
        ["--parallelism.tensor_parallel_degree=32"],
        r"tensor_parallel_degree = 32 must divide the model's 16 attention heads and 16 "
        r"key/value heads",
    ),
}


@pytest.mark.parametrize("layout", REFUSED_LAYOUTS)
def test_layout_the_launch_rejects_exits_2_with_its_reason(capsys, layout):
    ranks, overrides, message = REFUSED_LAYOUTS[layout]
    rc, out, err = _preflight(capsys, "--config", DEBUG_CONFIG, "--ngpu", str(ranks), *overrides)
    assert rc == 2, out + err
    (failure,) = [line for line in err.splitlines() if line.startswith("preflight FAILED: ")]
    assert re.search(message, failure), failure
    assert "Traceback" not in out + err


def test_microbatch_size_without_a_pipeline_is_not_read(capsys):
    """Without pipeline parallelism the launch never reads it: preflight passes it too."""
    overrides = ["--parallelism.pipeline_parallel_microbatch_size=0"]
    rc, out, err = _preflight(capsys, "--config", DEBUG_CONFIG, "--ngpu", "2", *overrides)
    assert rc == 0, out + err


def test_expert_parallelism_that_fits_plans_one_expert_per_rank(capsys):
    rc, out, err = _preflight(capsys, "--config", DEBUG_CONFIG, "--ngpu", "8", f"{EP}=8")
    assert rc == 0, out + err
    routed = _rows(r"^layers\.\d+\.moe\.experts\.w\d +\[1, \d+, \d+\] +1 +0 .* ep 8 \(dim 0\)", out)
    assert len(routed) == 9, out
