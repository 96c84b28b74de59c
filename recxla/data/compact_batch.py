"""`CompactBatch`: one Batch as one contiguous buffer with a small header, optionally zstd, for
moving batches between processes or machines (loader workers -> trainer, Ray object store).

Layout (little-endian), every section starting at a multiple of 8 bytes:

    header   72 bytes: magic "RXCB", version, flags (zstd, weights, request ids), header size,
             CRC-32 of the header, B, number of keys F, dense width D, number of ids N, a dtype
             code per section, payload size raw and stored, CRC-32 of the stored payload, key
             bytes; then the keys (u16 length + UTF-8 each), padded to 8
    payload  lengths [F * B] | values [N] | weights [N] (flag) | dense [B, D] | labels [B] |
             request_ids [B] (flag); zstd-compressed as one frame when the flag says so

Decoding checks everything it relies on (magic, version, both checksums, zstd's own checksum
of the decompressed bytes, sizes, lengths >= 0 summing to N) and raises DataFormatError("compact batch: ...") otherwise, so a corrupt or
truncated buffer never becomes a batch. The round trip is exact: same keys, dtypes and bits.
The decoded tensors are views of one fresh buffer (one copy of the payload, none per tensor).
"""

import struct
import zlib
from typing import List, Optional, Tuple

import numpy as np
import torch
import zstandard

from recxla.data.errors import DataFormatError

MAGIC = b"RXCB"
VERSION = 1
_FIXED = struct.Struct("<4sHHIIQIIQ6B2xQQII")
HEADER_BYTES = _FIXED.size  # 72
_ZSTD, _WEIGHTS, _REQUEST_IDS = 1, 2, 4
_CODES = {torch.uint8: 1, torch.int32: 2, torch.int64: 3, torch.float16: 4, torch.bfloat16: 5,
          torch.float32: 6, torch.float64: 7}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}
_INTS, _FLOATS = (torch.int32, torch.int64), (torch.float16, torch.bfloat16, torch.float32,
                                               torch.float64)
# section -> dtypes it may have
_ALLOWED = {"lengths": _INTS, "values": _INTS, "weights": _FLOATS, "dense": _FLOATS,
            "labels": _FLOATS, "request_ids": (torch.int64,)}
DEFAULT_LEVEL = 3
ERR = "compact batch"


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def _sections(flags: int, b: int, f: int, d: int, n: int, dtypes: dict) -> List[Tuple]:
    """(name, element count, dtype) of the payload's sections, in order."""
    out = [("lengths", f * b, dtypes["lengths"]), ("values", n, dtypes["values"])]
    if flags & _WEIGHTS:
        out.append(("weights", n, dtypes["weights"]))
    out += [("dense", b * d, dtypes["dense"]), ("labels", b, dtypes["labels"])]
    if flags & _REQUEST_IDS:
        out.append(("request_ids", b, dtypes["request_ids"]))
    return out


def _offsets(sections) -> Tuple[List[int], int]:
    offsets, pos = [], 0
    for _, count, dtype in sections:
        offsets.append(pos)
        pos = _pad8(pos + count * dtype.itemsize)
    return offsets, pos


def _dtype_of(t: torch.Tensor, name: str) -> torch.dtype:
    if t.dtype not in _ALLOWED[name]:
        raise ValueError(f"CompactBatch.encode: {name} must have dtype in "
                         f"{[str(x) for x in _ALLOWED[name]]}, got {t.dtype}")
    return t.dtype


