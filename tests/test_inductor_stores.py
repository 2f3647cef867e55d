"""What inductor stores for our Triton kernels' inputs, from its generated code on a CPU.

Triton's front end gets a CUDA target (it traces our kernels without a GPU), the backward is
lowered when the forward compiles, and no kernel runs: the check reads the code inductor writes
for torchtitan's compiled routed experts. It runs in a fresh process (it changes Triton's active
driver and inductor's kernel loading for the whole process)."""

import re

import pytest
from harness.interpreted import run_in_fresh_process

pytestmark = pytest.mark.slow


def _silu_backward_outputs(codes: list[str]) -> int:
    """How many bf16 tensors the fused SiLU-backward kernel writes: its non-const bf16 pointer
    arguments. (Inductor may fuse other work of the same element count into the kernel, such
    as the fp32 copy of a weight gradient [4, 64, 128] beside the gradients [256, 128]: those
    outputs are fp32.)"""
    kernels = re.findall(
        r"\w*silu_backward\w* = async_compile\.cpp_pybinding\((\[.*?\])", "".join(codes)
    )
    assert len(kernels) == 1, kernels
    return sum(arg == "'at::BFloat16*'" for arg in kernels[0].strip("[]").split(", "))


def _compiled_code_of_experts():
    """A function ``(dynamic, feed_forward) -> inductor's code`` for torchtitan's compiled
    routed experts (or with ``feed_forward`` a FeedForward shared expert), forward and backward,
    with Triton's front end given a CUDA target and no kernel run."""
    import torch
    import torch._functorch.config as functorch_config
    import torch._inductor.async_compile as async_compile
    import torch._inductor.config as inductor_config
    import torch._inductor.graph as inductor_graph
    import triton
    from torchtitan.models.moe.moe import FeedForward, GroupedExperts, _run_experts_grouped_mm
    from triton.backends.compiler import GPUTarget

    import torchtitan_fp8_moe.weight.base as weight_base
    from torchtitan_fp8_moe.swap import swap_expert_weights
    from torchtitan_fp8_moe.weight import WeightConfig

    class CudaTarget:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):  # a launch from a custom op's eager code
            raise RuntimeError("not run")

    class NotRun:
        def __getattr__(self, name):
            raise RuntimeError("not run")

    codes = []
    codegen = inductor_graph.GraphLowering.codegen

    def keep_code(self):
        out = codegen(self)
        codes.append(out[0].value)
        return out

    triton.runtime.driver.set_active(CudaTarget())
    functorch_config.force_non_lazy_backward_lowering = True
    inductor_config.force_disable_caches = True
    inductor_graph.GraphLowering.codegen = keep_code
    async_compile.AsyncCompile.triton = lambda self, *args, **kwargs: NotRun()
    weight_base.fp8_kernels_available = lambda device: True  # the CUDA path's ops, on CPU

    def compiled_code(dynamic: bool = False, feed_forward: bool = False) -> list[str]:
        codes.clear()
        torch._dynamo.reset()
        torch.manual_seed(0)
        experts, dim, hidden, tokens = 4, 64, 128, 256
        x = torch.randn(tokens, dim, dtype=torch.bfloat16, requires_grad=True)
        if feed_forward:
            ffn = FeedForward(dim, hidden).bfloat16()
            swap_expert_weights(ffn, WeightConfig(emulate=False))
            call, args = torch.compile(ffn, fullgraph=True, dynamic=dynamic), (x,)
        else:
            routed = GroupedExperts(dim, hidden, experts, use_grouped_mm=True)
            for param in routed.parameters():
                torch.nn.init.normal_(param, std=0.02)
            swap_expert_weights(routed, WeightConfig(emulate=False))  # marks w1, w3 as sharing
            counts = torch.tensor([64, 0, 128, 64])
            call = torch.compile(_run_experts_grouped_mm, fullgraph=True, dynamic=dynamic)
            args = (routed.w1, routed.w2, routed.w3, x, counts)
        with pytest.raises(RuntimeError, match="not run"):  # not an error of inductor's
            call(*args)
        return list(codes)

    return compiled_code


