"""Per-parameter gradients of a whole torchtitan model, bf16 and float8_moe against float32.

    python scripts/grad_numerics.py --model deepseek_v3 --flavor debugmodel \
        [--warm-steps 3] [--lr 4e-3] [--out outputs/benchmarks/grad_numerics.json]

Builds the model from torchtitan's train spec (one device, no parallelism), trains a float32
copy for ``--warm-steps`` AdamW steps on the bundled corpus (to reach the weights a short run
reaches), then runs one forward and backward of the same batch in four variants from the same
weights: float32 (the reference), bf16 autocast (what the trainer runs without converters), and
float8_moe under bf16 autocast, on fp8 kernels (CUDA only) and emulated. Prints, per variant, the
loss, the gradient norm and the SQNR of each parameter's gradient against float32, worst first,
and writes them as JSON. A converted model whose non-expert gradients are much further from
float32 than bf16's are is the sign of an fp8 error that the loss alone does not show.
"""

import argparse
import copy
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torchtitan.config import ConfigManager
from torchtitan.protocols.train_spec import get_train_spec

import torchtitan_fp8_moe.config  # noqa: F401 - registers float8_moe and the models
from torchtitan_fp8_moe.cpu import enable_moe_ops
from torchtitan_fp8_moe.fp8.sqnr import sqnr

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "torchtitan_fp8_moe" / "assets"


def _batches(batch: int, seq: int, vocab: int, device):
    """Consecutive [batch, seq + 1] windows of the bundled corpus, tokenized."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tokenizer = HuggingFaceTokenizer(str(ASSETS / "tokenizer"))
    tokens: list[int] = []
    for line in (ASSETS / "corpus" / "train.jsonl").read_text().splitlines():
        tokens += tokenizer.encode(json.loads(line)["text"], add_bos=True, add_eos=True)
    ids = torch.tensor(tokens, device=device).remainder(vocab)
    window = batch * (seq + 1)
    for start in range(0, ids.numel() - window, window):
        yield ids[start : start + window].view(batch, seq + 1)


def _loss(model, batch: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.autocast(batch.device.type, torch.bfloat16, enabled=autocast):
        logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def _converted(model, emulate: bool):
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_converter import build_model_converters

    overrides = [
        "--job.custom_config_module=torchtitan_fp8_moe.config",
        "--model.converters=float8_moe",
        # Numerics of the fp8 path at any shape: the auto policy would keep small ones bf16.
        "--float8_moe.policy=always",
        *(["--float8_moe.emulate"] if emulate else []),
    ]
    job_config = ConfigManager().parse_args(overrides)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    model = copy.deepcopy(model)
    build_model_converters(job_config, dims).convert(model)
    return model


def _grads(model, batch, autocast: bool) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = _loss(model, batch, autocast)
    loss.backward()
    grads = {name: p.grad.detach().float().clone() for name, p in model.named_parameters()}
    return loss.item(), grads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="deepseek_v3")
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warm-steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--show", type=int, default=8, help="worst parameters printed per variant")
    parser.add_argument("--out")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        enable_moe_ops()
    torch.manual_seed(0)
    spec = get_train_spec(args.model)
    model_args = copy.deepcopy(spec.model_args[args.flavor])
    # The fields the trainer fills in from its config (MoE implementation, sequence length).
    model_args.update_from_config(ConfigManager().parse_args([f"--training.seq_len={args.seq}"]))
    with device, torch.no_grad():
        model = spec.model_cls(model_args)
        model.init_weights(buffer_device=device)
    batches = _batches(args.batch, args.seq, model_args.vocab_size, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-15)
    for _ in range(args.warm_steps):
        _loss(model, next(batches), autocast=False).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    batch = next(batches)

    variants = {"float32": (model, False), "bf16": (copy.deepcopy(model), True)}
    if cuda:
        variants["float8_moe"] = (_converted(model, emulate=False), True)
    variants["float8_moe emulated"] = (_converted(model, emulate=True), True)
    _, reference = _grads(model, batch, autocast=False)
    rows = []
    for variant, (module, autocast) in variants.items():
        loss, grads = _grads(module, batch, autocast)
        per_param = {name: sqnr(reference[name], grads[name]) for name in reference}
        norm = torch.stack([g.norm() for g in grads.values()]).norm().item()
        rows.append(
            {"variant": variant, "loss": loss, "grad_norm": norm, "grad_sqnr_db": per_param}
        )
        worst = sorted(per_param.items(), key=lambda item: item[1])[: args.show]
        print(f"{variant}: loss {loss:.5f}, grad norm {norm:.4f}; worst gradient SQNR vs float32:")
        for name, db in worst:
            print(f"    {db:7.1f} dB  {name}")
    if args.out:
        setup = {k: v for k, v in vars(args).items() if k != "out"}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"setup": setup, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
