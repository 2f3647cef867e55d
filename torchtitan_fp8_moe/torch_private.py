"""Every private API of torch (and of torchtitan) that the package uses, with the versions each
was checked on.

A name with a leading underscore carries no promise from one release to the next. The tables
below are where a torch or torchtitan upgrade starts: ``tests/test_torch_private.py`` fails on
a private name used anywhere in the package that they do not list (fail closed: an import, an
attribute of ``torch``, of ``torch.ops.aten`` or of a torch object), and on a listed name that
the installed release does not have (``unresolved()``). CI runs that test on torch 2.13 and
2.15; ``python torchtitan_fp8_moe/torch_private.py`` runs the same check anywhere with torch
alone (this module imports nothing else).

"checked" names the torch releases where the package's code that uses the name ran and its
tests passed: 2.13.0 (the full CPU suite, and ``unresolved()`` in CI), 2.15.0 (the fast CPU
subset, and ``unresolved()`` in CI) and 2.11.0+cu130, the GPU image of the H100 and H200 runs
(``tests/test_cuda.py`` and the GPU benchmarks of docs/benchmarks), for the names on the GPU
paths; an entry used only on CPU, or only before a torch release, says so in its own list.
"""

from typing import NamedTuple

TORCH_211_GPU = "2.11.0+cu130"
TORCH_213 = "2.13.0"
TORCH_215 = "2.15.0"
EVERY_TORCH = (TORCH_211_GPU, TORCH_213, TORCH_215)


class Private(NamedTuple):
    where: str  # the package's modules that use it
    why: str  # what for, and the public replacement where torch has one
    checked: tuple[str, ...] = EVERY_TORCH


# A dotted name covers everything below it (``torch.utils._pytree`` covers its functions). An
# attribute of an object (a DTensor's ``_local_tensor``) is written under the object's class.
PRIVATE_TORCH: dict[str, Private] = {
    # fp8 and grouped GEMMs: torch has no public name for them.
    "torch._grouped_mm": Private(
        "weight/matmuls.py, weight/ops.py, cpu.py",
        "the bf16 grouped GEMM torchtitan's experts call; a converted weight overrides it "
        "(__torch_function__), and the CPU mode runs it in fp32",
    ),
    "torch._scaled_mm": Private("fp8/kernels/gemm_backends.py", "the fp8 rowwise GEMM"),
    "torch._scaled_grouped_mm": Private("fp8/kernels/gemm_backends.py", "the fp8 grouped GEMM"),
    "torch._scaled_mm_v2": Private(
        "fp8/kernels/blockwise_cublas.py",
        "cuBLAS's blockwise-scaled fp8 GEMM (probed at start-up; absent or failing: Triton's)",
    ),
    "torch.ops.aten._scaled_mm_v2": Private(
        "fp8/kernels/blockwise_cublas.py", "its out= overload, writing each expert's rows"
    ),
    "torch.ops.aten._grouped_mm": Private("weight/ops.py", "a matmul the weight refuses"),
    "torch.ops.aten._scaled_mm": Private("weight/ops.py", "a matmul the weight refuses"),
    "torch.ops.aten._scaled_grouped_mm": Private("weight/ops.py", "a matmul the weight refuses"),
    "torch.ops.aten._convolution": Private("weight/ops.py", "a matmul the weight refuses"),
    "torch.ops.aten._unsafe_view": Private("weight/ops.py", "a view by storage, not by schema"),
    "torch.ops.aten._to_copy": Private(
        "weight/ops.py, weight/lazy_cast.py", "copies, and the lazy bf16 cast of fp32 weights"
    ),
    "torch.ops.aten._pin_memory": Private("weight/ops.py", "a copy (FSDP's CPU offload)"),
    "torch._ops.OpOverload._schema": Private(
        "weight/ops.py", "which arguments an op writes (alias annotations)"
    ),
    # Tensor subclasses.
    "torch.Tensor._make_wrapper_subclass": Private(
        "weight/tensor.py, weight/gathered.py", "the converted weights' wrapper tensors"
    ),
    "torch.Tensor._version": Private(
        "fp8/cast_reuse.py, fp8/host_offsets.py", "whether a kept cast's input was written since"
    ),
    "torch._C.DisableTorchFunctionSubclass": Private(
        "weight/base.py", "an op without an fp8 path runs on the plain data"
    ),
    "torch._C._get_dispatch_mode": Private(
        "weight/lazy_cast.py", "inside AOTAutograd's functional trace (the lazy cast)"
    ),
    "torch._C._TorchDispatchModeKey.FUNCTIONAL": Private("weight/lazy_cast.py", "the same"),
    "torch._subclasses.fake_tensor.FakeTensor": Private(
        "weight/lazy_cast.py", "dynamo's fake run (the lazy cast stays out of it)"
    ),
    "torch._prims_common.suggest_memory_format": Private(
        "weight/tensor.py", "the wrapper's memory format, as torch's own subclasses pick it"
    ),
    "torch.utils._pytree": Private(
        "weight/ops.py, weight/tensor_ops.py, weight/lazy_cast.py, weight/gathered.py",
        "tree_leaves, tree_map_only over an op's arguments",
    ),
    # Autograd.
    "torch._C._current_graph_task_id": Private(
        "fp8/cast_reuse.py", "inside a backward: a kept cast is dropped when it ends"
    ),
    "torch.autograd.Variable._execution_engine.queue_callback": Private(
        "fp8/cast_reuse.py", "the callback at the end of that backward"
    ),
    # Compilation settings.
    "torch._inductor.config.emulate_precision_casts": Private(
        "converter.py, torchtitan_v03/run.py",
        "inductor keeps the bf16 -> fp32 -> fp8 roundings (pytorch/pytorch#150859)",
    ),
    "torch._inductor.config.fx_graph_cache": Private(
        "run_checks.py", "off under tensor parallelism (pytorch/pytorch#176532)"
    ),
    "torch._functorch.config.enable_autograd_cache": Private("run_checks.py", "the same"),
    # FSDP2 and DTensor internals.
    "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam": Private(
        "fsdp_shard_buffer.py", "FSDP2's parameter; the class torch exports under no other name"
    ),
    "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam.reset_sharded_param": Private(
        "fsdp_shard_buffer.py",
        "patched: a converted weight's shard stays in FSDP's padded buffer",
    ),
    "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam._module_info": Private(
        "fsdp_shard_buffer.py", "the module and name of the parameter"
    ),
    "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam._sharded_param_data": Private(
        "fsdp_shard_buffer.py", "FSDP's padded shard buffer"
    ),
    "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam._sharding_spec": Private(
        "fsdp_shard_buffer.py", "refreshed as torch refreshes it for a plain tensor"
    ),
    "torch.distributed.tensor.DTensor._local_tensor": Private(
        "fsdp_shard_buffer.py, swap.py",
        "the local tensor itself (to_local() returns a view, not the parameter's tensor)",
    ),
    "torch.distributed.tensor.DTensor._spec": Private("fsdp_shard_buffer.py", "its sharding"),
    "torch.distributed.distributed_c10d._set_pg_timeout": Private(
        "cpu.py",
        "process-group timeouts without torchtitan's CUDA barrier, where torch has no "
        "torch.distributed.set_timeout (before 2.15; 2.15 deprecates this one); CPU mode only",
        (TORCH_213,),
    ),
}

