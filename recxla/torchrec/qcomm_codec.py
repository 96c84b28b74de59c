"""recxla's row codec behind TorchRec's quantized-communication interface (QComms).

TorchRec's sharded modules quantize their pooled-embedding all-to-alls through a registry of
codecs, Dict[str, QuantizedCommCodecs] keyed by CommOp name, as built by
`torchrec.distributed.fbgemm_qcomm_codec.get_qcomm_codecs_registry`. `qcomm_codecs_registry`
builds the same registry on recxla's kernels, so FP8 communication also runs on CPU/gloo, where
FBGEMM's FP8 codec raises "fp8 is not supported by CPU":

    sharder = EmbeddingBagCollectionSharder(qcomm_codecs_registry=qcomm_codecs_registry())

How TorchRec drives a codec (torchrec/distributed/comm_ops.py, pooled all-to-all):
    ctx = codec.create_context()
    codec.padded_size(x, dim_sum_per_rank, my_rank, ctx)      # x: [B_global, D_local_sum]
    wire = codec.encode(x.view(-1), ctx)                       # 1-D
    splits = [codec.calc_quantized_size(n, ctx) for n in element_splits]
    all_to_all_single(out, wire, splits...)                    # in wire elements (here bytes)
    y = codec.decode(out, ctx)                                 # 1-D again
The element splits are B_rank x D_local_sum (sent) and B_local x D_rank_sum (received); the
backward pass does the same with the gradient and the other codec.

Rows (FP8 formats): each row of values is quantized with its own fp32 scale (row_dim + 4 bytes a
row), as in FBGEMM's FP8 row-wise codec. Which values make a row is the context's `row_dim`
(TorchRec's QuantizationContext field):
- unset (-1; a codec with row_dim=None, the registry's default, until something gives it a row):
  the tensor's last dimension. encode keeps the leading dims: x [..., D] -> uint8
  [..., D + 4], and decode gives [..., D] back (a 1-D tensor is one row). This is how TorchRec's
  own codec test (test_fbgemm_qcomm_codec.py) uses a codec: create_context, encode, decode, with
  no row size configured, where FBGEMM falls back to unscaled FP8 that clamps at +-0.9375.
- set (> 0): rows of row_dim values; row_dim must divide the last dimension (a row never
  straddles two rows of x), and the wire keeps the leading dims as well: [..., D] -> uint8
  [..., D / row_dim x (row_dim + 4)]. TorchRec's all-to-alls flatten first (1-D in, 1-D out).
A row must not straddle two ranks' splits either. The pooled all-to-all's splits are B x (one
rank's embedding-dim sum), and TorchRec passes those dim sums to `padded_size` before it encodes,
so each call picks its row_dim there: the largest divisor of every rank's dim sum that is at most
the codec's row_dim (32 when None; auto_row_dim, the default). A column-wise shard of a dim-16
table over 2 ranks (8 columns each) thus gets rows of 8, and a table-wise all-to-all of dims 64
and 96 gets rows of 32. The backward codec of the same registry entry is not shown the dims
(TorchRec calls no padded_size there): it uses the largest divisor, up to its own row_dim, of every
dim sum its forward partner has seen, which every rank has seen alike since the all-to-alls are
collective. An all-to-all that gives no dims (TorchRec's sequence and variable-batch all-to-alls)
needs a configured row_dim: the registry gives its sequence codecs row_dim 32 when none is named,
and calc_quantized_size raises a ValueError that says so where a row is still unset. The
sequence all-to-all's splits are ids x the EmbeddingCollection's dim: its forward encodes a flat
tensor, so the row must divide that dim (32 serves every multiple of 32; other dims need
row_dim=, which the error says); its backward encodes the gradient [ids, dim], and with
auto_row_dim a row that does not divide dim becomes the largest divisor of dim up to it. With
auto_row_dim=False every call uses the configured row_dim, and a dim sum it does not divide raises
ValueError naming row_dim, before any data moves. Smaller rows scale more finely and cost 4 bytes
of scale each (rows of 8: 1.5 bytes a value; of 4: 2 bytes, no less than bf16, which is logged).
The plain casts (bf16, fp16, fp32) have no rows and no such constraint; their wire dtype is the
cast dtype itself and they keep the input's shape, so they also serve the reduce-scatter, which
sums on the wire.
"""

