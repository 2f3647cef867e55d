"""FSDP2 all-gathers of fp8 payloads (tests/test_fp8_all_gather.py)."""

import torch
import torch.distributed as dist
from expert_modules import build_expert_module, expert_inputs
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from harness.suites.common import local_values, run_cases, stale_entries, taken_state_dicts


def fp8_all_gather_cases(world_size: int) -> list[dict]:
    """Converted expert modules under FSDP2 with `fp8_all_gather`, each against the same with it
    off: evenly and unevenly split experts, ranks holding only padding, the fallbacks (2D
    weights, FSDP on dim 1) and tensor parallelism (world size 2 only)."""
    # (reshard_after_forward, cache_fp8, activation checkpointing around the experts)
    combos = [(True, False, False), (False, True, False), (True, True, True), (False, False, True)]
    if world_size == 2:
        shapes = [("routed", 4, combos), ("routed", 3, combos[2:3])]
        shapes += [("grouped_shared", 1, combos[:1] + combos[3:])]
        shapes += [("linear_shared", 64, combos[:1]), ("routed", 4, combos[1:2], "dim1")]
        shapes += [("routed", 4, combos[:1], "tp"), ("grouped_shared", 1, combos[1:2], "tp")]
        shapes += [("routed", 3, combos[1:2], "dim0", "blockwise")]
    else:
        shapes = [("routed", 8, combos), ("grouped_shared", 1, combos[:1] + combos[3:])]
        shapes += [("tiny_routed", 2, combos[2:3]), ("linear_shared", 64, combos[1:2])]
        shapes += [("routed", 5, combos[2:3], "dim0", "blockwise")]
    cases = []
    for kind, dim0, kind_combos, *layout in shapes:
        layout_name, recipe = (*layout, "rowwise")[:2] if layout else ("dim0", "rowwise")
        for reshard, cache_fp8, ac in kind_combos:
            cases.append(
                {
                    "name": f"{kind}-{dim0}-{layout_name}-reshard={reshard}"
                    + ("-cache" if cache_fp8 else "")
                    + ("-ac" if ac else "")
                    + ("" if recipe == "rowwise" else f"-{recipe}"),
                    "recipe": recipe,
                    "kind": kind,
                    "dim0": dim0,
                    "layout": layout_name,
                    "reshard_after_forward": reshard,
                    "cache_fp8": cache_fp8,
                    "ac": ac,
                    # dim-1 sharding and 2D weights gather bf16 (the fallback)
                    "fp8_gathered": layout_name != "dim1" and kind != "linear_shared",
                }
            )
    return cases


def _experts_of(module):
    return module.experts if hasattr(module, "experts") else module.expert


def _fp8_all_gather_module(case: dict, mesh, fp8_all_gather: bool):
    """The case's converted module, split like torchtitan's tensor parallelism with layout
    "tp" (a 2 FSDP x 1 TP mesh), FSDP-sharded."""
    from torch.distributed.tensor import Shard

    from torchtitan_fp8_moe.swap import expert_modules, swap_expert_weights
    from torchtitan_fp8_moe.weight import WeightConfig

    module = build_expert_module(case["kind"], case["dim0"])
    for _, expert in expert_modules(module):
        swap_expert_weights(
            expert,
            WeightConfig(
                case["recipe"],
                emulate=True,
                cache_fp8=case["cache_fp8"],
                fp8_all_gather=fp8_all_gather,
            ),
        )
    fsdp_mesh = mesh
    if case["layout"] == "tp":
        # TP degree 1: DTensor weights over a TP mesh dim (FSDP2 gathers nothing at degree 1)
        mesh_2d = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))
        fsdp_mesh = mesh_2d["dp"]
        if case["kind"] == "routed":
            module = _LocalWeightExperts(module.experts)
        _split_like_tensor_parallelism(_experts_of(module), mesh_2d["tp"])
    placement = (lambda p: Shard(1)) if case["layout"] == "dim1" else None
    fully_shard(
        module,
        mesh=fsdp_mesh,
        reshard_after_forward=case["reshard_after_forward"],
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        shard_placement_fn=placement,
    )
    return module


def _split_like_tensor_parallelism(experts, tp_mesh) -> None:
    """torchtitan's TP split of grouped experts (w1/w3 on dim 1, w2 on dim 2) into DTensors
    whose local shards are converted weights, as converting before parallelizing gives."""
    from torch.distributed.tensor import Shard

    for name, dim in (("w1", 1), ("w2", 2), ("w3", 1)):
        chunks = getattr(experts, name).detach().chunk(tp_mesh.size(), dim=dim)
        local = chunks[tp_mesh.get_local_rank()]
        distributed = DTensor.from_local(local.clone(), tp_mesh, [Shard(dim)], run_check=False)
        experts.register_parameter(name, torch.nn.Parameter(distributed))