class CompactBatch:
    """Encode a `recxla.data.Batch` to bytes and back (see the module doc for the layout)."""

    @staticmethod
    def encode(batch, compress: bool = True, level: int = DEFAULT_LEVEL) -> bytes:
        """Batch -> bytes: header + payload (zstd level `level` when `compress`).

        batch: recxla.data.Batch on any device (copied to CPU): KJT with int32/int64 lengths and
        values, optional float weights, one batch size for all keys; dense float [B, D]; labels
        float [B]; request_ids int64 [B] or None.
        """
        from recxla.data.parquet_layout import check_batch

        check_batch(batch, "CompactBatch.encode")
        kjt = batch.sparse
        b, keys = kjt.stride(), list(kjt.keys())
        parts = {"lengths": kjt.lengths(), "values": kjt.values(), "weights": kjt.weights_or_none(),
                 "dense": batch.dense, "labels": batch.labels, "request_ids": batch.request_ids}
        flags = (_ZSTD if compress else 0) | (_WEIGHTS if parts["weights"] is not None else 0) | (
            _REQUEST_IDS if parts["request_ids"] is not None else 0)
        dtypes = {k: _dtype_of(t, k) if t is not None else torch.float32 for k, t in parts.items()}
        n = kjt.values().numel()
        sections = _sections(flags, b, len(keys), batch.dense.shape[1], n, dtypes)
        offsets, raw_size = _offsets(sections)
        # A raw payload is never assembled on its own: its sections (uint8 views of the
        # tensors, and zero padding) go straight into the one join that makes the result, so a
        # raw encode reads the tensors twice (checksum, copy) and writes once.
        chunks = []
        for (name, count, dtype), off in zip(sections, offsets):
            src = parts[name].detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            chunks.append(src.numpy())
            pad = _pad8(off + count * dtype.itemsize) - (off + count * dtype.itemsize)
            if pad:
                chunks.append(bytes(pad))
        if compress:
            # One-shot compression of the joined payload: zstd's streaming interface is about
            # a third slower here than the extra copy.
            chunks = [zstandard.ZstdCompressor(level=level, write_checksum=True).compress(
                b"".join(chunks))]
        # Over the stored bytes: every flipped bit is caught, even one that zstd would ignore
        # (a frame header flag), and a compressed batch is checked at its compressed size.
        crc = 0
        for c in chunks:
            crc = zlib.crc32(c, crc)
        stored_size = sum(memoryview(c).nbytes for c in chunks)
        key_bytes = b"".join(struct.pack("<H", len(k.encode())) + k.encode() for k in keys)
        header_size = _pad8(HEADER_BYTES + len(key_bytes))
        codes = [_CODES[dtypes[k]] if parts[k] is not None else 0 for k in
                 ("values", "lengths", "weights", "dense", "labels", "request_ids")]
        fields = [MAGIC, VERSION, flags, header_size, 0, b, len(keys), batch.dense.shape[1], n,
                  *codes, raw_size, stored_size, crc, len(key_bytes)]
        header = bytearray(header_size)
        _FIXED.pack_into(header, 0, *fields)
        header[HEADER_BYTES:HEADER_BYTES + len(key_bytes)] = key_bytes
        struct.pack_into("<I", header, 12, zlib.crc32(header))
        return b"".join([header, *chunks])

    @staticmethod
    def decode(data) -> "object":
        """bytes (or bytearray, memoryview, uint8 numpy array) from `encode` -> Batch.

        Raises DataFormatError("compact batch: ...") for a truncated, corrupt or foreign buffer.
        """
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        from recxla.data.synthetic import Batch

        try:
            mv = memoryview(data).cast("B")
        except TypeError as e:
            raise TypeError(f"CompactBatch.decode: data must be bytes-like, got "
                            f"{type(data).__name__}") from e
        header, keys, flags, counts, dtypes = _parse_header(mv)
        b, d, n = counts
        sections = _sections(flags, b, len(keys), d, n, dtypes)
        offsets, raw_size = _offsets(sections)
        h, raw_declared, stored_size, crc = header
        if raw_declared != raw_size:
            raise DataFormatError(f"{ERR}: header declares a {raw_declared}-byte payload, its "
                                  f"counts need {raw_size}")
        if len(mv) != h + stored_size:
            what = "truncated" if len(mv) < h + stored_size else "has trailing bytes"
            raise DataFormatError(f"{ERR}: {len(mv)} bytes, header + payload are "
                                  f"{h + stored_size}: {what}")
        stored = mv[h:]
        if zlib.crc32(stored) != crc:
            raise DataFormatError(f"{ERR}: payload checksum mismatch (corrupt data)")
        # numpy's allocation goes through malloc, which keeps and reuses freed blocks of this
        # size; torch's maps fresh pages for every large tensor, and first-touch page faults
        # then cost more than the copy.
        out = np.empty(raw_size, dtype=np.uint8)
        # (an empty numpy array becomes a tensor with stride 0, which cannot be viewed as ints)
        buf = torch.from_numpy(out) if raw_size else torch.empty(0, dtype=torch.uint8)
        if flags & _ZSTD:
            try:
                if zstandard.frame_content_size(stored) != raw_size:
                    raise zstandard.ZstdError("frame content size differs from the header's")
                out[:] = np.frombuffer(
                    zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw_size),
                    dtype=np.uint8)
            except (zstandard.ZstdError, ValueError) as e:
                raise DataFormatError(f"{ERR}: zstd payload does not decompress ({e})") from e
        else:
            out[:] = np.frombuffer(stored, dtype=np.uint8)
        t = {}
        for (name, count, dtype), off in zip(sections, offsets):
            t[name] = buf[off:off + count * dtype.itemsize].view(dtype)
        lengths = t["lengths"]
        lens = lengths.numpy()
        if lens.size and (int(lens.min()) < 0 or int(lens.sum(dtype=np.int64)) != n):
            raise DataFormatError(f"{ERR}: lengths are negative or do not sum to the {n} ids")
        sparse = KeyedJaggedTensor(keys=keys, values=t["values"], lengths=lengths,
                                   weights=t.get("weights"), stride=b)
        return Batch(sparse, t["dense"].view(b, d), t["labels"], t.get("request_ids"))