import logging
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch

from recxla.formats import (
    DEFAULT_BWD_COMM, DEFAULT_FWD_COMM, FLOAT_DTYPES, FP8_SCALE_BYTES, as_count, get_format,
)
from recxla.ops.fp8_rows import dequantize_rows, quantize_rows

logger = logging.getLogger(__name__)

NAME = "recxla.torchrec.qcomm_codecs_registry"
DEFAULT_ROW_DIM = 32  # FBGEMM's ROW_DIM_DEFAULT: divides the usual embedding dimensions


def largest_divisor_up_to(n: int, limit: int) -> int:
    """The largest d <= limit that divides n (n, limit >= 1)."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


@dataclass
class RowCodecContext:
    """Per-call state TorchRec hands from encode to decode (its QuantizationContext fields)."""

    row_dim: int = -1
    row_dim_quant: int = -1
    padded_dim_sum_per_rank: Optional[List[int]] = None


@dataclass
class CodecStats:
    """What a codec has done: counts for tests and for logging bytes saved; `row_dims` holds every
    FP8 row width a call has used."""

    encode_calls: int = 0
    decode_calls: int = 0
    values_encoded: int = 0
    bytes_encoded: int = 0
    row_dims: Set[int] = field(default_factory=set)


class SplitWidths:
    """The embedding-dim sums per rank that the forward codec of a registry entry has been shown
    (TorchRec's `padded_size`), kept as their gcd, for the backward codec. `seen`: whether any
    were shown (the gcd of dims that are all 0 is 0 too)."""

    def __init__(self):
        self.gcd = 0
        self.seen = False

    def record(self, dims: Sequence[int]) -> None:
        self.seen = True
        for d in dims:
            self.gcd = math.gcd(self.gcd, d)


class RecxlaQuantizedCommCodec:
    """One direction's codec (TorchRec's QuantizedCommCodec protocol) on recxla's row codec.

    Args:
        fmt: wire format: "e4m3", "e5m2" (FP8 rows with an fp32 scale each; wire dtype uint8),
            "bf16", "fp16" or "fp32" (plain casts; wire dtype the cast dtype).
        row_dim: values per FP8 row, or None (no row size configured; see the module
            docstring): with auto_row_dim, the largest row padded_size may pick (32 when None)
            and the row of calls no dims were given for (None: rows along the last dimension);
            without, the row of every call (an int). Ignored by the casts.
        output_dtype: dtype decode returns: float32 (TorchRec's assumption, FBGEMM's default),
            bfloat16 or float16.
        auto_row_dim: pick each call's row_dim from the dims TorchRec passes to padded_size.
        widths: the SplitWidths this codec records into (forward) or picks from (backward);
            qcomm_codecs_registry shares one between the two codecs of an entry.
        backward: the backward codec of an entry: with auto_row_dim, its contexts take their rows
            from `widths` (its forward partner's dims), once there are any.
    encode takes a float tensor (float32/bfloat16/float16) and keeps its leading dims: the
    casts return the input's shape from encode and the wire's shape from decode, as FBGEMM's
    (TorchRec's reduce-scatters encode [B, D] and read `.size(1)`); FP8 encodes [..., D] to
    uint8 [..., bytes of D's rows] and decodes back to [..., D] (1-D for TorchRec's flattened
    all-to-alls; calc_quantized_size(n) bytes for n values in rows of a set row_dim).
    """

    def __init__(
        self,
        fmt: str,
        row_dim: Optional[int] = None,
        output_dtype=torch.float32,
        auto_row_dim: bool = True,
        widths: Optional[SplitWidths] = None,
        backward: bool = False,
        sequence: bool = False,
    ):
        self.fmt = fmt
        self._format = get_format(fmt, NAME)
        if row_dim is not None and (
                isinstance(row_dim, bool) or not isinstance(row_dim, int) or row_dim < 1):
            raise ValueError(f"{NAME}: row_dim must be None or an int >= 1, got {row_dim!r}")
        if output_dtype not in FLOAT_DTYPES:
            raise TypeError(f"{NAME}: output_dtype must be float32, bfloat16 or float16, got "
                            f"{output_dtype}")
        for name, flag in (("auto_row_dim", auto_row_dim), ("backward", backward),
                           ("sequence", sequence)):
            if not isinstance(flag, bool):
                raise TypeError(f"{NAME}: {name} must be a bool, got {flag!r}")
        if not auto_row_dim and row_dim is None:
            raise ValueError(f"{NAME}: auto_row_dim=False needs a row_dim (an int >= 1): the row "
                             "every call uses")
        self.row_dim = row_dim
        self.output_dtype = output_dtype
        self.auto_row_dim = auto_row_dim
        self.backward = backward
        self.sequence = sequence
        self.widths = widths if widths is not None else SplitWidths()
        self.stats = CodecStats()
        self._warned_row_dims: Set[int] = set()

    def __repr__(self) -> str:
        rows = f", row_dim={self.row_dim}" if self._format.is_fp8 else ""
        auto = ", auto_row_dim=False" if self._format.is_fp8 and not self.auto_row_dim else ""
        return f"RecxlaQuantizedCommCodec({self.fmt!r}{rows}{auto})"

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.uint8 if self._format.is_fp8 else self._format.wire_dtype

    @property
    def _comm_precision(self):
        """FBGEMM's SparseType for this format: TorchRec's variable-batch all-to-all reads it
        (and pads splits to row_dim for FP8 under TORCHREC_ENABLE_FP8_ROWWISE_PADDING=1)."""
        from fbgemm_gpu.split_embedding_configs import SparseType

        if self._format.is_fp8:
            return SparseType.FP8
        return {"bf16": SparseType.BF16, "fp16": SparseType.FP16}.get(self.fmt, SparseType.FP32)

    def _pick_row_dim(self, gcd: int) -> int:
        """The row of a call whose dims have gcd `gcd` (0: no values anywhere, any row fits)."""
        if not self.auto_row_dim:
            return self.row_dim
        limit = DEFAULT_ROW_DIM if self.row_dim is None else self.row_dim
        if gcd == 0:
            return limit
        row_dim = largest_divisor_up_to(gcd, limit)
        if row_dim <= 4 and row_dim not in self._warned_row_dims:
            self._warned_row_dims.add(row_dim)
            logger.warning(
                "%s: %s rows of %d values (the embedding-dim sums per rank have gcd %d): %.2f "
                "wire bytes a value, no fewer than bf16's 2", NAME, self.fmt, row_dim, gcd,
                self._format.row_bytes(row_dim) / row_dim)
        return row_dim

    def create_context(self) -> RowCodecContext:
        """A fresh context. FP8: row_dim is the configured one (padded_size may lower it), for
        an auto backward codec the one its forward partner's dims allow, else -1 (unset: rows
        along the last dimension)."""
        if not self._format.is_fp8:
            return RowCodecContext(row_dim=-1)
        if self.auto_row_dim and self.backward and self.widths.seen:
            return RowCodecContext(row_dim=self._pick_row_dim(self.widths.gcd))
        return RowCodecContext(row_dim=-1 if self.row_dim is None else self.row_dim)

    def _row_dim(self, ctx) -> int:
        """The call's row: the context's when one is given (-1: unset), else the codec's."""
        if ctx is None:
            return -1 if self.row_dim is None else self.row_dim
        row_dim = getattr(ctx, "row_dim", None)
        return row_dim if isinstance(row_dim, int) and row_dim > 0 else -1

    def _check_rows(self, n: int, row_dim: int, what: str, why: Optional[str] = None) -> None:
        if n % row_dim:
            if why is None and self.sequence:
                why = ("TorchRec's sequence all-to-all gives the codec no embedding dim, and "
                       "its splits are ids x dim: row_dim must divide the EmbeddingCollection's "
                       "dim; pass qcomm_codecs_registry(row_dim=...) with one that does (32 "
                       "serves dims that are multiples of 32)")
            if why is None:
                why = (f"with {self.fmt} every split (batch x embedding-dim sum) must be whole "
                       "rows; " + ("pass a row_dim that divides every table's embedding "
                                   "dimension" if not self.auto_row_dim else
                                   "only padded_size's dims choose row_dim by themselves"))
            raise ValueError(
                f"{NAME}: {what} of {n} values is not a multiple of row_dim={row_dim}: {why}")

    def padded_size(
        self,
        input_tensor: torch.Tensor,
        dim_per_rank: List[int],
        my_rank: int,
        qcomm_ctx: Optional[RowCodecContext],
    ) -> Tuple[int, int]:
        """(dim sum, 0): no padding. FP8 picks this call's row_dim here from the dim sums of all
        ranks (or, with auto_row_dim=False, checks that the configured one divides them), before
        anything is encoded."""
        if input_tensor.dim() == 1:
            return input_tensor.shape[0], 0
        if self._format.is_fp8:
            dims = [as_count(d, NAME, f"dim_per_rank[{r}]") for r, d in enumerate(dim_per_rank)]
            self.widths.record(dims)
            row_dim = self._pick_row_dim(math.gcd(*dims) if dims else 0)
            for rank, d in enumerate(dims):
                self._check_rows(d, row_dim, f"rank {rank}'s embedding-dim sum")
            if qcomm_ctx is not None:
                qcomm_ctx.row_dim = row_dim
        return input_tensor.shape[1], 0

    def calc_quantized_size(self, input_len: int, ctx: Optional[RowCodecContext] = None) -> int:
        """Wire elements for a split of `input_len` values (bytes for FP8); input_len is any
        integer >= 0. FP8 needs a set row_dim: an unset one makes rows of whole last
        dimensions, whose size a length alone does not give."""
        input_len = as_count(input_len, f"{NAME}: calc_quantized_size", "input_len")
        if not self._format.is_fp8:
            return input_len
        row_dim = self._row_dim(ctx)
        if row_dim < 0:
            raise ValueError(
                f"{NAME}: calc_quantized_size needs a row_dim, and the context has none (-1): "
                "no padded_size call gave it the embedding dims (TorchRec's variable-batch "
                "all-to-all gives none); configure a row_dim that divides every split, "
                "qcomm_codecs_registry(row_dim=...)")
        self._check_rows(input_len, row_dim, "a split")
        return input_len // row_dim * self._format.row_bytes(row_dim)

    def encode(self, input_tensor: torch.Tensor, ctx: Optional[RowCodecContext] = None):
        x = input_tensor
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{NAME}: encode takes a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"{NAME}: encode takes float32, bfloat16 or float16 values, got {x.dtype}")
        if self._format.is_fp8 and x.dim() == 0:
            raise ValueError(f"{NAME}: {self.fmt} encode takes a tensor of 1 or more dims (rows "
                             "lie along the last), got a 0-D tensor")
        self.stats.encode_calls += 1
        self.stats.values_encoded += x.numel()
        if not self._format.is_fp8:
            # The input's shape, as FBGEMM's casts keep it: TorchRec's reduce-scatters hand over
            # [B, D] and size their output from it (an fp32 wire is the input itself).
            wire = x.to(self._format.wire_dtype)
        else:
            lead, dim = x.shape[:-1], x.shape[-1]
            row_dim = self._row_dim(ctx)
            if row_dim < 0:  # unset: one row per last dimension
                row_dim = dim
            elif x.dim() == 1:
                self._check_rows(dim, row_dim, "the tensor to encode")
            elif self.sequence and self.auto_row_dim and dim % row_dim:
                # TorchRec's sequence backward encodes the gradient [ids, dim], and its splits
                # are whole rows of it: a row that divides dim fits every split.
                row_dim = largest_divisor_up_to(dim, row_dim)
                if ctx is not None:
                    ctx.row_dim = row_dim
            else:
                self._check_rows(
                    dim, row_dim, f"the last dimension of the tensor to encode {tuple(x.shape)}",
                    "a row must not straddle two rows of the tensor; flatten it first "
                    "(x.view(-1)), as TorchRec's all-to-alls do")
            per_slice = dim // row_dim if row_dim else 1  # rows in each last-dimension slice
            rows = quantize_rows(x.reshape(math.prod(lead) * per_slice, row_dim), self.fmt)
            wire = rows.view(*lead, per_slice * rows.shape[1])
            self.stats.row_dims.add(row_dim)
            if ctx is not None:
                ctx.row_dim_quant = self._format.row_bytes(row_dim)
        self.stats.bytes_encoded += wire.numel() * wire.element_size()
        return wire

    def decode(self, input_tensor: torch.Tensor, ctx: Optional[RowCodecContext] = None):
        wire = input_tensor
        if not isinstance(wire, torch.Tensor):
            raise TypeError(f"{NAME}: decode takes a torch.Tensor, got {type(wire).__name__}")
        if wire.dtype != self.quantized_dtype:
            raise TypeError(f"{NAME}: decode of {self.fmt} takes {self.quantized_dtype} wire "
                            f"elements, got {wire.dtype}")
        if not self._format.is_fp8:
            self.stats.decode_calls += 1
            return wire.to(self.output_dtype)
        if wire.dim() == 0:
            raise ValueError(f"{NAME}: {self.fmt} decode takes a tensor of 1 or more dims (rows "
                             "lie along the last), got a 0-D tensor")
        lead, width = wire.shape[:-1], wire.shape[-1]
        where = "" if wire.dim() == 1 else f" in the last dimension (shape {tuple(wire.shape)})"
        row_dim = self._row_dim(ctx)
        if row_dim < 0:  # unset: one row per last dimension, codes then a 4-byte scale
            row_dim = width - FP8_SCALE_BYTES
            if row_dim < 0:
                raise ValueError(
                    f"{NAME}: decode got {width} bytes{where}: with no row_dim set that is one "
                    f"row, {FP8_SCALE_BYTES} bytes of scale after the codes, so at least "
                    f"{FP8_SCALE_BYTES}")
        row_bytes = self._format.row_bytes(row_dim)
        if width % row_bytes:
            raise ValueError(
                f"{NAME}: decode got {width} bytes{where}, not whole rows of row_dim={row_dim} "
                f"({row_bytes} bytes each: {row_dim} codes + a 4-byte scale)")
        self.stats.decode_calls += 1
        per_slice = width // row_bytes
        rows = wire.reshape(math.prod(lead) * per_slice, row_bytes)
        out = dequantize_rows(rows, row_dim, self.fmt, self.output_dtype)
        return out.view(*lead, per_slice * row_dim)


