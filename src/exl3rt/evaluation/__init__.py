"""Model quality measurements: perplexity on a bundled text, and a quantized model against its reference."""

from .compare import Comparison, Reference, token_windows
from .perplexity import PerplexityResult, bundled_text, perplexity

__all__ = ["Comparison", "PerplexityResult", "Reference", "bundled_text", "perplexity", "token_windows"]
