"""The recipe registry (``fp8/recipes/__init__.py``): a recipe added as one folder
(``tests/toy_recipe/``) and one ``register_recipe`` call converts a model and trains it, like the
package's own, and names it where an unknown recipe is refused."""

from dataclasses import replace

import pytest
import torch
from torchtitan.protocols.train_spec import get_train_spec
from toy_recipe import PerTensorRecipe

from torchtitan_fp8_moe import Float8MoEWeight, convert
from torchtitan_fp8_moe.cpu import enable_moe_ops
from torchtitan_fp8_moe.fp8.recipes import (
    BlockwiseRecipe,
    RowwiseRecipe,
    recipe_named,
    register_recipe,
    unregister_recipe,
)
from torchtitan_fp8_moe.fp8.sqnr import sqnr


@pytest.fixture
def per_tensor():
    recipe = PerTensorRecipe()
    register_recipe(recipe)
    yield recipe
    unregister_recipe(recipe.name)


def _llama4(seed: int = 0):
    spec = get_train_spec("llama4")
    model = spec.model_cls(replace(spec.model_args["debugmodel"], n_layers=2))
    torch.manual_seed(seed)
    with torch.no_grad():  # as torchtitan's trainer initializes
        model.init_weights()
    return model


def _loss(model, tokens) -> torch.Tensor:
    return model(tokens).float().square().mean()


def _step(model, tokens) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training step: the loss before it and the gradients it applied."""
    loss = _loss(model, tokens)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    return loss.detach(), grads


def test_a_registered_recipe_converts_and_trains_against_fp32(per_tensor, monkeypatch):
    enable_moe_ops()  # torchtitan's MoE on CPU (cpu.py)
    quantizers, casts = per_tensor.quantizers(emulate=True), []
    real_rows = quantizers.rows

    def rows(x):  # wrapped as the tests wrap the package's quantizers: looked up at call time
        casts.append(tuple(x.shape))
        return real_rows(x)

    monkeypatch.setattr(quantizers, "rows", rows)
    reference, model = _llama4(), _llama4()
    plan = convert(model, recipe="per_tensor", fqns=["experts", "shared_expert"], emulate=True)
    converted = {n: p for n, p in model.named_parameters() if isinstance(p, Float8MoEWeight)}
    assert [row.fqn for row in plan] == list(converted) and converted
    assert all(p.config.fp8_recipe is per_tensor for p in converted.values())
    tokens = torch.randint(0, 2048, (1, 64), generator=torch.Generator().manual_seed(1))
    loss_ref, grads_ref = _step(reference, tokens)
    loss, grads = _step(model, tokens)
    assert casts, "the registered recipe's quantizers ran"
    assert torch.allclose(loss, loss_ref, rtol=1e-3)
    for name in converted:
        assert sqnr(grads_ref[name], grads[name]) >= 21, name
    with torch.no_grad():  # the step lowered the loss, by as much as in fp32
        stepped_ref, stepped = _loss(reference, tokens), _loss(model, tokens)
    assert stepped_ref < loss_ref and torch.allclose(stepped, stepped_ref, rtol=1e-3)


def test_the_registry_names_every_registered_recipe(per_tensor):
    assert isinstance(recipe_named("rowwise"), RowwiseRecipe)
    assert isinstance(recipe_named("blockwise"), BlockwiseRecipe)
    assert recipe_named("per_tensor") is per_tensor
    with pytest.raises(ValueError, match=r"one of \['rowwise', 'blockwise', 'per_tensor'\]"):
        recipe_named("mxfp8")
    with pytest.raises(ValueError, match="'per_tensor' is registered already"):
        register_recipe(PerTensorRecipe())


def test_an_unregistered_recipe_is_refused_naming_the_option():
    with pytest.raises(ValueError, match=r"float8_moe.recipe to one of \['rowwise', 'blockwise'\]"):
        recipe_named("per_tensor")
