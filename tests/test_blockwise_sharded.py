"""The blockwise recipe sharded: tensor parallelism at 128-aligned local shards against the
unsharded model (2 ranks, gloo, CPU), and the shard plan's 128 rule where a split does not fit.
FSDP's uneven shards and fp8 all-gathers of blockwise weights are cases of
tests/test_fsdp_uneven.py and tests/test_fp8_all_gather.py (names ending in -blockwise)."""

import logging

import pytest
from harness.parallel_checks import assert_matches_unsharded
from harness.suites.blockwise import BLOCKWISE_PARALLEL_CASES
from test_converter import CUSTOM_CONFIG, _convert, _parallel_dims
from test_preflight import _preflight

from torchtitan_fp8_moe.preflight import EXIT_FAILED, EXIT_OK

BLOCKWISE = [CUSTOM_CONFIG, "--model.converters=float8_moe", "--float8_moe.recipe=blockwise"]


@pytest.mark.slow  # one 2-rank launch of torchtitan's TP on the debug model
@pytest.mark.parametrize("case", [c[0] for c in BLOCKWISE_PARALLEL_CASES])
def test_tensor_parallel_blockwise_matches_unsharded(dist_results, case):
    for result in assert_matches_unsharded(dist_results("blockwise_parallel", 2), case):
        for fqn, planned in result["plan"].items():
            assert planned["local_shape"] == result["actual"][fqn]["local_shape"], fqn


def test_tensor_parallel_split_off_the_block_grid_is_refused():
    """TP 8 splits the debug model's 512-wide expert hidden dim into 64s, off the 128 grid:
    refused at conversion (what the launch and the preflight run), naming the weight, the
    recipe and the 128 rule."""
    with pytest.raises(ValueError) as error:
        _convert(BLOCKWISE, _parallel_dims(world_size=8, dp_shard=1, tp=8))
    message = str(error.value)
    for part in ("recipe blockwise", "multiple of 128", "float8_moe.recipe", ".moe."):
        assert part in message, message


def test_preflight_checks_the_128_rule(capsys):
    """The preflight, planning for CUDA without GPUs: TP 2 (256-wide local hidden dims) passes
    and names the recipe; TP 8 fails with the converter's message."""
    config = ["--config", "train_configs/llama4_debug.toml", "--float8_moe.recipe=blockwise"]
    rc, out, _ = _preflight(
        capsys, *config, "--ngpu", "4", "--parallelism.tensor_parallel_degree=2"
    )
    assert rc == EXIT_OK and "float8_moe: fp8 blockwise" in out, out
    rc, out, err = _preflight(
        capsys, *config, "--ngpu", "8", "--parallelism.tensor_parallel_degree=8"
    )
    assert (
        rc == EXIT_FAILED and "recipe blockwise needs that dim to be a multiple of 128" in out + err
    )


def test_plan_log_says_the_recipe(caplog):
    with caplog.at_level(logging.INFO):
        _convert(BLOCKWISE, _parallel_dims(world_size=2, dp_shard=2))
    (message,) = [r.getMessage() for r in caplog.records if "FSDP shard plan" in r.getMessage()]
    assert "fp8 blockwise" in message
