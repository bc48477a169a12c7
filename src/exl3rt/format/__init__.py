"""The EXL3 format: codebooks, bitstream, tile order, Hadamard, EncodedLinear, reconstruction, checkpoints.

Everything that reads EXL3 bits goes through this package; kernels are tested against
:func:`reconstruct`, and this package is tested against exllamav3's own golden data.
"""

from .bits import ALL_BITS, HALF_BITS, INTEGER_BITS, Bits, bits_from_trellis, normalize_bits, words16_per_tile
from .bitstream import pack_states, tail_biting_violations, unpack_states
from .codebooks import CODEBOOKS, MARKERS, codebook_values, decode_states
from .encoded import EncodedLinear, codebook_from_markers, pack_signs, padded_width, unpack_signs
from .errors import FormatError
from .hadamard import hadamard_128, hadamard_blocks
from .reconstruct import decode, reconstruct
from .tiles import matrix_to_tiles, tensor_core_perm, tiles_to_matrix

__all__ = [
    "ALL_BITS", "HALF_BITS", "INTEGER_BITS", "Bits", "CODEBOOKS", "MARKERS", "EncodedLinear", "FormatError",
    "bits_from_trellis", "codebook_from_markers", "codebook_values", "decode", "decode_states",
    "hadamard_128", "hadamard_blocks", "matrix_to_tiles", "normalize_bits", "pack_signs", "pack_states",
    "padded_width", "reconstruct", "tail_biting_violations", "tensor_core_perm", "tiles_to_matrix",
    "unpack_signs", "unpack_states", "words16_per_tile",
]

from .checkpoint import Exl3Checkpoint, LinearInfo, TensorInfo  # noqa: E402
from .checkpoint_write import CheckpointWriter, write_checkpoint  # noqa: E402

__all__ += ["CheckpointWriter", "Exl3Checkpoint", "LinearInfo", "TensorInfo", "write_checkpoint"]
