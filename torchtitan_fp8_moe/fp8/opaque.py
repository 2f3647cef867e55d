"""Our kernels as torch ops under torch.compile, plain calls in eager mode.

Eager calls on plain tensors run the implementation itself: a custom op's dispatch costs host
time on every call, and a routed projection's forward and backward make five calls, which under
tensor parallelism (narrow shards) is more host time than its kernels take (host time per call:
docs/benchmarks/README.md). Meta tensors (pipeline shape inference), fake tensors and other
subclasses go through the op, which has their rules.
"""

import functools
from collections.abc import Callable

import torch
from torch.library import wrap_triton


def compile_opaque(
    name: str, fn: Callable, fake: Callable, eager: Callable | None = None
) -> Callable:
    """``fn`` registered as the custom op ``torchtitan_fp8_moe::<name>`` with ``fake`` as its
    shape rule, so that torch.compile calls it as one opaque node instead of tracing into it (a
    grouped mm whose shape rule takes bf16 only), a pure one that AOTAutograd's CSE merges with
    an equal call (a cast of the same tokens). Eager calls run ``eager`` (default ``fn``)."""
    op = torch.library.custom_op(f"torchtitan_fp8_moe::{name}", fn, mutates_args=())
    op.register_fake(fake)
    return _eager_or_op(eager or fn, op)


def compile_triton(name: str, fn: Callable) -> Callable:
    """``fn``, which launches its Triton kernels through ``launcher`` below, as the
    triton op ``torchtitan_fp8_moe::<name>``: torch.compile traces into it and inductor launches
    the kernels from its generated code. As an opaque custom op, each call paid the op's
    dispatch and Triton's Python launcher in compiled code too, which at narrow (TP 8) shapes
    left a compiled layer call with far more host time than as a triton op
    (docs/benchmarks/README.md). The op's shape rule is ``fn`` run on fake tensors."""
    op = torch.library.triton_op(
        f"torchtitan_fp8_moe::{name}", _with_traced_inputs_realized(fn), mutates_args=()
    )
    return _eager_or_op(fn, op)


def _with_traced_inputs_realized(fn: Callable) -> Callable:
    """``fn`` that, while traced, reads each tensor argument through an ``as_strided`` view of
    itself. Inductor gives a user Triton kernel its inputs with the strides they had when traced
    (exact strides): an input that inductor has not stored yet (a fused pointwise result, such as
    the SiLU backward's two gradients) is copied for each kernel that reads it, one store per
    kernel, each the size of the tensor. An ``as_strided`` user makes inductor store the input
    once with those strides instead, and every kernel reads that (torch 2.11 and 2.13,
    ``GraphLowering.run_node``)."""

    @functools.wraps(fn)
    def call(*args):
        return fn(*(_as_strided_self(a) for a in args))

    return call


def _as_strided_self(value):
    if not isinstance(value, torch.Tensor) or _plain(value):
        return value
    return value.as_strided(value.shape, value.stride(), value.storage_offset())


def launcher(kernel, tensor: torch.Tensor):
    """How a ``compile_triton`` function launches ``kernel`` on ``tensor``: directly for a plain
    tensor (eager), through ``wrap_triton`` while the op is traced (fake or proxy tensors).
    ``wrap_triton`` in eager dispatches a higher-order op per launch, which multiplied an eager
    layer call's host time at narrow (TP 8) shapes against launching directly."""
    return kernel if _plain(tensor) else wrap_triton(kernel)


def _eager_or_op(fn: Callable, op: Callable) -> Callable:
    @functools.wraps(fn)
    def call(*args):
        return op(*args) if traced(*args) else fn(*args)

    return call


def traced(*args) -> bool:
    """Whether a call on ``args`` is being traced into a graph: dynamo says so, or the tensors
    are not plain (fake, functional or meta tensors). ``is_compiling()`` alone missed the
    compiled backward of a FeedForward on an H100 under torch 2.11 (``test_cuda.py``)."""
    return torch.compiler.is_compiling() or not all(_plain(a) for a in args)


def _plain(value) -> bool:
    return not isinstance(value, torch.Tensor) or (
        type(value) is torch.Tensor and value.device.type != "meta"
    )
