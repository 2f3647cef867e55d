"""Signal-to-quantization-noise ratio, the measure every numerical bar of this project uses."""

import torch

# Elements per float64 chunk: a whole-tensor float64 copy of a GPT-OSS 120B weight gradient
# ([128, 5760, 2880], 8 bytes an element) does not fit beside the benchmark's other tensors on
# an 80 GB card: it ran an H100 out of memory in the preset benchmark.
CHUNK = 1 << 24


def sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """``20 log10(|reference| / |reference - actual|)`` in dB, the sums of squares taken in
    float64, CHUNK elements at a time (inf when the two are equal). The shapes must match:
    the chunks pair elements by position."""
    if reference.shape != actual.shape:
        raise ValueError(
            f"sqnr: reference {list(reference.shape)} and actual {list(actual.shape)} "
            "differ in shape"
        )
    signal = noise = torch.zeros((), dtype=torch.float64, device=reference.device)
    chunks = zip(reference.reshape(-1).split(CHUNK), actual.reshape(-1).split(CHUNK), strict=True)
    for ref, act in chunks:
        ref = ref.double()
        signal = signal + ref.square().sum()
        noise = noise + (ref - act.double()).square().sum()
    return (10 * torch.log10(signal / noise)).item()
