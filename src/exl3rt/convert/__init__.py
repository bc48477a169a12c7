"""Offline conversion of a Hugging Face safetensors checkpoint to an EXL3 checkpoint."""

from .plan import ConversionPlan, LinearJob, plan_conversion
from .run import convert_checkpoint

__all__ = ["ConversionPlan", "LinearJob", "convert_checkpoint", "plan_conversion"]
