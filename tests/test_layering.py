"""The package's layers import one way: ``fp8/`` (the math core) imports nothing else of the
package, ``weight/`` (the weight tensors) only ``fp8/``; the shard plan, the policy and the
torchtitan glue sit above both. Read from the source, function-level imports included."""

import ast
from pathlib import Path

import pytest

import torchtitan_fp8_moe

PACKAGE = Path(torchtitan_fp8_moe.__file__).parent
# Each layer's subpackage and the subpackages it may import.
LAYERS = {"fp8": {"fp8"}, "weight": {"fp8", "weight"}}


def _package_imports(path: Path) -> list[str]:
    """The package's modules that ``path`` imports, as absolute names."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if not node.level:
                names.append(node.module)
                continue
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            if node.module:
                names.append(f"{base}.{node.module}")
            else:
                names += [f"{base}.{alias.name}" for alias in node.names]
    return [n for n in names if n.split(".")[0] == PACKAGE.name]


def test_the_scan_resolves_relative_imports():
    imports = _package_imports(PACKAGE / "weight" / "tensor.py")
    assert "torchtitan_fp8_moe.fp8.weight_cache" in imports
    assert "torchtitan_fp8_moe.weight.fsdp" in imports  # from . import fsdp


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_a_layer_imports_only_the_layers_below(layer):
    upward = [
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in sorted((PACKAGE / layer).rglob("*.py"))
        for name in _package_imports(path)
        if (name.split(".") + [""])[1] not in LAYERS[layer]  # "": the package's own __init__
    ]
    assert not upward