def _check_silu_gradients_stored_once() -> None:
    from torchtitan_fp8_moe.fp8 import opaque

    compiled_code = _compiled_code_of_experts()
    stored_once = _silu_backward_outputs(compiled_code())
    as_strided_self = opaque._as_strided_self
    opaque._as_strided_self = lambda value: value  # without the as_strided reads
    stored_per_reader = _silu_backward_outputs(compiled_code())
    opaque._as_strided_self = as_strided_self
    # Two gradients, each stored once; without the fix, once per kernel of ours that reads it.
    assert stored_once == 2, stored_once
    assert stored_per_reader > stored_once, stored_per_reader


def _check_shared_token_casts_merged() -> None:
    import torch._functorch.config as functorch_config
    from expert_modules import shared_token_cast_calls

    compiled_code = _compiled_code_of_experts()

    def calls(feed_forward: bool, cse: bool) -> tuple[int, int]:
        with functorch_config.patch(cse=cse):
            return shared_token_cast_calls("\n".join(compiled_code(feed_forward=feed_forward)))

    for feed_forward in (False, True):
        # x for w1 and w3: one call forward (the row cast) and one for the weight gradients
        # (the per-group cast). w2's casts of SiLU(x w1) * (x w3) stay triton ops.
        merged = calls(feed_forward, cse=True)
        assert merged == (1, 1), (feed_forward, merged)
        # w1's and w3's casts of x apart: the check can fail.
        separate = calls(feed_forward, cse=False)
        assert separate == (2, 2), (feed_forward, separate)


def _check_dynamic_shapes_lower() -> None:
    import torch._higher_order_ops.triton_kernel_wrap as triton_kernel_wrap

    compiled_code = _compiled_code_of_experts()
    # Each launch's written tensors by torch's analysis of the kernel, where inductor copies an
    # input taken as written: torch 2.11 took the chunked cast kernel as writing the group
    # ends, and under dynamic shapes its inductor failed on that copy (an AssertionError in
    # ``decompose_triton_kernel_wrapper_functional``).
    written = []
    analysis = triton_kernel_wrap.get_mutated_tensors

    def recorded(*args):
        names = analysis(*args)
        kernel = triton_kernel_wrap.kernel_side_table.get_kernel(args[0])
        written.append((kernel.fn.__name__, names))
        return names

    triton_kernel_wrap.get_mutated_tensors = recorded
    codes = compiled_code(dynamic=True)
    assert len(codes) == 2, len(codes)  # forward and backward
    assert {kernel for kernel, _ in written} >= {"_per_group_amax_kernel", "_per_group_cast_kernel"}
    read_only = {"x_ptr", "a_ptr", "grad_ptr", "b_ptr", "offs_ptr"}
    assert not [(kernel, names) for kernel, names in written if read_only & set(names)], written


def test_silu_backward_stores_each_gradient_once():
    """Compiled, each SiLU-backward gradient is stored once for all our kernels that read it
    (``fp8/opaque.py``: our ops read their inputs through ``as_strided`` views while traced);
    without that, inductor stored one copy per reading kernel."""
    run_in_fresh_process("test_inductor_stores", "_check_silu_gradients_stored_once")


def test_routed_experts_compile_with_dynamic_shapes():
    """With symbolic shapes (``dynamic=True``; also dynamo's recompile when a traced function
    meets another expert count), inductor lowers the routed experts' forward and backward, and
    torch's analysis of our Triton kernels takes none of them as writing its inputs."""
    run_in_fresh_process("test_inductor_stores", "_check_dynamic_shapes_lower")


def test_compiled_experts_cast_the_shared_tokens_once():
    """Compiled routed experts and a compiled FeedForward: w1 and w3 share one fp8 cast of
    their tokens, forward and for the weight gradients (``RowwiseTritonQuantizers.tokens``: pure
    custom ops that AOTAutograd's CSE merges). Without the CSE, each casts them."""
    run_in_fresh_process("test_inductor_stores", "_check_shared_token_casts_merged")
