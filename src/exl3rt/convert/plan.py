"""Which tensors of a Hugging Face checkpoint become EXL3 linears, at which bitrate.

Rules (exllamav3's defaults):

- every 2-D ``<module>.weight`` is a linear and is quantized at ``bits``, with ``<module>.bias``
  attached, except
- token/position embeddings (``embed``, ``wte``, ``wpe`` in the name) and MoE routers
  (modules named ``…gate`` or ``…router``): copied unquantized;
- ``lm_head`` at ``head_bits`` (default 6; 16 keeps it unquantized). With tied embeddings and no
  stored head, a separate quantized ``lm_head`` is made from the embedding and
  ``tie_word_embeddings`` becomes false;
- MoE experts stored per expert (``…experts.{i}.gate_proj`` …) are ordinary linears;
- ``--keep PATTERN`` keeps matching modules unquantized; ``--bits-for PATTERN=K`` overrides K
  (shell-style patterns on the module name, the last matching override wins).

Fused 3-D expert tensors are refused with a clear message (their layout differs per model), and so is
any tensor name that is not a plain module path (:func:`exl3rt.util.names.module_path_problem`): names
become file names of finished layers, and the checkpoint carries them on.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Optional

from ..encode.errors import EncodeError
from ..format.bits import Bits, is_half, normalize_bits
from ..util.names import EMBED_NAME, HEAD, ROUTER_NAME, module_path_problem
from ..util.tensorfiles import TensorFiles



@dataclasses.dataclass(frozen=True)
class LinearJob:
    """One linear to encode: module name, source tensor names, K, codebook, HF shape [out, in]."""

    name: str
    weight: str
    bias: Optional[str]
    bits: Bits
    codebook: str
    out_features: int
    in_features: int

    @property
    def num_weights(self) -> int:
        return self.out_features * self.in_features


@dataclasses.dataclass
class ConversionPlan:
    linears: list[LinearJob]
    copies: list[str]          # tensors copied as they are
    tied_head_from: Optional[str] = None  # embedding the quantized head is made from

    @property
    def total_weights(self) -> int:
        return sum(j.num_weights for j in self.linears)


def parse_overrides(items: list[str]) -> list[tuple[str, Bits]]:
    """``["*.down_proj=5", "lm_head=8"]`` -> [(pattern, K)]."""
    out = []
    for item in items:
        pattern, sep, value = item.rpartition("=")
        if not sep or not pattern:
            raise EncodeError(f"--bits-for {item!r}: expected PATTERN=K, e.g. '*.down_proj=5'")
        out.append((pattern, normalize_bits(value, name=f"--bits-for {item}")))
    return out


def _bits_for(module: str, default: Bits, overrides: tuple[tuple[str, Bits], ...]) -> Bits:
    """K for ``module``: the last matching ``--bits-for`` override, else ``default``."""
    k = default
    for pattern, value in overrides:
        if fnmatch.fnmatchcase(module, pattern):
            k = value
    return k


def plan_conversion(src: TensorFiles, bits: Bits, codebook: str = "mcg", *, head_bits: Bits = 6,
                    keep: tuple[str, ...] = (), overrides: tuple[tuple[str, Bits], ...] = ()) -> ConversionPlan:
    bits = normalize_bits(bits)
    head_q = float(head_bits) != 16
    if head_q:
        head_bits = normalize_bits(head_bits, name="head_bits")
    config = src.config or {}
    linears: list[LinearJob] = []
    copies: list[str] = []
    claimed: set[str] = set()
    for name in src.names():
        problem = module_path_problem(name)
        if problem:
            raise EncodeError(f"tensor {name!r} in {src.path}: the name {problem}; a tensor name must be a module "
                              f"path of [A-Za-z0-9_-] segments joined by dots. Refusing the checkpoint; nothing "
                              f"was written")
    for name in src.names():
        info = src.info(name)
        if name.endswith(".weight") and len(info.shape) == 3 and ".experts." in f".{name}":
            raise EncodeError(
                f"{name}: fused 3-D expert tensor {info.shape} is not supported yet; "
                f"save the model with per-expert linears (…experts.N.gate_proj.weight)"
            )
        if not name.endswith(".weight") or len(info.shape) != 2:
            continue
        module = name[: -len(".weight")]
        if EMBED_NAME.search(module) or ROUTER_NAME.search(module) or any(fnmatch.fnmatchcase(module, p) for p in keep):
            continue
        if module == HEAD and not head_q:
            continue
        k = _bits_for(module, head_bits if module == HEAD else bits, overrides)
        if is_half(k) and codebook != "mul1":
            raise EncodeError(f"{module}: K = {k} (half-integer) needs --codebook mul1")
        bias = f"{module}.bias" if f"{module}.bias" in src else None
        out_f, in_f = info.shape
        linears.append(LinearJob(module, name, bias, k, codebook, int(out_f), int(in_f)))
        claimed.update({name} | ({bias} if bias else set()))
    copies = [n for n in src.names() if n not in claimed]
    tied_from = None
    if head_q and f"{HEAD}.weight" not in src and config.get("tie_word_embeddings", False):
        emb = next((n for n in src.names() if n.endswith("embed_tokens.weight")), None)
        if emb is not None:
            out_f, in_f = src.info(emb).shape
            k = _bits_for(HEAD, head_bits, overrides)
            linears.append(LinearJob(HEAD, emb, None, k, codebook, int(out_f), int(in_f)))
            tied_from = emb
    if not linears:
        raise EncodeError(f"{src.path}: no 2-D linear weights found to quantize")
    return ConversionPlan(linears=linears, copies=copies, tied_head_from=tied_from)
