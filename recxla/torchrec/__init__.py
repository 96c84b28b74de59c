"""TorchRec integration: recxla's quantized communication as a drop-in QComms registry.

Importing this package does not import torchrec; `qcomm_codecs_registry` does, when called.
"""

from recxla.torchrec.qcomm_codec import (
    CodecStats,
    RecxlaQuantizedCommCodec,
    RowCodecContext,
    qcomm_codecs_registry,
)

__all__ = ["CodecStats", "RecxlaQuantizedCommCodec", "RowCodecContext", "qcomm_codecs_registry"]
