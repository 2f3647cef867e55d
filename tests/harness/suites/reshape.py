"""Reshaped and resharded converted weights under FSDP."""

import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from harness.suites.llama4 import fixed_tokens, fsdp_llama4


def suite_reshape(mesh) -> dict:
    """Load the trainer's checkpoint at $CHECKPOINT (written at another world size) into the
    converted, FSDP-sharded seed-layout model; report the loss on a fixed batch and whether
    the sharded weights reassemble into the checkpoint's values."""
    import torch.nn.functional as F
    from torchtitan.protocols.train_spec import get_train_spec

    checkpoint = os.environ["CHECKPOINT"]
    # The trainer run's flavor: two of the debug model's layers (tests/trainer_batch.py).
    model, model_args, _, _ = fsdp_llama4("llama4_grouped_shared", n_layers=2)
    with torch.no_grad():  # for the buffers (rope); the checkpoint holds every parameter
        model.init_weights(buffer_device=torch.device("cpu"))
    state = model.state_dict()
    dcp.load(state, checkpoint_id=checkpoint)
    # The same checkpoint, unsharded, into the plain model (no converter, no FSDP).
    spec = get_train_spec("llama4_grouped_shared")
    plain = spec.model_cls(model_args)
    plain_state = plain.state_dict()
    dcp.load(plain_state, checkpoint_id=checkpoint)
    # The stored values, gathered from every rank's shard (a list, not all(): every rank must
    # join every collective).
    gathered = {
        name: t.full_tensor() if isinstance(t, DTensor) else t
        for name, t in model.state_dict().items()
        if name in plain_state
    }
    matches = all([torch.equal(t, plain_state[name]) for name, t in gathered.items()])
    tokens = fixed_tokens(model_args.vocab_size)
    with torch.no_grad():
        logits = model(tokens[:, :-1]).float()
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    return {"loss": loss.item(), "weights_match_checkpoint": matches}
