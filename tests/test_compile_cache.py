"""torch.compile's on-disk caches never hand a launch a graph compiled for other float8_moe code
or another conversion (``compile_cache.py``): checked with launches that share a cache folder,
each comparing its compiled fp8 results with its own eager ones."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from expert_modules import build_expert_module, expert_inputs, scout_meta_model
from torch.distributed.tensor import DTensor, Shard
from torchtitan.models.moe.moe import _run_experts_grouped_mm

import torchtitan_fp8_moe
from torchtitan_fp8_moe import compile_cache, convert
from torchtitan_fp8_moe.compile_cache import TAG_PREFIX, source_digest

TESTS_DIR = Path(__file__).resolve().parent
PACKAGE = Path(torchtitan_fp8_moe.__file__).resolve().parent
# The emulated rowwise GEMM's last line, and an edit of it that doubles every product.
GEMM_LINE = "        return out.to(out_dtype)\n    kernels = gemm_backends.kernel(backend)"
DOUBLED = "        return (out * 2).to(out_dtype)\n    kernels = gemm_backends.kernel(backend)"


def _experts(seed: int = 0) -> nn.Module:
    return build_expert_module("routed", 4, seed)


def _tag_parts() -> list[str]:
    return torch.compiler.config.cache_key_tag.split("|")


def _tag_of(model: nn.Module, **settings) -> str:
    """The tag of converting ``model`` alone in a fresh process (no earlier conversions)."""
    compile_cache._CONVERTED.clear()
    convert(model, **{"fqns": ["experts"], "emulate": True, **settings})
    return _tag_parts()[-1]


@torch.compiler.config.patch(cache_key_tag="mine")
def test_the_tag_names_the_conversion_and_keeps_other_tags(monkeypatch):
    monkeypatch.setattr(compile_cache, "_CONVERTED", set())
    assert _tag_parts() == ["mine"]
    first = _tag_of(_experts())
    assert _tag_parts() == ["mine", first] and first.startswith(TAG_PREFIX)
    # Another model converted alike in one process (or another launch): the same tag, in place
    # of the first.
    convert(_experts(seed=1), fqns=["experts"], emulate=True)
    assert _tag_parts() == ["mine", first]
    assert _tag_of(_experts(seed=2)) == first
    others = {
        "another recipe": _tag_of(_experts(), recipe="blockwise"),
        "fp8 weight cache": _tag_of(_experts(), cache_fp8_weights=True),
        "fp8 all-gather": _tag_of(_experts(), fp8_all_gather=True),
        "CUDA path": _tag_of(_experts(), emulate=False, policy="always"),
        "fewer weights": _tag_of(scout_meta_model(), fqns=["moe.experts"]),
        "more weights": _tag_of(scout_meta_model(), fqns=["moe.experts", "shared_experts"]),
    }
    assert _tag_parts()[0] == "mine" and len(_tag_parts()) == 2
    assert len({first, *others.values()}) == len(others) + 1, others
    # A later conversion in the same process keys the graphs by both.
    both = _tag_of(_experts())
    convert(_experts(), fqns=["experts"], emulate=True, recipe="blockwise")
    assert _tag_parts()[-1] not in (both, others["another recipe"])


def test_converted_weights_are_named_alike_inside_dtensors(tmp_path, monkeypatch):
    """Expert parallelism wraps the converted weights in DTensors after conversion; their rows
    (what the tag hashes) stay, and hold no object addresses (which would differ per process)."""
    from torch.distributed.device_mesh import init_device_mesh

    module = _experts()
    convert(module, fqns=["experts"], emulate=True)
    rows = compile_cache.converted_weights(module)
    assert [name for name, _, _ in rows] == ["experts.w1", "experts.w2", "experts.w3"]
    assert "0x" not in repr(rows)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        parallel = _ParallelExperts(module, init_device_mesh("cpu", (1,)))
        assert all(isinstance(p, DTensor) for p in parallel.parameters())
        assert compile_cache.converted_weights(parallel) == rows
    finally:
        torch.distributed.destroy_process_group()


def _aot_cache_hash(weight: torch.Tensor) -> str:
    """What torch's AOTAutograd cache key holds for ``weight`` (its pickler's hash), with every
    warning an error: torch warns about a subclass without ``_stable_hash_for_caching``."""
    import warnings

    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCachePickler

    pickler = AOTAutogradCachePickler(torch.fx.GraphModule(nn.Module(), torch.fx.Graph()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return pickler.get_hash(weight)


def test_converted_weights_give_torch_a_stable_cache_hash():
    """torch's extension point for a tensor subclass in the AOTAutograd cache key: the hash of a
    weight names its class, configuration, shapes and dtypes, never its values or addresses."""
    from torchtitan_fp8_moe.fp8.weight_cache import WeightPayloads
    from torchtitan_fp8_moe.weight import Float8MoEWeight, WeightConfig
    from torchtitan_fp8_moe.weight.gathered import Float8GatheredWeight

    def weight(config=None, shape=(4, 32, 16)):
        config = config or WeightConfig(emulate=True)
        return Float8MoEWeight(torch.randn(shape, dtype=torch.bfloat16), config)

    first = weight()
    assert _aot_cache_hash(first) == _aot_cache_hash(weight())  # other values and storage
    others = [
        weight(WeightConfig(emulate=True, recipe="blockwise")),
        weight(WeightConfig(emulate=True, cache_fp8=True)),
        weight(shape=(4, 16, 32)),
        first.transpose(-2, -1),
    ]
    hashes = {_aot_cache_hash(w) for w in [first, *others]}
    assert len(hashes) == len(others) + 1

    def gathered(transposed: bool):
        g, k, n = 4, 16, 32
        payloads = WeightPayloads(
            torch.zeros(g, k, n, dtype=torch.float8_e4m3fn),
            torch.ones(g, 1, n),
            torch.zeros(g, n, k, dtype=torch.float8_e4m3fn),
            torch.ones(g, 1, k),
        )
        size, stride = (g, k, n), (k * n, n, 1)
        return Float8GatheredWeight(
            payloads, size, stride, torch.bfloat16, WeightConfig(emulate=True), transposed
        )

    assert _aot_cache_hash(gathered(False)) == _aot_cache_hash(gathered(False))
    assert _aot_cache_hash(gathered(False)) != _aot_cache_hash(gathered(True))
    assert _aot_cache_hash(gathered(False)) not in hashes


def test_the_source_digest_follows_every_file(tmp_path):
    copy = tmp_path / "torchtitan_fp8_moe"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert source_digest(copy) == source_digest(PACKAGE)
    gemm = copy / "fp8" / "recipes" / "rowwise" / "recipe.py"
    gemm.write_text(gemm.read_text().replace(GEMM_LINE, DOUBLED))
    edited = source_digest.__wrapped__(copy)
    assert edited != source_digest(PACKAGE)
    (copy / "extra.py").write_text("")
    assert source_digest.__wrapped__(copy) not in (edited, source_digest(PACKAGE))


class _ParallelExperts(nn.Module):
    """The routed experts with their weights as DTensors, as expert parallelism leaves them."""

    def __init__(self, experts: nn.Module, mesh):
        super().__init__()
        self.experts = experts.experts
        for name in ("w1", "w2", "w3"):
            local = getattr(self.experts, name).detach()
            dtensor = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            setattr(self.experts, name, nn.Parameter(dtensor))

    def forward(self, x, tokens_per_expert):
        e = self.experts
        weights = [w.to_local() for w in (e.w1, e.w2, e.w3)]
        return _run_experts_grouped_mm(*weights, x, tokens_per_expert)


def _fwd_bwd(module: nn.Module, forward) -> list[torch.Tensor]:
    x, routing, target = expert_inputs("routed", 4, 0)
    x.requires_grad_()
    out = forward(x, *routing)
    (out.float() * target).sum().backward()
    grads = [
        p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in module.parameters()
    ]
    results = [out.detach(), x.grad, *[g.clone() for g in grads]]
    module.zero_grad()
    return results


def launch() -> None:
    """One launch (a child process): build the routed experts, convert them (unless
    ``FP8_TEST_MODE=bf16``), wrap the weights in DTensors over a one-rank group if
    ``FP8_TEST_DTENSOR=1``, and check the compiled forward and backward against eager."""
    import torch._inductor.config
    from torch.distributed.device_mesh import init_device_mesh

    torch._inductor.config.emulate_precision_casts = True  # as the converter sets it
    fp8 = os.environ["FP8_TEST_MODE"] == "fp8"
    module = _experts()
    if fp8:
        convert(module, fqns=["experts"], emulate=True)
    if os.environ["FP8_TEST_DTENSOR"] == "1":
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{os.environ['FP8_TEST_STORE']}", rank=0, world_size=1
        )
        module = _ParallelExperts(module, init_device_mesh("cpu", (1,)))
    eager = _fwd_bwd(module, module)
    compiled = _fwd_bwd(module, torch.compile(module, fullgraph=True))
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want)
    from torch._dynamo.utils import counters

    print(json.dumps(dict(counters["aot_autograd"])))


def _launch(cache: Path, package_root: Path, mode: str, dtensor: bool, store: Path) -> dict:
    inherited = os.environ.get("PYTHONPATH")
    path = os.pathsep.join(str(p) for p in (package_root, TESTS_DIR, inherited) if p)
    env = {k: v for k, v in os.environ.items() if not k.endswith("FORCE_DISABLE_CACHES")}
    env.update(
        PYTHONPATH=path,
        TORCHINDUCTOR_CACHE_DIR=str(cache),
        TORCHINDUCTOR_FX_GRAPH_CACHE="1",
        TORCHINDUCTOR_AUTOGRAD_CACHE="1",
        FP8_TEST_MODE=mode,
        FP8_TEST_DTENSOR="1" if dtensor else "0",
        FP8_TEST_STORE=str(store),
    )
    result = subprocess.run(
        [sys.executable, "-c", "import test_compile_cache as t; t.launch()"],
        cwd=package_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, (mode, dtensor, package_root, result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_launch_of_edited_code_compiles_its_own(tmp_path):
    """A launch with an edited float8_moe after one with this package, sharing their compile
    cache. Without the tag the edited launch ran the first one's graph: its compiled results
    were half its eager ones."""
    edited_root = tmp_path / "edited"
    shutil.copytree(PACKAGE, edited_root / "torchtitan_fp8_moe")
    gemm = edited_root / "torchtitan_fp8_moe" / "fp8" / "recipes" / "rowwise" / "recipe.py"
    source = gemm.read_text()
    assert GEMM_LINE in source
    gemm.write_text(source.replace(GEMM_LINE, DOUBLED))
    repo_root, cache = PACKAGE.parent, tmp_path / "cache"
    first = _launch(cache, repo_root, "fp8", False, tmp_path / "store0")
    assert first.get("autograd_cache_saved") == 1, first  # the cache is in use
    _launch(cache, edited_root, "fp8", False, tmp_path / "store1")
    again = _launch(cache, repo_root, "fp8", False, tmp_path / "store2")
    assert again.get("autograd_cache_hit") == 1, again  # the same code still hits


@pytest.mark.slow
def test_an_fp8_launch_after_a_bf16_one_compiles_its_own(tmp_path):
    """A bf16 launch, then an fp8 launch of the same model, with the expert weights as DTensors
    (expert parallelism), sharing their compile cache. Without the tag the fp8 launch loaded
    the bf16 graph and died in it (a segmentation fault)."""
    repo_root, cache = PACKAGE.parent, tmp_path / "cache"
    bf16 = _launch(cache, repo_root, "bf16", True, tmp_path / "store0")
    assert bf16.get("autograd_cache_saved") == 1, bf16
    _launch(cache, repo_root, "fp8", True, tmp_path / "store1")
