"""torchtitan_fp8_moe/torch_private.py lists every private torch and torchtitan name the package
uses (fail closed: a new one fails here until it is listed), and the installed torch has each."""

import ast
from pathlib import Path

from torchtitan_fp8_moe import torch_private
from torchtitan_fp8_moe.torch_private import PRIVATE_TORCH, PRIVATE_TORCHTITAN, covers

PACKAGE = Path(torch_private.__file__).parent
FOREIGN = ("torch", "torchtitan")
# Attributes with a leading underscore that are no private API of torch or torchtitan.
NOT_PRIVATE = {
    "_asdict": "a namedtuple's public API",
    "_fields": "a namedtuple's public API",
    "_keeps_fp8_shard_buffer": "the package's own mark on the function it patches in",
}


def _private(segment: str) -> bool:
    return segment.startswith("_") and not (segment.startswith("__") and segment.endswith("__"))


def _chain(node: ast.expr) -> tuple[list[str], bool]:
    """``a.b.c`` as ["a", "b", "c"], and whether it starts at a name (not at a call)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1], isinstance(node, ast.Name)


def _getattr_as_attribute(node: ast.AST) -> ast.AST:
    """``getattr(x, "_name"...)`` / ``hasattr`` as the attribute ``x._name``."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr", "setattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return ast.Attribute(value=node.args[0], attr=node.args[1].value, ctx=ast.Load())
    return node


def _own_names(trees) -> set[str]:
    """Names the package defines: functions, classes, variables, arguments, ``self.x``."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                names.add(node.attr)
    return names


def private_uses() -> dict[str, set[str]]:
    """Every private torch or torchtitan name the package uses, with where: imports, attribute
    chains from an imported torch module or name (``aten = torch.ops.aten`` followed), and, on
    any other object, a private attribute the package does not define itself (as
    ``?._name``)."""
    trees = {p: ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}
    own = _own_names(trees.values())
    uses: dict[str, set[str]] = {}

    def use(name: str, path: Path, node: ast.AST) -> None:
        uses.setdefault(name, set()).add(f"{path.relative_to(PACKAGE)}:{node.lineno}")

    for path, tree in trees.items():
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    aliases[a.asname or a.name.split(".")[0]] = (
                        a.name if a.asname else a.name.split(".")[0]
                    )
                    if a.name.split(".")[0] in FOREIGN and any(map(_private, a.name.split("."))):
                        use(a.name, path, node)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    aliases[a.asname or a.name] = full
                    if node.module.split(".")[0] in FOREIGN and any(map(_private, full.split("."))):
                        use(full, path, node)
        for node in tree.body:  # module-level aliases: aten = torch.ops.aten
            if isinstance(node, ast.Assign) and [type(t) for t in node.targets] == [ast.Name]:
                parts, named = _chain(node.value)
                if named and parts[0] in aliases:
                    aliases[node.targets[0].id] = ".".join([aliases[parts[0]], *parts[1:]])
        nodes = [_getattr_as_attribute(node) for node in ast.walk(tree)]
        inner = {id(n.value) for n in nodes if isinstance(n, ast.Attribute)}
        for node in nodes:
            if not isinstance(node, ast.Attribute) or id(node) in inner:
                continue
            node.lineno = getattr(node, "lineno", None) or node.value.lineno
            parts, named = _chain(node)
            if named and parts[0] in aliases:
                full = ".".join([aliases[parts[0]], *parts[1:]])
                if full.split(".")[0] in FOREIGN and any(map(_private, full.split("."))):
                    use(full, path, node)
                continue
            for part in parts[1:] if named else parts:
                if _private(part) and part not in own and part not in NOT_PRIVATE:
                    use(f"?.{part}", path, node)
    return uses


def _listed(name: str) -> bool:
    tables = {**PRIVATE_TORCH, **PRIVATE_TORCHTITAN}
    if name.startswith("?."):  # an attribute of an object: listed under its class
        return any(listed.endswith(name[1:]) for listed in tables)
    return covers(tables, name) or any(listed.startswith(name + ".") for listed in tables)


def test_every_private_use_is_listed():
    missing = {name: sorted(where) for name, where in private_uses().items() if not _listed(name)}
    assert not missing, (
        f"private torch / torchtitan names used but not in torch_private.py: {missing}; list "
        "each with where, why and the torch versions it was checked on"
    )


def test_every_listed_name_is_used():
    uses = private_uses()
    unused = [
        listed
        for listed in {**PRIVATE_TORCH, **PRIVATE_TORCHTITAN}
        if not any(
            name == listed
            or name.startswith(listed + ".")
            or listed.startswith(name + ".")
            or (name.startswith("?.") and listed.endswith(name[1:]))
            for name in uses
        )
    ]
    assert not unused, f"listed in torch_private.py but no longer used: {unused}"


def test_the_scan_finds_each_kind_of_use():
    uses = private_uses()
    assert "torch._grouped_mm" in uses  # an attribute of torch
    assert "torch.ops.aten._to_copy" in uses  # through aten = torch.ops.aten
    assert "torch.utils._pytree.tree_leaves" in uses  # through import ... as pytree
    assert "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam" in uses  # from-import
    assert "?._local_tensor" in uses  # an attribute of a DTensor
    assert not any(name.endswith("_set_timeout") for name in uses)  # the package's own name


def test_every_listed_torch_name_resolves_in_this_torch():
    """CI runs this on torch 2.13 and 2.15; the torchtitan names are checked in tests_v03."""
    assert torch_private.unresolved() == []


def test_the_private_torchtitan_022_names_resolve():
    """The torchtitan table's 0.2.2 entries on the installed 0.2.2 (tests_v03/ checks 0.3's)."""
    on_v022 = {n: p for n, p in PRIVATE_TORCHTITAN.items() if "0.2.2" in p.checked}
    assert torch_private.unresolved(on_v022) == []
