"""Signal-to-quantization-noise ratio, the measure every numerical bar of this project uses."""

import torch


def sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """``20 log10(|reference| / |reference - actual|)`` in dB, computed in float64 (inf when
    the two are equal)."""
    reference, actual = reference.double(), actual.double()
    return (20 * torch.log10(reference.norm() / (reference - actual).norm())).item()
