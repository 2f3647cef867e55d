"""The auto policy where its cost model was not fit (torchtitan_fp8_moe/measure.py): each
weight timed in bf16 and fp8, the verdict's margin, convert's use of the timings, and the ranks'
agreement. The timings themselves are CUDA's in use; here they run the emulated fp8 path on a
CPU, and convert's GPU timer is replaced by fixed timings (tests/test_cuda.py times on a GPU)."""

import pytest
import torch
from expert_modules import scout_meta_model
from test_converter import _parallel_dims
from torch.utils._python_dispatch import TorchDispatchMode

import torchtitan_fp8_moe.conversion as conversion
from torchtitan_fp8_moe import Float8MoEWeight, convert
from torchtitan_fp8_moe.measure import MARGIN, Timing, WeightCase, time_cases
from torchtitan_fp8_moe.policy import times_weights
from torchtitan_fp8_moe.weight import WeightConfig


class _Fp8Outputs(TorchDispatchMode):
    """Counts the ops that return an fp8 tensor: the quantization of the fp8 path."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (tuple, list)) else [out]
        self.count += any(
            isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn for t in flat
        )
        return out


@pytest.mark.parametrize(
    "case",
    [
        WeightCase(64, (2, 32, 16), "bfloat16"),  # routed experts under FSDP's bf16
        WeightCase(64, (2, 32, 16), "bfloat16", 2),  # w1 and w3 on the same tokens
        WeightCase(40, (3, 32, 16), "float32"),  # rows that do not split evenly, fp32 params
        WeightCase(32, (24, 16), "float32", 1, True),  # a FeedForward's linear under autocast
        WeightCase(32, (24, 16), "float32"),  # the same in fp32 (FSDP, TP or PP: no autocast)
    ],
)
def test_each_case_is_timed_with_a_plain_and_a_converted_weight(case):
    """Also under no_grad (a caller's), and without drawing from the global generator: the
    model's initialization after the conversion must get the values it gets without it."""
    rng_state = torch.get_rng_state()
    with _Fp8Outputs() as fp8_ops, torch.no_grad():
        timings = time_cases({case}, WeightConfig("rowwise", True), None, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), rng_state)
    assert list(timings) == [case]
    timing = timings[case]
    assert 0 < timing.bf16_ms < 1e4 and 0 < timing.fp8_ms < 1e4
    assert fp8_ops.count > 0  # the converted weight's calls quantized


@pytest.mark.parametrize(
    "bf16_ms, fp8_ms, pays, text",
    [
        (10.0, 8.0, True, "measured 2.00 ms faster: bf16 10.00 ms, fp8 8.00"),
        (10.0, 10 * (1 - MARGIN) - 0.01, True, "measured 0.21 ms faster"),
        (10.0, 10 * (1 - MARGIN) + 0.01, False, "measured only 0.19 ms faster"),
        (10.0, 9.85, False, "measured only 0.15 ms faster, under 2%: bf16 10.00 ms, fp8 9.85"),
        (10.0, 10.0, False, "measured 0.00 ms slower"),
        (10.0, 12.5, False, "measured 2.50 ms slower: bf16 10.00 ms, fp8 12.50"),
    ],
)
def test_fp8_is_kept_only_where_it_saves_the_margin(bf16_ms, fp8_ms, pays, text):
    timing = Timing(bf16_ms, fp8_ms)
    assert timing.fp8_pays is pays
    assert text in timing.describe()


def _timed_by(timings_of, calls):
    """Stand-in for the GPU timer: records the cases asked for, answers ``timings_of(case)``."""

    def time_on_gpu(cases, config, alignment, device):
        calls.append((sorted(cases), config, alignment, device))
        return {case: timings_of(case) for case in cases}

    return time_on_gpu


def _cpu_device(policy, estimable=True):
    """The device convert times the weights on: the CPU, as a GPU would be."""
    return torch.device("cpu")


