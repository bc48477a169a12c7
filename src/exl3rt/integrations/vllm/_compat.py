"""Every vLLM name the plugin uses, imported in one place (vLLM 0.32 and 0.33 have the same ones).

Importing this module imports vLLM; only the plugin's vLLM-side modules import it.
"""

from __future__ import annotations

from vllm.model_executor.layers.linear import (  # noqa: F401
    LinearBase,
    LinearMethodBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase  # noqa: F401
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts  # noqa: F401
from vllm.model_executor.layers.quantization import (  # noqa: F401
    QUANTIZATION_METHODS,
    register_quantization_config,
)
from vllm.model_executor.layers.quantization.base_config import (  # noqa: F401
    QuantizationConfig,
    QuantizeMethodBase,
)
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead  # noqa: F401
from vllm.model_executor.models.utils import WeightsMapper  # noqa: F401
from vllm.model_executor.model_loader.reload.layerwise import initialize_online_processing  # noqa: F401
from vllm.model_executor.parameter import ModelWeightParameter  # noqa: F401
from vllm.model_executor.utils import set_weight_attrs  # noqa: F401

try:    # vLLM's CPU GEMM for its own unquantized linears (prepacked oneDNN / sgl-kernel weights)
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm  # noqa: F401
except ImportError:  # pragma: no cover - a vLLM without it: the plain F.linear
    dispatch_cpu_unquantized_gemm = None
