"""recxla.torchrec.qcomm_codecs_registry: the codec on its own, then inside a sharded
EmbeddingBagCollection trained on 2 gloo ranks against TorchRec's fp32 communication."""

import logging
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from recxla.formats import FORMATS
from recxla.reference.fp8_rows import dequantize_rows_ref, quantize_rows_ref
from recxla.torchrec import RecxlaQuantizedCommCodec, qcomm_codecs_registry
from distributed_utils import run_distributed

torchrec = pytest.importorskip("torchrec")
from torchrec.distributed.types import CommOp  # noqa: E402

FMTS = sorted(FORMATS)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_decode_match_the_row_codec_reference(fmt, dtype):
    row_dim = 12
    codec = RecxlaQuantizedCommCodec(fmt, row_dim=row_dim)
    # A strided [B, D_sum] batch, as TorchRec hands over (then flattened).
    x = (torch.randn(5, 2 * 36) * torch.exp(torch.randn(5, 1))).to(dtype)[:, ::2]
    ctx = codec.create_context()
    wire = codec.encode(x, ctx)
    n = x.numel()
    # Both keep the leading dim: FP8 rows of 12 make [5, 3 x 16] bytes, the casts the input's
    # shape (FBGEMM's contract).
    want_shape = (5, codec.calc_quantized_size(36, ctx)) if FORMATS[fmt].is_fp8 else x.shape
    assert wire.shape == want_shape and wire.dtype == codec.quantized_dtype
    rows = x.reshape(-1, row_dim) if FORMATS[fmt].is_fp8 else x.reshape(1, -1)
    want = quantize_rows_ref(rows, fmt).view(-1)
    assert torch.equal(wire.reshape(-1).contiguous().view(torch.uint8), want)
    out = codec.decode(wire, ctx)
    assert out.shape == x.shape and out.dtype == torch.float32
    ref = dequantize_rows_ref(want.view(rows.shape[0], -1), rows.shape[1], fmt, torch.float32)
    assert torch.equal(out.reshape(-1), ref.view(-1))
    if FORMATS[fmt].is_fp8:
        assert ctx.row_dim == row_dim and ctx.row_dim_quant == row_dim + 4
        assert codec.stats.bytes_encoded == n // row_dim * (row_dim + 4)
    assert codec.stats.encode_calls == 1 and codec.stats.decode_calls == 1


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "bf16"])
def test_splits_of_whole_rows_encode_independently(fmt):
    """What the all-to-all relies on: the wire bytes of split i are exactly the first
    calc_quantized_size(split_i) bytes after those of the splits before it."""
    codec = RecxlaQuantizedCommCodec(fmt, row_dim=8)
    splits = [16, 0, 40, 8]
    x = torch.randn(sum(splits))
    wire = codec.encode(x)
    pieces = wire.split([codec.calc_quantized_size(s) for s in splits])
    for piece, part in zip(pieces, x.split(splits)):
        assert torch.equal(piece, codec.encode(part))
        assert torch.equal(codec.decode(piece), codec.decode(codec.encode(part)))
    assert codec.encode(torch.randn(0)).numel() == 0 and codec.decode(pieces[1]).numel() == 0


