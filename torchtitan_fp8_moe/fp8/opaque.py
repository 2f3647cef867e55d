"""Our kernels as custom ops under torch.compile, plain calls in eager mode."""

import functools
from collections.abc import Callable

import torch


def compile_opaque(name: str, fn: Callable, fake: Callable) -> Callable:
    """``fn`` registered as the custom op ``torchtitan_fp8_moe::<name>`` with ``fake`` as its
    shape rule, so that torch.compile calls it as one opaque node instead of tracing into a
    Triton launch (or a grouped mm whose shape rule takes bf16 only). Eager calls on plain
    tensors run ``fn`` itself: the custom op's dispatch costs about 0.2 ms of host time per call,
    and a routed projection's forward and backward make five calls, more host time than its
    kernels take on an H200 under tensor parallelism
    (docs/benchmarks/archive/2026-12-01-narrow-rows-tp-host-time/).
    Meta tensors (pipeline shape inference), fake tensors and other subclasses go through the op,
    which has their rules."""
    op = torch.library.custom_op(f"torchtitan_fp8_moe::{name}", fn, mutates_args=())
    op.register_fake(fake)

    @functools.wraps(fn)
    def call(*args):
        if torch.compiler.is_compiling() or not all(_plain(a) for a in args):
            return op(*args)
        return fn(*args)

    return call


def _plain(value) -> bool:
    return not isinstance(value, torch.Tensor) or (
        type(value) is torch.Tensor and value.device.type != "meta"
    )
