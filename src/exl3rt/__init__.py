"""exl3rt: a runtime for LLM weights quantized as EXL3 trellis codes."""

__version__ = "0.1.0"