class _LocalWeightExperts(torch.nn.Module):
    """torchtitan's grouped-mm expert function on the TP-local weights, as GroupedExperts runs
    it (without its token padding)."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, x, tokens_per_expert):
        from torchtitan.models.moe.moe import _run_experts_grouped_mm

        e = self.experts
        weights = [w.to_local() if isinstance(w, DTensor) else w for w in (e.w1, e.w2, e.w3)]
        return _run_experts_grouped_mm(*weights, x, tokens_per_expert)


def _unsharded_weights(experts) -> dict:
    return {n: _local_tensor(p) for n, p in experts.named_parameters()}


def _local_tensor(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _gather_report(module) -> dict:
    """What FSDP gathers and holds: the dtypes of each weight's all-gather inputs (FSDP's own
    call of the hook), and the types and large payloads of the unsharded weights."""
    import torch.utils._pytree as pytree

    experts = _experts_of(module)
    report = {"input_dtypes": {}, "unsharded": {}}
    fsdp_params = module._get_fsdp_state()._fsdp_param_group.fsdp_params
    for (name, _), fsdp_param in zip(module.named_parameters(), fsdp_params, strict=True):
        report["input_dtypes"][name] = [str(t.dtype) for t in fsdp_param.all_gather_inputs]
    module.unshard()
    for name, weight in _unsharded_weights(experts).items():
        large = [
            str(t.dtype)
            for t in pytree.tree_leaves(vars(weight))
            if isinstance(t, torch.Tensor) and t.numel() >= weight.numel()
        ]
        report["unsharded"][name] = {"type": type(weight).__name__, "large_payloads": large}
    return report


def _fail_closed_report(module) -> dict:
    """Non-matmul uses of an unsharded fp8-gathered weight: each must raise NotImplementedError
    naming the option."""
    module.unshard()
    w = _local_tensor(_experts_of(module).w1)
    x = torch.randn(4, w.shape[-1]).bfloat16()
    offs = torch.tensor([4] * w.shape[0], dtype=torch.int32)
    uses = {
        "sum(1)": lambda: w.sum(1),
        "w + 1 then matmul": lambda: torch._grouped_mm(x, (w + 1).transpose(-2, -1), offs=offs),
        "high_precision()": lambda: w.high_precision(),
        "einsum": lambda: torch.einsum("eoi,ti->eto", w, x),
        "grouped_mm of w, not w^T": lambda: torch._grouped_mm(x, w, offs=offs),
        "w[0]": lambda: w[0],
        "float()": lambda: w.float(),
        "mul_": lambda: _in_place(w),
    }
    report = {}
    for use, run in uses.items():
        try:
            run()
            report[use] = "ran"
        except NotImplementedError as e:
            report[use] = "raised" if "fp8_all_gather" in str(e) else f"message: {e}"
        except Exception as e:  # noqa: BLE001 - the test names it
            report[use] = f"{type(e).__name__}: {e}"
    module.reshard()
    return report


def _in_place(w) -> None:
    with torch.no_grad():
        w.mul_(2)


def _train_fp8_all_gather(case: dict, module, steps: int = 3, micro_batches: int = 2) -> dict:
    """Outputs, input grads, weight grad shards and weights of every step and micro-batch."""
    from torch.utils.checkpoint import checkpoint

    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    history = {"out": [], "input_grad": [], "weight_grad": [], "param": []}
    experts = _experts_of(module)
    for step in range(steps):
        for micro in range(micro_batches):
            x, routing, target = expert_inputs(case["kind"], case["dim0"], step * 2 + micro)
            x = x.bfloat16().requires_grad_()
            if case["ac"]:
                out = checkpoint(module, x, *routing, use_reentrant=False)
            else:
                out = module(x, *routing)
            (out.float() * target).sum().backward()
            history["out"].append(out.detach())
            history["input_grad"].append(x.grad)
        history["weight_grad"] += [local_values(p.grad).clone() for p in experts.parameters()]
        opt.step()
        opt.zero_grad()
        history["param"] += [local_values(p).clone() for p in experts.parameters()]
    return history


def _run_fp8_all_gather_case(case: dict, mesh) -> dict:
    off = _fp8_all_gather_module(case, mesh, False)
    on = _fp8_all_gather_module(case, mesh, True)
    state_dicts = taken_state_dicts(on)  # before the first forward, as torchtitan's checkpointer
    expected, actual = _train_fp8_all_gather(case, off), _train_fp8_all_gather(case, on)
    result = {
        "stale_state_dict_entries": stale_entries(on, state_dicts),
        "equal": {
            what: all(torch.equal(a, b) for a, b in zip(expected[what], actual[what], strict=True))
            for what in expected
        },
    }
    if case["cache_fp8"]:
        result["fp8_cache_quantizations"] = {
            n: _local_tensor(p)._cache.quantizations for n, p in _experts_of(on).named_parameters()
        }
    result["report"] = _gather_report(on)
    on.reshard()
    if case["fp8_gathered"]:
        result["fail_closed"] = _fail_closed_report(on)
    return result


def suite_fp8_all_gather(mesh) -> dict:
    return run_cases(fp8_all_gather_cases(dist.get_world_size()), _run_fp8_all_gather_case, mesh)