def test_bad_arguments_raise_naming_the_limit():
    codec = RecxlaQuantizedCommCodec("e4m3", row_dim=32)
    with pytest.raises(ValueError, match="a split of 48 values is not a multiple of row_dim=32"):
        codec.calc_quantized_size(48, codec.create_context())
    with pytest.raises(ValueError, match="the tensor to encode of 40 values"):
        codec.encode(torch.randn(40))
    strict = RecxlaQuantizedCommCodec("e4m3", row_dim=32, auto_row_dim=False)
    with pytest.raises(ValueError, match="rank 1's embedding-dim sum of 48 values"):
        strict.padded_size(torch.randn(4, 64), [64, 48], 0, strict.create_context())
    assert RecxlaQuantizedCommCodec("bf16", row_dim=32).calc_quantized_size(48) == 48
    with pytest.raises(ValueError, match="row_dim must be None or an int >= 1, got 0"):
        RecxlaQuantizedCommCodec("e4m3", row_dim=0)
    with pytest.raises(ValueError, match="auto_row_dim=False needs a row_dim"):
        RecxlaQuantizedCommCodec("e4m3", auto_row_dim=False)
    # A configured row never straddles two rows of an N-D tensor (1-D: any whole rows).
    with pytest.raises(ValueError, match=r"the last dimension of the tensor to encode \(4, 6\) "
                                         r"of 6 values is not a multiple of row_dim=4: a row must "
                                         r"not straddle two rows of the tensor; flatten it first"):
        RecxlaQuantizedCommCodec("e4m3", row_dim=4).encode(torch.randn(4, 6))
    assert RecxlaQuantizedCommCodec("e4m3", row_dim=4).encode(torch.randn(4, 6).view(-1)).shape \
        == (6 * 8,)
    # No row set: a length alone does not give the wire size (rows are whole last dimensions).
    unset = RecxlaQuantizedCommCodec("e4m3")
    with pytest.raises(ValueError, match=r"calc_quantized_size needs a row_dim, and the context "
                                         r"has none \(-1\): no padded_size call"):
        unset.calc_quantized_size(32, unset.create_context())
    with pytest.raises(ValueError, match=r"decode got 3 bytes: with no row_dim set that is one "
                                         r"row, 4 bytes of scale after the codes, so at least 4"):
        unset.decode(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"e4m3 encode takes a tensor of 1 or more dims"):
        unset.encode(torch.tensor(1.0))
    with pytest.raises(TypeError, match="output_dtype must be float32"):
        RecxlaQuantizedCommCodec("e4m3", output_dtype=torch.int8)
    with pytest.raises(ValueError, match="fwd must be one of"):
        qcomm_codecs_registry(fwd="fp8")
    with pytest.raises(ValueError, match="bwd must be one of"):
        qcomm_codecs_registry(bwd="int8")
    with pytest.raises(TypeError, match="comm_ops must hold torchrec CommOp members"):
        qcomm_codecs_registry(comm_ops=["POOLED_EMBEDDINGS_ALL_TO_ALL"])


@pytest.mark.parametrize("fmt", FMTS)
def test_codec_defects(fmt):
    """Each of these misbehaved before: a negative size gave a negative size (-4 -> -8), integer
    values were cast silently, a buffer of partial rows gave a raw view error, and numpy integers
    (TorchRec's splits can be) were not accepted everywhere."""
    codec = RecxlaQuantizedCommCodec(fmt, row_dim=4)
    with pytest.raises(ValueError, match=r"calc_quantized_size: input_len must be an int >= 0, "
                                         r"got -4"):
        codec.calc_quantized_size(-4)
    with pytest.raises(TypeError, match=r"input_len must be an int >= 0, got 4.0"):
        codec.calc_quantized_size(4.0)
    assert codec.calc_quantized_size(np.int64(8)) == codec.calc_quantized_size(8)
    for ints in (torch.arange(8), torch.ones(8, dtype=torch.int32), torch.ones(8, dtype=torch.bool)):
        with pytest.raises(TypeError, match=r"encode takes float32, bfloat16 or float16 values, "
                                            rf"got {ints.dtype}"):
            codec.encode(ints)
    wire = codec.encode(torch.randn(16))
    with pytest.raises(TypeError, match=rf"decode of {fmt} takes {codec.quantized_dtype}"):
        codec.decode(wire.float() if wire.dtype != torch.float32 else wire.half())
    if FORMATS[fmt].is_fp8:
        with pytest.raises(ValueError, match=r"decode got 7 bytes, not whole rows of row_dim=4 "
                                             r"\(8 bytes each"):
            codec.decode(wire[:7])
    # Empty tensors encode and decode (no special case in between).
    empty = codec.encode(torch.randn(0, 4)[:, :0])
    assert empty.numel() == 0 and codec.decode(empty).numel() == 0


