"""Importing the package patches and registers nothing; converting weights installs the FSDP2
fix (fsdp_shard_buffer.py); the job's custom_config_module registers the converter and models.
Each case runs in a fresh interpreter: the test process has imported everything already."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_STATE = """
import json
import torch
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
from torchtitan.components import metrics
from torchtitan.protocols import model_converter, train_spec

def state():
    return {
        "reset_sharded_param": FSDPParam.__dict__["reset_sharded_param"].__qualname__,
        "patched": getattr(FSDPParam.reset_sharded_param, "_keeps_fp8_shard_buffer", False),
        "histc": torch.histc is torch._C._VariableFunctions.histc,
        "grouped_mm": torch._grouped_mm is torch._C._VariableFunctions._grouped_mm,
        "aten_grouped_mm_cpu": torch._C._dispatch_dump("aten::_grouped_mm"),
        "aten_mm_cpu": torch._C._dispatch_dump("aten::mm"),
        "train_specs": sorted(train_spec._extra_train_specs),
        "memory_monitor": metrics.build_device_memory_monitor.__module__,
        "converters": sorted(model_converter._registry_model_converter_cls),
    }
"""

OURS = {"llama4_grouped_shared", "llama4_scout_slices", "qwen3_slices"}


def _run(code: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _STATE + code],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_the_package_leaves_torch_fsdp_and_torchtitan_as_they_were():
    states = _run(
        "before = state()\n"
        "import torchtitan_fp8_moe\n"
        "after = state()\n"
        "from torchtitan.protocols.train_spec import get_train_spec\n"
        "def registered(name):\n"
        "    try:\n"
        "        get_train_spec(name)\n"
        "        return True\n"
        "    except ValueError:\n"
        "        return False\n"
        f"ours = [n for n in {sorted(OURS)!r} if registered(n)]\n"
        "print(json.dumps({'before': before, 'after': after, 'ours': ours}))\n"
    )
    before, after = states["before"], states["after"]
    assert after == before
    assert after["reset_sharded_param"] == "FSDPParam.reset_sharded_param"
    assert not after["patched"]
    assert after["histc"] and after["grouped_mm"]
    assert "float8_moe" not in after["converters"]
    assert states["ours"] == []


def test_converting_weights_installs_the_fsdp_fix_once():
    states = _run(
        "import torch.nn as nn\n"
        "import torchtitan_fp8_moe\n"
        "from torchtitan_fp8_moe.fsdp_shard_buffer import install\n"
        "class Experts(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.w1 = nn.Parameter(torch.randn(2, 32, 16))\n"
        "        self.w2 = nn.Parameter(torch.randn(2, 16, 32))\n"
        "        self.w3 = nn.Parameter(torch.randn(2, 32, 16))\n"
        "class Model(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.experts = Experts()\n"
        "before = state()\n"
        "torchtitan_fp8_moe.convert(Model(), fqns=['experts'], emulate=True)\n"
        "patched = FSDPParam.reset_sharded_param\n"
        "install()\n"
        "again = FSDPParam.reset_sharded_param is patched\n"
        "print(json.dumps({'before': before, 'after': state(), 'again': again}))\n"
    )
    assert not states["before"]["patched"]
    assert states["after"]["patched"]
    assert states["again"]  # idempotent: one wrapper per process
    # Nothing else changed.
    assert {**states["after"], "patched": False} == states["before"]


def test_the_config_module_registers_the_converter_and_the_bundled_models():
    states = _run(
        "before = state()\n"
        "import torchtitan_fp8_moe.config\n"
        "from torchtitan.protocols.train_spec import get_train_spec\n"
        f"ours = [n for n in {sorted(OURS)!r} if get_train_spec(n)]\n"
        "print(json.dumps({'before': before, 'after': state(), 'ours': ours}))\n"
    )
    assert "float8_moe" not in states["before"]["converters"]
    assert "float8_moe" in states["after"]["converters"]
    assert states["ours"] == sorted(OURS)
    assert not states["after"]["patched"]  # nothing converted yet
