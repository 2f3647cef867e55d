"""torchtitan's trainer on CPU (2 ranks, gloo, emulated fp8) with `--float8_moe.recipe=blockwise`:
the Llama4 and DeepSeek-V3 debug models train with losses tracking bf16's."""

import pytest
from test_models import LOSS_GAP, MODEL_RUN_NAMES, MODEL_RUNS
from trainer_runs import TWO_LAYERS, losses, needs, trainer_run

pytestmark = pytest.mark.slow

BLOCKWISE = "--float8_moe.recipe=blockwise"
LLAMA4 = ("train_configs/llama4_debug.toml", "--training.steps=3", TWO_LAYERS)
DEEPSEEK_CONFIG, _, DEEPSEEK_OVERRIDES = MODEL_RUNS["deepseek_v3"]
RUNS = {
    # (blockwise run, bf16 run, expert weights converted)
    "llama4": (
        trainer_run("llama4_blockwise", 2, *LLAMA4, BLOCKWISE),
        trainer_run("llama4_2layers_bf16", 2, *LLAMA4, bf16=True),
        6,  # one MoE layer: 3 routed + 3 shared weights
    ),
    "deepseek_v3": (
        trainer_run("deepseek_v3_blockwise", 2, DEEPSEEK_CONFIG, *DEEPSEEK_OVERRIDES, BLOCKWISE),
        MODEL_RUN_NAMES["deepseek_v3"][1],  # the bf16 run of test_models.py
        MODEL_RUNS["deepseek_v3"][1],
    ),
}


@pytest.mark.parametrize("model", [pytest.param(m, marks=needs(*RUNS[m][:2])) for m in RUNS])
def test_debug_model_trains_blockwise_tracking_bf16(model, trainer_log):
    blockwise_name, bf16_name, converted = RUNS[model]
    log = trainer_log(blockwise_name).text
    assert f"converted {converted} expert weights" in log and "fp8 blockwise" in log
    fp8, bf16 = losses(log), trainer_log(bf16_name).losses()
    assert sorted(fp8) == sorted(bf16) and len(fp8) >= 2
    gaps = [abs(fp8[s] - bf16[s]) for s in sorted(fp8)]
    assert gaps[0] > 0, "the first step's loss equals bf16's: fp8 did not run"
    assert max(gaps) < LOSS_GAP, (fp8, bf16)