def test_auto_row_dim_is_the_largest_divisor_of_every_ranks_dims():
    from recxla.torchrec.qcomm_codec import largest_divisor_up_to

    for n in range(1, 80):
        for limit in (1, 4, 32):
            d = largest_divisor_up_to(n, limit)
            assert n % d == 0 and d <= limit
            assert all(n % e for e in range(d + 1, min(n, limit) + 1))
    reg = qcomm_codecs_registry("e4m3", "e5m2", comm_ops=[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL])
    fwd, bwd = reg[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name].forward, reg[
        CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name].backward
    # Nothing seen yet, no row_dim configured: unset (rows along the last dimension).
    assert bwd.create_context().row_dim == -1 and fwd.create_context().row_dim == -1
    for dims, want in (([8, 8], 8), ([64, 96], 32), ([24, 0], 24), ([48, 80, 16], 16),
                       ([6, 9], 3), ([0, 0], 32)):
        ctx = fwd.create_context()
        x = torch.randn(5, dims[0])
        assert fwd.padded_size(x, dims, 0, ctx) == (dims[0], 0)
        assert ctx.row_dim == want, dims
        wire = fwd.encode(x.view(-1), ctx)  # 5 x D values, whole rows of `want`
        assert wire.numel() == sum(fwd.calc_quantized_size(5 * d, ctx) for d in dims[:1])
        assert torch.equal(fwd.decode(wire, ctx), dequantize_rows_ref(
            quantize_rows_ref(x.reshape(-1, want), "e4m3"), want, "e4m3").view(-1))
        assert fwd.create_context().row_dim == -1  # the forward's rows come from padded_size
    # The backward codec: the gcd of every dim its partner has seen (8, 64, 96, 24, 48, 80, 16, 6,
    # 9 -> 1).
    assert bwd.create_context().row_dim == 1
    assert fwd.stats.row_dims == {8, 32, 24, 16, 3}


def test_registry_has_torchrecs_keys_and_casts_for_the_reduce_scatter(caplog):
    from fbgemm_gpu.split_embedding_configs import SparseType

    with caplog.at_level(logging.WARNING):
        reg = qcomm_codecs_registry(fwd="e4m3", bwd="e5m2", row_dim=16, row_dim_bwd=8)
    assert set(reg) == {op.name for op in CommOp}
    a2a = reg[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name]
    assert (a2a.forward.fmt, a2a.forward.row_dim) == ("e4m3", 16)
    assert (a2a.backward.fmt, a2a.backward.row_dim) == ("e5m2", 8)
    assert a2a.forward.quantized_dtype == torch.uint8
    assert a2a.forward._comm_precision == SparseType.FP8
    rs = reg[CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.name]
    assert (rs.forward.fmt, rs.backward.fmt) == ("fp16", "bf16")
    assert rs.forward.quantized_dtype == torch.float16  # summable on the wire
    assert "cannot be summed on the wire" in caplog.text
    only = qcomm_codecs_registry("bf16", "bf16", comm_ops=[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL])
    assert list(only) == [CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name]


class _Model(nn.Module):
    """Two tables (dims 8 and 16), pooled, into a linear head: TorchRec's DLRM in small."""

    def __init__(self, tables):
        super().__init__()
        self.ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        self.head = nn.Linear(sum(t.embedding_dim for t in tables), 1)

    def forward(self, kjt):
        return self.head(self.ebc(kjt).values()).squeeze(1)


STEPS, B_LOCAL, ROW_DIM = 4, 4, 8
# Table-wise: t0 (dim 8) on rank 0, t1 (dim 16) on rank 1. Column-wise: t1's 16 columns split
# over both ranks (8 each), t0 table-wise on rank 0 (two all-to-alls, dims [8, 8] and [8, 0]).
LAYOUTS = {"table_wise": {"t0": ("tw", 0), "t1": ("tw", 1)},
           "column_wise": {"t0": ("tw", 0), "t1": ("cw", [0, 1])}}


