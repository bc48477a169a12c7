"""Model sources the command line can use without a download (the bundled SmolLM2-135M)."""

from .smollm2 import SMOLLM2_NAME, smollm2_bf16_dir

__all__ = ["SMOLLM2_NAME", "smollm2_bf16_dir"]