@pytest.mark.parametrize("policy", ["auto", "measure"])
def test_convert_decides_each_weight_from_its_timing(monkeypatch, policy):
    """Scout at 16K tokens, one rank: the cost model converts every weight; with timings that
    say fp8 loses on the shared expert's 2D weights, those stay bf16 (plain nn.Parameter), the
    routed ones convert, and each row gives its numbers. w1 and w3 are timed together."""
    calls = []

    def timing_of(case):
        grouped = len(case.shape) == 3
        return Timing(10.0, 8.0) if grouped else Timing(4.0, 4.5)

    timed = _timed_by(timing_of, calls)
    monkeypatch.setattr(conversion, "time_cases", timed)
    monkeypatch.setattr(conversion, "_measuring_device", _cpu_device)
    model = scout_meta_model()
    plan = convert(model, emulate=False, tokens=16384, policy=policy)
    [(cases, config, alignment, device)] = calls
    assert set(cases) == {  # one device: the linears run under the trainer's autocast
        WeightCase(16384, (5120, 8192), "float32", 1, True),
        WeightCase(16384, (8192, 5120), "float32", 2, True),
        WeightCase(16384, (16, 5120, 8192), "float32"),
        WeightCase(16384, (16, 8192, 5120), "float32", 2),
    }
    assert (config.recipe, config.emulate, alignment, device.type) == ("rowwise", False, 16, "cpu")
    for row in plan:
        param = model.get_parameter(row.fqn)
        if "shared" in row.fqn:
            assert not row.fp8 and not isinstance(param, Float8MoEWeight)
            slower = "fp8 measured 0.50 ms slower: bf16 4.00 ms, fp8 4.50"
            assert row.path.startswith(f"bf16 ({policy}: {slower}"), row
        else:
            assert row.fp8 and isinstance(param, Float8MoEWeight)
            faster = "measured 2.00 ms faster: bf16 10.00 ms, fp8 8.00"
            assert row.path.startswith(f"cuda ({policy}: {faster}"), row
        together = " for 2 weights on the same tokens)"
        assert row.path.endswith(together) == (".w2" not in row.fqn), row


def test_timed_cases_are_the_local_shapes_in_the_all_gathered_dtype(monkeypatch):
    """Under TP 2 x FSDP 4 with bf16 mixed precision each rank multiplies half of each weight
    in bf16; TP 3 splits the shared expert unevenly, which keeps it bf16 untimed."""
    calls = []
    monkeypatch.setattr(conversion, "time_cases", _timed_by(lambda case: Timing(1.0, 0.5), calls))
    monkeypatch.setattr(conversion, "_measuring_device", _cpu_device)
    convert(
        scout_meta_model(),
        emulate=False,
        tokens=8192,
        parallel_dims=_parallel_dims(8, tp=2),
        all_gather_dtype=torch.bfloat16,
    )
    assert set(calls[0][0]) == {
        WeightCase(8192, (4096, 5120), "bfloat16", 2),
        WeightCase(8192, (5120, 4096), "bfloat16"),
        WeightCase(8192, (16, 4096, 5120), "bfloat16", 2),
        WeightCase(8192, (16, 5120, 4096), "bfloat16"),
    }
    calls.clear()
    plan = convert(
        scout_meta_model(), emulate=False, tokens=8192, parallel_dims=_parallel_dims(6, tp=3)
    )
    assert all(len(case.shape) == 3 for case in calls[0][0])
    shared = [row for row in plan if "shared" in row.fqn]
    assert all(row.path.startswith("bf16 (auto: TP splits it unevenly") for row in shared)


def test_without_a_gpu_to_time_on_the_policies_estimate():
    """On this CPU machine nothing is timed: convert estimates by the cost model (preflight
    plans a CUDA run that way) under either policy, and says so in each row."""
    for policy in ("auto", "measure"):
        plan = convert(scout_meta_model(), emulate=False, tokens=16384, policy=policy)
        assert all(row.path.startswith(f"cuda ({policy}: est.") for row in plan)


def test_ranks_average_their_timings_and_fail_alike_on_differing_weights(dist_results):
    ranks = dist_results("measure", 2)
    timings = [rank["same_cases"]["timings"] for rank in ranks]
    assert timings[0] == timings[1] and len(timings[0]) == 2
    assert all(bf16 > 0 and fp8 > 0 for *_, bf16, fp8 in timings[0])
    for rank in ranks:
        paths = rank["planned_without_gpu"]["paths"]
        assert paths and all(path.startswith("cuda (measure: est.") for path in paths), paths
        error = rank["differing_cases"]["error"]
        assert error and "ranks [1] have other weight shapes than rank 0" in error, error
        assert 'policy = "always"' in error