def _train(rank, world, seed, registry, init, layout="table_wise"):
    """The model sharded as LAYOUTS[layout] says, STEPS of SGD; returns the losses, this rank's
    final weights and the initial weights (init: copy these in instead)."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import (
        column_wise, construct_module_sharding_plan, table_wise)
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    tables = [
        torchrec.EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=50,
                                    feature_names=["f0"]),
        torchrec.EmbeddingBagConfig(name="t1", embedding_dim=16, num_embeddings=40,
                                    feature_names=["f1"]),
    ]
    torch.manual_seed(seed)
    model = _Model(tables)
    apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": 0.5})
    sharder = EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry)
    per_table = {name: table_wise(rank=where) if kind == "tw" else column_wise(ranks=where)
                 for name, (kind, where) in LAYOUTS[layout].items()}
    plan = construct_module_sharding_plan(
        model.ebc, per_table, sharder=sharder, local_size=world, world_size=world,
        device_type="cpu",
    )
    dmp = DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
        plan=ShardingPlan({"ebc": plan}), sharders=[sharder],
    )

    def local_weights():
        out = {}
        for k, v in dmp.state_dict().items():
            shards = v.local_shards() if hasattr(v, "local_shards") else None
            if shards is None or shards:
                out[k] = shards[0].tensor if shards else v
        return out

    with torch.no_grad():
        if init is not None:  # the same starting point as the fp32 run
            for k, w in local_weights().items():
                w.copy_(init[k])
        w0 = {k: w.clone() for k, w in local_weights().items()}
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.5),
    )
    gen = torch.Generator().manual_seed(seed * 7 + rank)  # the same batches in every run
    losses = []
    for _ in range(STEPS):
        lengths = torch.randint(0, 4, (2 * B_LOCAL,), generator=gen)
        ids = torch.randint(0, 40, (int(lengths.sum()),), generator=gen)
        kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], ids, lengths)
        labels = torch.rand(B_LOCAL, generator=gen)
        dense.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(dmp(kjt), labels)
        loss.backward()
        dense.step()
        losses.append(loss.item())
    return losses, {k: w.clone() for k, w in local_weights().items()}, w0, dmp


def _assert_trains_like_fp32(losses, w, losses_f, w_f, w0, report, fwd="e4m3", bwd="bf16"):
    """Each update is a product of at most two quantized factors (error <= 2u to first order,
    u = eps / 2 of the coarser of the two wire formats); doubled for what compounds over the
    steps."""
    u = max(torch.finfo(FORMATS[f].wire_dtype).eps / 2 for f in (fwd, bwd))
    tol = 4 * u
    for k in w:
        delta, delta_f = w[k] - w0[k], w_f[k] - w0[k]
        rel = float((delta - delta_f).norm() / delta_f.norm())
        assert rel <= tol, f"{k}: update differs by {rel:.3g} (relative) from fp32's"
        report[k] = rel
    assert any(not torch.equal(w[k], w_f[k]) for k in w), "FP8 changed nothing"
    for got, want in zip(losses, losses_f):
        assert abs(got - want) <= tol * abs(want)


def _training_body(rank, world, seed):
    losses_f, w_f, w0, _ = _train(rank, world, seed, None, None)  # TorchRec, fp32 on the wire
    report = {}
    for fwd, bwd in (("fp32", "fp32"), ("e4m3", "bf16")):
        # The default row_dim (32): each all-to-all picks rows of 8, the gcd of dims 8 and 16.
        reg = qcomm_codecs_registry(fwd, bwd)
        losses, w, _, _ = _train(rank, world, seed, reg, w0)
        a2a = reg[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name]
        # recxla's codec carried every pooled all-to-all, forward and backward.
        assert a2a.forward.stats.encode_calls == STEPS and a2a.forward.stats.decode_calls == STEPS
        assert a2a.backward.stats.encode_calls == STEPS
        d_local = (8, 16)[rank]
        values = world * B_LOCAL * d_local  # B_global x D_local_sum, each step
        row_bytes = FORMATS[fwd].row_bytes(ROW_DIM) if FORMATS[fwd].is_fp8 else 4 * ROW_DIM
        assert a2a.forward.stats.bytes_encoded == STEPS * values // ROW_DIM * row_bytes
        if fwd == "fp32":
            # The identity codec path is TorchRec's own, bit for bit.
            assert losses == losses_f
            assert all(torch.equal(w[k], w_f[k]) for k in w)
            continue
        assert a2a.forward.stats.row_dims == {ROW_DIM}
        _assert_trains_like_fp32(losses, w, losses_f, w_f, w0, report)

    # Without auto_row_dim, tables whose dims (8, 16) row_dim=32 does not divide: a clear error,
    # on every rank, from the first forward (the codec checks in padded_size, before any data
    # moves).
    bad = qcomm_codecs_registry("e4m3", "bf16", row_dim=32, auto_row_dim=False)
    try:
        _train(rank, world, seed, bad, None)
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError("row_dim=32 with 8-wide tables must raise")
    assert "not a multiple of row_dim=32" in message, message
    return report


@pytest.mark.distributed
def test_sharded_ebc_trains_like_fp32_comm_with_recxla_codec(seed):
    reports = run_distributed(_training_body, 2, args=(seed,), timeout=180)
    assert all(reports)


def _column_wise_body(rank, world, seed):
    losses_f, w_f, w0, _ = _train(rank, world, seed, None, None, "column_wise")
    # Every default (row_dim 32, auto), FP8 both ways: before auto_row_dim, the dim-16 table's
    # 8-column shards failed with "not a multiple of row_dim=32".
    reg = qcomm_codecs_registry("e4m3", "e5m2")
    losses, w, _, _ = _train(rank, world, seed, reg, w0, "column_wise")
    a2a = reg[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name]
    # Two all-to-alls a step (the column-wise and the table-wise sharding), forward and backward.
    assert a2a.forward.stats.encode_calls == 2 * STEPS == a2a.backward.stats.encode_calls
    assert a2a.forward.stats.row_dims == {8} and a2a.backward.stats.row_dims == {8}
    report = {}
    _assert_trains_like_fp32(losses, w, losses_f, w_f, w0, report, "e4m3", "e5m2")
    return report


@pytest.mark.distributed
def test_column_wise_shards_of_a_dim_16_table_pick_their_row_dim(seed):
    reports = run_distributed(_column_wise_body, 2, args=(seed,), timeout=180)
    assert all(reports)


# The shapes FBGEMM's codecs (fbgemm_gpu/quantize_comm.py) return, which TorchRec's collectives
# are written against: its all-to-alls flatten first, its reduce-scatters and all-gathers do not.
CONTRACT_SHAPES = [(7,), (5, 12), (3, 4, 2), (0, 4)]


def _fbgemm_codec(fmt):
    from fbgemm_gpu.quantize_comm import QuantizedCommCodec
    from fbgemm_gpu.split_embedding_configs import SparseType

    return QuantizedCommCodec({"fp32": SparseType.FP32, "fp16": SparseType.FP16,
                               "bf16": SparseType.BF16}[fmt])


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", CONTRACT_SHAPES, ids=str)
def test_casts_return_the_shapes_fbgemm_codecs_return(fmt, shape):
    ours, theirs = RecxlaQuantizedCommCodec(fmt), _fbgemm_codec(fmt)
    x = torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]  # strided, as a batch's slice can be
    wire, want_wire = ours.encode(x, ours.create_context()), theirs.encode(x)
    assert (wire.shape, wire.dtype) == (want_wire.shape, want_wire.dtype)
    out, want_out = ours.decode(wire, ours.create_context()), theirs.decode(want_wire)
    assert (out.shape, out.dtype) == (want_out.shape, want_out.dtype)
    assert torch.equal(out, want_out)


FP8_FMTS = [f for f in FMTS if FORMATS[f].is_fp8]
A2A = CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name


def _fp8_input(shape, dtype=torch.float32):
    """Fresh values far past FBGEMM's unscaled FP8 range (it clamps at +-0.9375), each row of
    its own magnitude, strided as a batch's slice can be."""
    lead, d = shape[:-1], shape[-1]
    x = torch.randn(*lead, 2 * d) * torch.exp(2 * torch.randn(*lead, 1))
    return x[..., ::2].to(dtype)