def _parse_header(mv: memoryview):
    """Checked header fields: ((size, raw, stored, crc), keys, flags, (B, D, N), dtypes)."""
    if len(mv) < HEADER_BYTES:
        raise DataFormatError(f"{ERR}: {len(mv)} bytes, shorter than the {HEADER_BYTES}-byte "
                              "header (truncated)")
    (magic, version, flags, header_size, header_crc, b, f, d, n, *rest) = _FIXED.unpack_from(mv)
    codes, (raw_size, stored_size, crc, key_bytes) = rest[:6], rest[6:]
    if magic != MAGIC:
        raise DataFormatError(f"{ERR}: starts with {bytes(magic)!r}, not {MAGIC!r}: not a "
                              "compact batch")
    if version != VERSION:
        raise DataFormatError(f"{ERR}: version {version}, this recxla reads version {VERSION}")
    if not HEADER_BYTES <= header_size <= len(mv) or header_size % 8:
        raise DataFormatError(f"{ERR}: header size {header_size} is invalid for a "
                              f"{len(mv)}-byte buffer (truncated or corrupt)")
    header = bytearray(mv[:header_size])
    struct.pack_into("<I", header, 12, 0)
    if zlib.crc32(header) != header_crc:
        raise DataFormatError(f"{ERR}: header checksum mismatch (corrupt header)")
    if flags & ~(_ZSTD | _WEIGHTS | _REQUEST_IDS):
        raise DataFormatError(f"{ERR}: unknown flags {flags:#x}")
    keys, pos, end = [], HEADER_BYTES, HEADER_BYTES + key_bytes
    if end > header_size:
        raise DataFormatError(f"{ERR}: keys run past the header")
    while pos < end:
        (size,) = struct.unpack_from("<H", header, pos)
        if pos + 2 + size > end:
            raise DataFormatError(f"{ERR}: keys run past their {key_bytes} bytes")
        try:
            keys.append(bytes(header[pos + 2:pos + 2 + size]).decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataFormatError(f"{ERR}: a key is not UTF-8 ({e})") from e
        pos += 2 + size
    if len(keys) != f:
        raise DataFormatError(f"{ERR}: header lists {len(keys)} keys, declares {f}")
    names = ("values", "lengths", "weights", "dense", "labels", "request_ids")
    dtypes = {}
    for name, code in zip(names, codes):
        absent = (name == "weights" and not flags & _WEIGHTS) or (
            name == "request_ids" and not flags & _REQUEST_IDS)
        if absent:
            dtypes[name] = torch.float32
            continue
        dtype: Optional[torch.dtype] = _DTYPES.get(code)
        if dtype not in _ALLOWED[name]:
            raise DataFormatError(f"{ERR}: dtype code {code} is not valid for {name}")
        dtypes[name] = dtype
    return (header_size, raw_size, stored_size, crc), keys, flags, (b, d, n), dtypes