def test_a_case_that_fails_to_time_is_left_to_the_cost_model(monkeypatch):
    """A weight that cannot be timed at start-up (the GPU's memory ran out on some rank, as
    torch's error or cuBLAS's) is untimed on every rank (NaN survives their average) and decided
    by the cost model, which the plan row says; the other cases are timed as before."""
    import torchtitan_fp8_moe.measure as measure

    large = WeightCase(64, (2, 32, 16), "bfloat16", 2)
    linear = WeightCase(32, (24, 16), "bfloat16")
    small = WeightCase(32, (24, 16), "float32")
    time_case = measure._time_case

    def failing(case, *args):
        if case == large:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        if case == linear:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED")
        return time_case(case, *args)

    monkeypatch.setattr(measure, "_time_case", failing)
    config = WeightConfig("rowwise", True)
    timings = time_cases({large, linear, small}, config, None, torch.device("cpu"))
    assert not timings[large].timed and not timings[large].fp8_pays
    assert not timings[linear].timed and timings[small].timed
    monkeypatch.setattr(conversion, "time_cases", _timed_by(lambda case: timings[large], []))
    monkeypatch.setattr(conversion, "_measuring_device", _cpu_device)
    plan = convert(scout_meta_model(), emulate=False, tokens=16384)
    failed = "cuda (auto: timing failed on a rank (see the log), est."
    assert all(row.path.startswith(failed) and not row.timed_on for row in plan)


def test_weights_fp8_kernels_cannot_multiply_stay_bf16_untimed(monkeypatch):
    """TP 1024 leaves each rank 8 of the routed experts' 8192 hidden rows: fp8's kernels need
    multiples of 16, so the policies keep those weights bf16 and say why, without timing them
    ("always" raises, naming the shape); the shared expert's shards still fit and are timed."""
    calls = []
    monkeypatch.setattr(conversion, "time_cases", _timed_by(lambda case: Timing(2.0, 1.0), calls))
    monkeypatch.setattr(conversion, "_measuring_device", _cpu_device)
    dims = _parallel_dims(1024, tp=1024)
    plan = convert(scout_meta_model(), emulate=False, tokens=16384, parallel_dims=dims)
    unfit = [row for row in plan if not row.fp8]
    assert unfit and all(
        row.path
        == f"bf16 (auto: fp8 kernels cannot multiply its local shape {list(row.local_shape)})"
        for row in unfit
    )
    assert all(row.local_shape[-1] % 16 or row.local_shape[-2] % 16 for row in unfit)
    timed_shapes = {case.shape for case in calls[0][0]}
    assert not timed_shapes & {row.local_shape for row in unfit}
    assert all(row.fp8 and row.timed_on == "cpu" for row in plan if row not in unfit)
    with pytest.raises(ValueError, match="multiples of 16"):
        convert(scout_meta_model(), emulate=False, parallel_dims=dims, policy="always")


def test_blockwise_under_auto_is_timed_not_converted_blind(monkeypatch):
    """The cost model is rowwise's: blockwise weights are timed where a GPU is there (an H200
    too), each verdict from its own timing; untimed they convert (test_policy.py)."""
    calls = []
    monkeypatch.setattr(conversion, "time_cases", _timed_by(lambda c: Timing(1.0, 2.0), calls))
    asked = []

    def device(policy, estimable=True):
        asked.append(estimable)
        return torch.device("cpu")

    monkeypatch.setattr(conversion, "_measuring_device", device)
    plan = convert(scout_meta_model(), emulate=False, tokens=16384, recipe="blockwise")
    assert asked == [False] and calls[0][1].recipe == "blockwise"
    assert plan and all(not row.fp8 for row in plan), plan
    assert all("fp8 measured 1.00 ms slower" in row.path for row in plan), plan


@pytest.mark.parametrize(
    ("policy", "gpu", "estimable", "timed"),
    [
        ("auto", "NVIDIA H200", True, False),
        ("auto", "NVIDIA H200", False, True),  # blockwise, or GEMMs on fbgemm's kernels
        ("auto", "NVIDIA H100 80GB HBM3", True, True),
        ("measure", "NVIDIA H200", True, True),
        ("always", "NVIDIA H100 80GB HBM3", False, False),
    ],
)
def test_the_cost_model_estimates_only_what_it_was_fit_on(policy, gpu, estimable, timed):
    assert times_weights(policy, gpu, estimable) == timed