# Reduce-scatters add on the wire, which row-scaled FP8 bytes cannot do; like TorchRec's own
# registry, FP8 falls back to a cast there (fp16 keeps more mantissa for activations, bf16 the
# range for gradients).
_REDUCE_SCATTER_FALLBACK = {"fwd": "fp16", "bwd": "bf16"}


def qcomm_codecs_registry(
    fwd: str = DEFAULT_FWD_COMM,
    bwd: str = DEFAULT_BWD_COMM,
    row_dim: Optional[int] = None,
    row_dim_bwd: Optional[int] = None,
    comm_ops: Optional[Sequence] = None,
    output_dtype: torch.dtype = torch.float32,
    auto_row_dim: bool = True,
) -> Dict[str, "QuantizedCommCodecs"]:  # noqa: F821
    """A QComms registry for TorchRec sharders, backed by recxla's kernels (CPU, CUDA, Triton).

    Args:
        fwd: wire format of the forward embeddings: "e4m3", "e5m2", "bf16", "fp16", "fp32".
        bwd: wire format of the backward gradients (same names); bf16 or e5m2 keep the range.
        row_dim: values per FP8 row in forward, or None (none configured, as FBGEMM's
            fp8_quantize_dim): with auto_row_dim, the largest row the pooled all-to-all may
            pick (32 for None), and the row of a call no dims were given for (None: the
            tensor's last dimension, as in TorchRec's own codec test); without, the row of
            every call, which must then divide every rank's embedding-dim sum (see the module
            docstring). The sequence all-to-all gives no dims: its codecs use row_dim, 32 for
            None, which must divide the EmbeddingCollection's dim in forward (its backward
            picks a divisor of the dim itself). Ignored by the casts.
        row_dim_bwd: the same for backward; None: row_dim.
        auto_row_dim: each call picks its FP8 row_dim from the embedding-dim sums per rank (the
            largest divisor of all of them up to row_dim); False: row_dim as given (an int).
        comm_ops: torchrec CommOp members to register; None: the pooled all-to-all, the pooled
            reduce-scatter (FP8 falls back to fp16 forward / bf16 backward there, with a
            warning, since it sums on the wire) and the sequence all-to-all.
        output_dtype: dtype decode returns (TorchRec expects float32).
    Returns:
        Dict[CommOp name, QuantizedCommCodecs] for EmbeddingBagCollectionSharder(
        qcomm_codecs_registry=...) and the other embedding sharders. Each codec's `.stats`
        counts its calls and bytes.
    """
    from torchrec.distributed.types import CommOp, QuantizedCommCodecs

    get_format(fwd, NAME, "fwd")
    get_format(bwd, NAME, "bwd")
    if comm_ops is None:
        comm_ops = [
            CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL,
            CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER,
            CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL,
        ]
    registry = {}
    for op in comm_ops:
        if not isinstance(op, CommOp):
            raise TypeError(f"{NAME}: comm_ops must hold torchrec CommOp members, got {op!r}")
        formats = {"fwd": fwd, "bwd": bwd}
        if op == CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER:
            for direction, fmt in formats.items():
                if get_format(fmt, NAME).is_fp8:
                    formats[direction] = _REDUCE_SCATTER_FALLBACK[direction]
                    logger.warning(
                        "%s: %s %s cannot be summed on the wire by a reduce-scatter; using %s",
                        NAME, direction, fmt, formats[direction],
                    )
        rows = {"fwd": row_dim, "bwd": row_dim if row_dim_bwd is None else row_dim_bwd}
        sequence = op == CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL
        if sequence:
            # TorchRec's sequence all-to-all calls no padded_size: its splits (ids x dim) need a
            # row set from the start.
            rows = {d: DEFAULT_ROW_DIM if r is None else r for d, r in rows.items()}
        # The backward codec picks its rows from the dims its forward partner was shown.
        widths = SplitWidths()
        registry[op.name] = QuantizedCommCodecs(
            forward=RecxlaQuantizedCommCodec(
                formats["fwd"], rows["fwd"], output_dtype, auto_row_dim, widths,
                sequence=sequence),
            backward=RecxlaQuantizedCommCodec(
                formats["bwd"], rows["bwd"], output_dtype, auto_row_dim, widths,
                backward=True, sequence=sequence),
        )
    return registry