# torchtitan's: 0.3's glue (torchtitan_v03/), checked on torchtitan 0.3.0 (tests_v03/), and
# 0.2.2's, checked on 0.2.2 (tests/).
PRIVATE_TORCHTITAN: dict[str, Private] = {
    "torchtitan.models.moe.moe._run_experts_grouped_mm": Private(
        "routed_dispatch.py",
        "the experts' SwiGLU of grouped GEMMs, called on the input routed_dispatch gathered "
        "(torchtitan's GroupedExperts.forward would pad it a second time)",
        ("0.2.2",),
    ),
    "torchtitan.components.quantization.float8._float8_experts_cache": Private(
        "torchtitan_v03/converter.py",
        "the experts torchtitan's own fp8 converter made (refused: quantized twice)",
        ("0.3.0",),
    ),
    "torchtitan.components.quantization.mx._mxfp8_experts_cache": Private(
        "torchtitan_v03/converter.py", "the same for MXFP8", ("0.3.0",)
    ),
    "torchtitan.models.common.attention.FlexAttention._compiled_flex_attn": Private(
        "torchtitan_v03/cpu.py", "the CPU mode's FlexAttention (fp32 math)", ("0.3.0",)
    ),
    "torchtitan.config.configurable.Configurable.Config._owner": Private(
        "torchtitan_v03/converter.py", "the model class of a model config", ("0.3.0",)
    ),
}


def covers(table: dict[str, Private], name: str) -> bool:
    """Whether ``name`` (a dotted name the package uses) is listed, or lies below a listed name."""
    return any(name == listed or name.startswith(listed + ".") for listed in table)


def resolve(name: str) -> bool:
    """Whether the installed release has ``name``: a module, an attribute of one, or an
    attribute of a class (its own, an annotation, or ``self.<name>`` in its module's source)."""
    import importlib
    import inspect
    import sys

    parts = name.split(".")
    obj, index = None, len(parts)
    while index > 0:  # the longest importable module prefix
        try:
            obj = importlib.import_module(".".join(parts[:index]))
            break
        except ImportError:
            index -= 1
    if obj is None:
        return False
    for position, part in enumerate(parts[index:], index):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        if position != len(parts) - 1 or not isinstance(obj, type):
            return False
        if any(part in getattr(cls, "__annotations__", {}) for cls in obj.__mro__):
            return True
        try:
            return f"self.{part}" in inspect.getsource(sys.modules[obj.__module__])
        except (OSError, TypeError, KeyError):
            return False
    return True


def unresolved(table: dict[str, Private] = PRIVATE_TORCH) -> list[str]:
    """The listed names the installed release does not have."""
    return [name for name in table if not resolve(name)]


if __name__ == "__main__":
    import torch

    missing = unresolved()
    print(f"torch {torch.__version__}: {len(PRIVATE_TORCH) - len(missing)} of {len(PRIVATE_TORCH)}")
    print("\n".join(f"missing: {name}" for name in missing) or "every listed name resolves")
    raise SystemExit(1 if missing else 0)
