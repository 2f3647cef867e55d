"""torchtitan 0.3 config entries with `float8_moe`: each is torchtitan's own entry for the model
with ``Float8MoEConverter.Config`` added to the model's converters. Launch one with
``--module torchtitan_fp8_moe.torchtitan_v03.config_registry --config <entry>``.

The debug entries (DeepSeek-V3, Qwen3-MoE, GPT-OSS) read the tokenizer and corpus bundled with
this package (nothing is downloaded), run short sequences that train on CPU too, and have a bf16
twin without the converter (the same name without ``_float8_moe``) to compare against. The debug
shapes are far too small for fp8 to pay, so they convert with policy "always"; the full-size
entries keep the default "auto" policy (torchtitan_fp8_moe/policy.py).
"""

from collections.abc import Callable
from pathlib import Path

from torchtitan.models import deepseek_v3, gpt_oss, qwen3
from torchtitan.models.deepseek_v3 import config_registry as deepseek_v3_entries
from torchtitan.models.gpt_oss import config_registry as gpt_oss_entries
from torchtitan.models.qwen3 import config_registry as qwen3_entries
from torchtitan.trainer import Trainer

from .converter import Float8MoEConverter

_ASSETS = Path(__file__).resolve().parent.parent / "assets"
# The debug models' CPU-sized batch: 4 sequences of 256 tokens per rank.
_DEBUG_BATCH, _DEBUG_SEQ_LEN = 4, 256
# The backend float8_moe is tested with (run.py); 0.3's default, spmd_types, fails on CPU in bf16
# too.
_SPMD_BACKEND = "partial_dtensor"


def _float8_moe(config: Trainer.Config, policy: str) -> list:
    """The model converters of ``config``'s model: float8_moe."""
    compiled = config.compile.enable and "model" in config.compile.components
    return [Float8MoEConverter.Config(policy=policy, model_compile_enabled=compiled)]


def _with_float8_moe(
    config: Trainer.Config, policy: str, model_registry: Callable, flavor: str, **model_options
) -> Trainer.Config:
    """``config`` with float8_moe added to its model's converters, on the spmd backend float8_moe
    is tested with. ``model_registry(flavor, **model_options)`` must build the model ``config``
    already holds."""
    config.parallelism.spmd_backend = _SPMD_BACKEND
    config.model_spec = model_registry(
        flavor, converters=_float8_moe(config, policy), **model_options
    )
    return config


def _on_bundled_assets(config: Trainer.Config) -> Trainer.Config:
    """The debug entry on the bundled tokenizer and corpus, at the CPU-sized batch."""
    config.hf_assets_path = str(_ASSETS / "tokenizer")
    config.dataloader.dataset = "c4_test"
    config.dataloader.dataset_path = str(_ASSETS / "corpus")
    config.training.local_batch_size = _DEBUG_BATCH
    config.training.seq_len = _DEBUG_SEQ_LEN
    config.training.steps = 20
    config.validator.enable = False
    # torchtitan's CUDA graphs refuse its expert-parallel token dispatch (--parallelism.
    # expert_parallel_degree > 1).
    config.training.disable_cuda_graphs = True
    config.checkpoint.interval = 10
    config.parallelism.spmd_backend = _SPMD_BACKEND
    return config


# Debug models: bf16 twins, then float8_moe.
def deepseek_v3_debugmodel() -> Trainer.Config:
    return _on_bundled_assets(deepseek_v3_entries.deepseek_v3_debugmodel())


def deepseek_v3_debugmodel_float8_moe() -> Trainer.Config:
    return _with_float8_moe(
        deepseek_v3_debugmodel(), "always", deepseek_v3.model_registry, "debugmodel"
    )


def qwen3_moe_debug() -> Trainer.Config:
    return _on_bundled_assets(qwen3_entries.qwen3_moe_debug())


def qwen3_moe_debug_float8_moe() -> Trainer.Config:
    return _with_float8_moe(qwen3_moe_debug(), "always", qwen3.model_registry, "debugmodel_moe")


def gpt_oss_debugmodel() -> Trainer.Config:
    # torchtitan's flex-attention variant: its default (varlen) attention needs CUDA.
    return _on_bundled_assets(gpt_oss_entries.gpt_oss_debugmodel_flex())


def gpt_oss_debugmodel_float8_moe() -> Trainer.Config:
    return _with_float8_moe(
        gpt_oss_debugmodel(), "always", gpt_oss.model_registry, "debugmodel", attn_backend="flex"
    )


# Full-size models, on torchtitan's own settings and assets (download them as its README says).
def deepseek_v3_16b_float8_moe() -> Trainer.Config:
    return _with_float8_moe(
        deepseek_v3_entries.deepseek_v3_16b(),
        "auto",
        deepseek_v3.model_registry,
        "16B",
        attn_backend="flex",
    )


def deepseek_v3_671b_float8_moe() -> Trainer.Config:
    return _with_float8_moe(
        deepseek_v3_entries.deepseek_v3_671b(),
        "auto",
        deepseek_v3.model_registry,
        "671B",
        attn_backend="flex",
    )


def qwen3_30b_a3b_float8_moe() -> Trainer.Config:
    return _with_float8_moe(qwen3_entries.qwen3_30b_a3b(), "auto", qwen3.model_registry, "30B-A3B")
