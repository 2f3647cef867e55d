"""Config entries the trainer tests launch (``--module tests_v03.entries``): the package's debug
entries (torchtitan_v03/config_registry.py) cut to their first MoE layers, so a run on 2-4 CPU
ranks takes seconds per step."""

from torchtitan_fp8_moe.torchtitan_v03 import config_registry as entries

# Layers kept: DeepSeek-V3's first layer is dense, the others MoE.
_LAYERS = {"deepseek_v3": 3, "qwen3": 2, "gpt_oss": 2}


def _cut(config):
    model = config.model_spec.model
    model.layers = model.layers[: _LAYERS[config.model_spec.name]]
    config.training.local_batch_size = 2
    config.training.seq_len = 128
    config.checkpoint.last_save_model_only = False
    return config


def deepseek_v3() -> object:
    return _cut(entries.deepseek_v3_debugmodel())


def deepseek_v3_float8_moe() -> object:
    return _cut(entries.deepseek_v3_debugmodel_float8_moe())


def qwen3() -> object:
    return _cut(entries.qwen3_moe_debug())


def qwen3_float8_moe() -> object:
    return _cut(entries.qwen3_moe_debug_float8_moe())


def gpt_oss() -> object:
    return _cut(entries.gpt_oss_debugmodel())


def gpt_oss_float8_moe() -> object:
    return _cut(entries.gpt_oss_debugmodel_float8_moe())


def deepseek_v3_float8_moe_cached() -> object:
    """With the fp8 weight cache (``cache_fp8_weights``), cleared after every optimizer step."""
    config = deepseek_v3_float8_moe()
    config.model_spec.model.float8_moe.cache_fp8_weights = True
    return config