def _unset_codecs(fmt):
    """Each way a codec meets a tensor with no row size: the pooled all-to-all entry's forward
    and backward codecs of a fresh default registry with their own contexts (TorchRec's codec
    test), FBGEMM's QuantizationContext with row_dim -1, and no context at all."""
    from fbgemm_gpu.quantize_comm import QuantizationContext

    entry = qcomm_codecs_registry(fmt, fmt, comm_ops=[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL])[A2A]
    return {"registry forward": (entry.forward, entry.forward.create_context),
            "registry backward": (entry.backward, entry.backward.create_context),
            "fbgemm context": (RecxlaQuantizedCommCodec(fmt), lambda: QuantizationContext(-1)),
            "no context": (RecxlaQuantizedCommCodec(fmt), lambda: None)}


@pytest.mark.parametrize("fmt", FP8_FMTS)
@pytest.mark.parametrize("shape", [(4, 8), (4, 4), (3, 5, 7), (0, 8), (4, 0), (13,), (0,)],
                         ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_without_row_dim_scales_each_last_dimension(fmt, shape, dtype):
    """No row size configured (TorchRec's own codec test: create_context, encode, decode): a row
    is the last dimension, the wire keeps the leading dims ([..., D] -> [..., D + 4]) and decode
    gives the input's shape back, row by row as the reference. Before, the default registry cut
    the flat tensor into rows of 32: [4, 8] came back as (32,), and [4, 4] (16 values) raised."""
    x = _fp8_input(shape, dtype)
    lead, d = shape[:-1], shape[-1]
    rows = x.reshape(math.prod(lead), d)
    want_wire = quantize_rows_ref(rows, fmt)
    want = dequantize_rows_ref(want_wire, d, fmt, torch.float32)
    for how, (codec, context) in _unset_codecs(fmt).items():
        ctx = context()
        wire = codec.encode(x, ctx)
        assert (wire.shape, wire.dtype) == ((*lead, d + 4), torch.uint8), how
        assert torch.equal(wire.reshape(-1, d + 4), want_wire), how
        out = codec.decode(wire, ctx)
        assert (out.shape, out.dtype) == (shape, torch.float32), how
        assert torch.equal(out.reshape(rows.shape), want), how
        if ctx is not None:
            assert (ctx.row_dim, ctx.row_dim_quant) == (-1, d + 4), how
    if rows.numel():  # scaled per row: each row's largest magnitude comes back
        torch.testing.assert_close(want.abs().amax(1), rows.float().abs().amax(1), rtol=1e-6,
                                   atol=0)
    if fmt == "e4m3" and len(shape) == 2:  # the shape FBGEMM's FP8 codec gives (2-D only)
        from fbgemm_gpu.quantize_comm import QuantizedCommCodec
        from fbgemm_gpu.split_embedding_configs import SparseType

        theirs = QuantizedCommCodec(SparseType.FP8)
        ctx = theirs.create_context()
        assert theirs.decode(theirs.encode(x.float(), ctx), ctx).shape == shape


@pytest.mark.parametrize("fmt", FP8_FMTS)
@pytest.mark.parametrize("shape,row_dim", [((4, 8), 4), ((4, 8), 8), ((3, 5, 8), 4),
                                           ((0, 8), 4), ((24,), 8), ((4, 0), 4)], ids=str)
def test_fp8_with_row_dim_keeps_the_leading_dims(fmt, shape, row_dim):
    """A row_dim set (configured, or a context's as padded_size sets it for the all-to-all):
    rows of row_dim along the last dimension, the wire [..., D / row_dim x (row_dim + 4)], the
    input's shape back; the flattened tensor (as TorchRec's all-to-alls hand it over) gives the
    same bytes in 1-D."""
    from fbgemm_gpu.quantize_comm import QuantizationContext

    x = _fp8_input(shape)
    lead, d = shape[:-1], shape[-1]
    want_wire = quantize_rows_ref(x.reshape(-1, row_dim), fmt)
    want = dequantize_rows_ref(want_wire, row_dim, fmt, torch.float32)
    entry = qcomm_codecs_registry(fmt, fmt, row_dim=row_dim,
                                  comm_ops=[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL])[A2A]
    for codec, ctx in ((RecxlaQuantizedCommCodec(fmt, row_dim, auto_row_dim=False), None),
                       (entry.forward, entry.forward.create_context()),
                       (RecxlaQuantizedCommCodec(fmt), QuantizationContext(row_dim))):
        wire = codec.encode(x, ctx)
        assert wire.shape == (*lead, d // row_dim * (row_dim + 4))
        assert torch.equal(wire.reshape(-1, row_dim + 4), want_wire)
        out = codec.decode(wire, ctx)
        assert out.shape == shape and torch.equal(out.reshape(-1, row_dim), want)
        flat = codec.encode(x.reshape(-1), ctx)
        assert torch.equal(flat, wire.reshape(-1))
        assert flat.numel() == codec.calc_quantized_size(x.numel(), ctx)
        assert torch.equal(codec.decode(flat, ctx), out.reshape(-1))


def test_the_sequence_all_to_all_gets_a_row_dim_it_can_split_by():
    """TorchRec's sequence all-to-all calls no padded_size: with no row_dim named its codecs
    use 32, as before; the pooled entry leaves the row unset until padded_size sets it."""
    reg = qcomm_codecs_registry("e4m3", "e5m2")
    seq = reg[CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL.name]
    assert seq.forward.create_context().row_dim == 32 == seq.backward.create_context().row_dim
    assert seq.forward.calc_quantized_size(64, seq.forward.create_context()) == 2 * 36
    assert qcomm_codecs_registry("e4m3", "e5m2", row_dim=16)[
        CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL.name].forward.create_context().row_dim == 16
    assert reg[A2A].forward.create_context().row_dim == -1


def test_sequence_backward_picks_a_row_that_divides_the_gradients_dim():
    """TorchRec's sequence backward encodes the gradient [ids, dim]: with the default row of
    32 and a dim of 48, each row of it becomes 2 FP8 rows of 24 (not an error telling the
    user to flatten a tensor TorchRec passes), and calc_quantized_size agrees with the wire."""
    seq = qcomm_codecs_registry("e4m3", "e5m2")[CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL.name]
    grad = torch.randn(7, 48)
    ctx = seq.backward.create_context()
    wire = seq.backward.encode(grad, ctx)
    assert ctx.row_dim == 24 and wire.shape == (7, 2 * (24 + 4))
    assert seq.backward.calc_quantized_size(5 * 48, ctx) == 5 * 2 * 28
    back = seq.backward.decode(wire.reshape(-1), ctx).view(7, 48)
    assert float((back - grad).abs().max()) <= 0.25 * float(grad.abs().max())


def test_sequence_forward_names_the_dim_its_row_must_divide():
    """Its forward encodes a flat tensor and cannot see the dim: a split of ids x 48 values
    that rows of 32 do not cut raises, saying what to pass."""
    seq = qcomm_codecs_registry("e4m3", "e5m2")[CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL.name]
    ctx = seq.forward.create_context()
    seq.forward.encode(torch.randn(4 * 48), ctx)
    with pytest.raises(ValueError, match="sequence all-to-all gives the codec no embedding dim.*"
                                         r"row_dim=\.\.\."):
        seq.forward.calc_quantized_size(48, ctx)


def _sequence_body(rank, world, seed):
    """TorchRec's own EC sharder on recxla's registry (row_dim=16), dim 48, FP8 both ways ->
    (first step's largest relative error against the unsharded module, steps run)."""
    import torch.distributed as dist
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_modules import EmbeddingCollection

    import sequence_cases
    import sharded_cases

    torch.manual_seed(seed)
    configs = sequence_cases.tables(dim=48)
    module = EmbeddingCollection(configs)
    reference = EmbeddingCollection(configs)
    reference.load_state_dict(module.state_dict())
    sharder = EmbeddingCollectionSharder(
        fused_params={"learning_rate": 0.1},
        qcomm_codecs_registry=qcomm_codecs_registry("e4m3", "e5m2", row_dim=16))
    sharded = sharder.shard(module, sequence_cases.plan(configs, "table_wise", world),
                            ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed + 1)
    errors = []
    for _ in range(2):
        batch = sequence_cases.batch(configs, 8, generator, max_len=6)
        mine = sharded_cases.sample_slice(batch, 4 * rank, 4 * rank + 4)
        out, want = sharded(mine).wait(), reference(mine)
        errors.append(max(sharded_cases.relative(out[k].values().detach(),
                                                 want[k].values().detach()) for k in want))
        sum(j.values().sum() for j in out.values()).backward()
    return errors[0], len(errors)


@pytest.mark.distributed
def test_torchrecs_ec_sharder_runs_fp8_on_recxla_codecs_at_dim_48(seed):
    for rank, (error, steps) in enumerate(run_distributed(_sequence_body, world_size=2,
                                                          args=(seed,))):
        assert steps == 2 and 0 < error <= 0.07, (rank, error)


def _reduce_scatter_body(rank, world, seed):
    from torchrec.distributed import comm_ops
    from torchrec.distributed.fbgemm_qcomm_codec import (
        CommType, QCommsConfig, get_qcomm_codecs_registry)

    op = CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.name
    torch.manual_seed(seed + rank)
    x = torch.randn(6, 8)
    out = {}
    for name, reg in (
        ("fbgemm", get_qcomm_codecs_registry(QCommsConfig(
            forward_precision=CommType.FP16, backward_precision=CommType.BF16))),
        ("recxla", qcomm_codecs_registry("fp16", "bf16")),
    ):
        codecs = reg[op]
        out[name] = [comm_ops.reduce_scatter_base_pooled(x, codecs=codecs).wait().tolist(),
                     comm_ops.reduce_scatter_v_pooled(x, [2, 4], codecs=codecs).wait().tolist()]
    return out


@pytest.mark.distributed
def test_torchrecs_reduce_scatters_run_on_recxla_codecs(seed):
    """TorchRec's row-wise output dist (even and uneven splits) with recxla's casts gives what it
    gives with FBGEMM's; with 1-D codec outputs it failed reading `.size(1)`."""
    for result in run_distributed(_reduce_scatter_body, 2, args=(seed,), timeout=180):
        assert result["recxla"] == result["fbgemm"]
