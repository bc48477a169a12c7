"""Persistent, content-addressed cache of EXL3 encodings (docs/cache.md).

Encoding a weight costs seconds to minutes; loading it from here costs a file read. One verb::

    cache = EncodingCache()                                   # EXL3RT_CACHE_DIR / EXL3RT_CACHE_MODE
    key = cache.key_for_weight(w_hf, bits=4, codebook="mcg")  # hashes the weight's bytes
    res = cache.load_or_encode(key, lambda: quantize_weight(w_hf.T.float(), 4, "mcg"), name="layers.0.q_proj")
    res.encoded, res.hit, res.path

Entries live at ``<root>/v1/<digest[:2]>/<digest>.safetensors`` (``digest`` = SHA-256 of the key's
canonical JSON; the key holds the BLAKE3 digest of the source tensor's bytes and every encoder input),
are published atomically under a per-entry ``filelock`` and are fully validated on every read.

Trust boundary: a cache entry becomes model weights. The only integrity checks are the stored key and
payload digest, which anyone able to write an entry can forge, so the cache directory must be writable
only by the user that serves the model (same trust as the checkpoint itself). Directories are created
with mode 0700 and lock files with 0600. A group/world-writable root, ``v1`` or fan-out directory, or one
owned by another user, is reported with a warning; nothing below the root is followed through a symbolic
link. Do not point several users at one shared cache directory; give each its own, or pre-populate one
and mount it read-only with mode ``readonly``.
"""

from .modes import CacheMode, default_cache_root, parse_cache_mode
from .entry import CacheEntryInfo, read_entry
from .errors import CacheError, InvalidEntryError
from .key import CacheKey, tensor_digest
from .store import CacheResult, CacheStats, EncodingCache, PruneReport, VerifyResult

__all__ = [
    "CacheEntryInfo", "CacheError", "CacheKey", "CacheMode", "CacheResult", "CacheStats", "EncodingCache",
    "InvalidEntryError", "PruneReport", "VerifyResult", "default_cache_root", "parse_cache_mode",
    "read_entry", "tensor_digest",
]
