"""Random but valid EXL3 data, for examples, tests and benchmarks.

Every bit pattern is a valid packed trellis (the ring is the bitstream itself), so a random
trellis decodes to codebook values like a real one; only its statistics differ from an encoded
weight. The scales are positive channel scales with random signs, like the quantizer's.
"""

from __future__ import annotations

from typing import Optional

import torch

from .bits import Bits, normalize_bits, words16_per_tile
from .encoded import EncodedLinear, padded_width


def random_trellis(in_padded: int, out_padded: int, bits: Bits, *, generator: Optional[torch.Generator] = None,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """Uniformly random int16 trellis ``[in_p/16, out_p/16, 16·K]``."""
    w = words16_per_tile(normalize_bits(bits))
    return torch.randint(-32768, 32768, (in_padded // 16, out_padded // 16, w), dtype=torch.int16,
                         generator=generator).to(device)


def random_linear(in_features: int, out_features: int, bits: Bits, codebook: str = "mcg", *, seed: int = 0,
                  bias: bool = False, name: str = "") -> EncodedLinear:
    """A random valid :class:`EncodedLinear`; widths that are not multiples of 128 are padded."""
    g = torch.Generator().manual_seed(seed)
    in_p, out_p = padded_width(in_features), padded_width(out_features)

    def scales(n: int, scale: float) -> torch.Tensor:
        sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
        return (sign * scale * (0.5 + torch.rand(n, generator=g))).to(torch.float16)

    return EncodedLinear(
        trellis=random_trellis(in_p, out_p, bits, generator=g),
        suh=scales(in_p, 0.02), svh=scales(out_p, 1.0), codebook=codebook,
        bias=(0.01 * torch.randn(out_p, generator=g)).to(torch.float16) if bias else None,
        in_features=in_features, out_features=out_features, name=name,
    )
