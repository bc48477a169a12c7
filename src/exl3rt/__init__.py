"""exl3rt: a runtime for LLM weights quantized as EXL3 trellis codes."""

__version__ = "0.1.0"

# Lazy exports: `import exl3rt` stays light (no torch modules built, no transformers imported).
_LAZY = {
    "Exl3Config": "exl3rt.runtime.config",
    "Exl3ConfigError": "exl3rt.runtime.config",
    "Exl3Linear": "exl3rt.runtime.linear",
    "quantize_model": "exl3rt.runtime.quantize_model",
    "Exl3MoE": "exl3rt.runtime.moe_module",
    "TopRouted": "exl3rt.runtime.router_stats",
    "save_exl3": "exl3rt.runtime.export",
    "fuse_linears": "exl3rt.runtime.fusion",
    "unfuse_linears": "exl3rt.runtime.fusion",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'exl3rt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
