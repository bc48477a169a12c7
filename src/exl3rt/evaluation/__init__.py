"""Model quality measurements (perplexity on a bundled text)."""

from .perplexity import PerplexityResult, bundled_text, perplexity

__all__ = ["PerplexityResult", "bundled_text", "perplexity"]
