"""Key dedup: the distinct keys of each segment and the inverse index that expands them back.

Recommendation traffic is skewed: a few keys appear in many samples. Looking each key up (and
sending it to its owner) once per segment instead of once per occurrence cuts lookups and
all-to-all bytes. A segment is any group of keys that must stay apart: a table / feature of a
KeyedJaggedTensor, or a (destination rank, table) bucket from `bucketize_by_rank`.

Kernels (`torch.ops.recxla.segmented_unique`): C++ on CPU (a hash table or presence array per
segment, segments spread over threads), CUDA (CUB segmented radix sort, head flags, scan) or
Triton (head flags and scatter around torch's sort) on GPU; without the compiled extension,
a RuntimeError saying to reinstall. All return the same tensors as the tests' plain-PyTorch
oracle, `recxla.reference.dedup.segmented_unique_ref`.
"""

import torch

from recxla import _extension

_KEY_DTYPES = (torch.int32, torch.int64)


@_extension.register_fake("recxla::segmented_unique")
def _segmented_unique_fake(values, offsets):
    # The number of distinct keys is known only from the data.
    unique_count = torch.library.get_ctx().new_dynamic_size()
    return (
        values.new_empty(unique_count),
        offsets.new_empty(offsets.shape[0]),
        values.new_empty(values.shape[0], dtype=torch.int64),
    )


@_extension.register_fake("recxla::segmented_unique_out")
def _segmented_unique_out_fake(values, offsets, unique_values, unique_offsets, inverse):
    return torch.library.get_ctx().new_dynamic_size()


def _check_tensor(op: str, name: str, t, dtypes, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: {name} must be {what}, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{op}: {name} must be 1-D, got {t.dim()}-D shape {tuple(t.shape)}")


def _check_offsets_values(op: str, offsets: torch.Tensor, n: int) -> None:
    """The value checks of the C++ kernels (csrc/include/recxla/dedup.h), for the paths that do
    not run them: the Triton kernels and `bucketize_by_rank`'s torch ops."""
    if int(offsets[0]) != 0:
        raise ValueError(f"{op}: offsets[0] must be 0, got {int(offsets[0])}")
    drops = torch.nonzero(offsets[1:] < offsets[:-1])
    if drops.numel():
        s = int(drops[0])
        raise ValueError(
            f"{op}: offsets must be non-decreasing, but offsets[{s}]={int(offsets[s])} > "
            f"offsets[{s + 1}]={int(offsets[s + 1])}"
        )
    if int(offsets[-1]) != n:
        raise ValueError(f"{op}: offsets[-1] must equal values.numel()={n}, got {int(offsets[-1])}")


def segmented_unique(values: torch.Tensor, offsets: torch.Tensor, *, out=None):
    """Distinct keys per segment, ascending, with the inverse index.

    Args:
        values: int32 or int64 [N], on CPU or CUDA, any stride: the keys of S segments laid one
            after another (segment s is values[offsets[s]:offsets[s + 1]]). Any key is allowed,
            negative ones included; range checks belong to the op that uses the keys.
        offsets: int64 (int32 accepted) [S + 1] on values' device: offsets[0] == 0,
            non-decreasing, offsets[-1] == N. S == 0 (offsets == [0], N == 0) is allowed;
            segments may be empty.
    Returns:
        unique_values: [U], values' dtype: the distinct keys of each segment, ascending within a
            segment, segments in order (equal keys in two segments appear in both).
        unique_offsets: int64 [S + 1]: segment s's uniques are
            unique_values[unique_offsets[s]:unique_offsets[s + 1]].
        inverse: int64 [N]: values[i] == unique_values[inverse[i]], and inverse[i] lies in the
            range of values[i]'s segment.
    Raises:
        TypeError for wrong dtypes, ValueError for wrong shapes or devices and for offsets that
        do not start at 0, decrease or do not end at N (checked before any work).
    """
    op = "recxla.segmented_unique"
    _check_tensor(op, "values", values, _KEY_DTYPES, "int32 or int64")
    _check_tensor(op, "offsets", offsets, _KEY_DTYPES, "int64 (or int32)")
    if offsets.numel() < 1:
        raise ValueError(f"{op}: offsets must have S + 1 >= 1 entries (offsets[0] == 0), got 0")
    if offsets.device != values.device:
        raise ValueError(
            f"{op}: values and offsets must be on one device, got {values.device} and "
            f"{offsets.device}"
        )
    offsets = offsets.to(torch.int64)
    if out is not None:
        _check_out(op, values, out)
    backend = _extension.backend_for(values, op)
    if backend in ("cpu", "cuda"):
        if out is None:
            return torch.ops.recxla.segmented_unique(values, offsets)
        torch.ops.recxla.segmented_unique_out(values, offsets, *out)  # resizes out[0] to U
        return tuple(out)
    _check_offsets_values(op, offsets, values.numel())
    from recxla.triton_kernels.dedup import segmented_unique_triton

    result = segmented_unique_triton(values, offsets)
    if out is None:
        return result
    return tuple(o.resize_(r.shape).copy_(r) for o, r in zip(out, result))


def _check_out(op: str, values: torch.Tensor, out) -> None:
    """The out= tuple of segmented_unique (the C++ op checks the same again)."""
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise TypeError(f"{op}: out must be a tuple (unique_values, unique_offsets, inverse)")
    for name, t, dtype in zip(("unique_values", "unique_offsets", "inverse"), out,
                              (values.dtype, torch.int64, torch.int64)):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype:
            raise TypeError(f"{op}: out {name} must be a {dtype} tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
        if t.device != values.device or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{op}: out {name} must be a contiguous 1-D tensor on "
                             f"{values.device}, got shape {tuple(t.shape)} on {t.device}")


# The public name (recxla.unique_keys).
unique_keys = segmented_unique


def bucketize_by_rank(values: torch.Tensor, offsets: torch.Tensor, block_bounds: torch.Tensor):
    """Groups keys by the rank that owns their row, ready for dedup and the input all-to-all.

    Each table is split into R row blocks: rank r owns rows
    [block_bounds[t, r], block_bounds[t, r + 1]) of table t. Row-wise sharding gives every rank
    a block; table-wise sharding gives the owner all rows and the other ranks empty blocks
    (see `row_wise_bounds` and `table_wise_bounds`). Keys are bucketed by the interior bounds
    only: keys below block_bounds[t, 1] go to rank 0 and keys at or above block_bounds[t, R - 1]
    to rank R - 1, whose lookup then range-checks them.

    Buckets are rank-major, bucket b = r * T + t, so each destination rank's keys are one
    contiguous chunk (the split of all_to_all_single), tables in order inside it. Dedup then runs
    per bucket: `segmented_unique(values[permutation], bucket_offsets)`.

    Args:
        values: int32/int64 [N]: keys of T tables (segment t = values[offsets[t]:offsets[t+1]]).
        offsets: int64 [T + 1], as for `segmented_unique`.
        block_bounds: int64 [T, R + 1], each row non-decreasing, on values' device.
    Returns:
        permutation: int64 [N]: values[permutation] lists the keys bucket by bucket, each bucket
            in its original order (stable).
        bucket_offsets: int64 [R * T + 1]: bucket b is
            values[permutation[bucket_offsets[b]:bucket_offsets[b + 1]]]; rank r's chunk is
            bucket_offsets[r * T] to bucket_offsets[(r + 1) * T].
    """
    op = "recxla.bucketize_by_rank"
    _check_tensor(op, "values", values, _KEY_DTYPES, "int32 or int64")
    _check_tensor(op, "offsets", offsets, _KEY_DTYPES, "int64 (or int32)")
    if not isinstance(block_bounds, torch.Tensor) or block_bounds.dtype not in _KEY_DTYPES:
        raise TypeError(f"{op}: block_bounds must be an int64 tensor [T, R + 1]")
    if offsets.numel() < 1:
        raise ValueError(f"{op}: offsets must have T + 1 >= 1 entries (offsets[0] == 0), got 0")
    tables = offsets.numel() - 1
    if block_bounds.dim() != 2 or block_bounds.shape[0] != tables or block_bounds.shape[1] < 2:
        raise ValueError(
            f"{op}: block_bounds must be [T, R + 1] with T = offsets.numel() - 1 = {tables} and "
            f"R >= 1, got shape {tuple(block_bounds.shape)}"
        )
    if offsets.device != values.device or block_bounds.device != values.device:
        raise ValueError(f"{op}: values, offsets and block_bounds must be on one device")
    if bool((block_bounds[:, 1:] < block_bounds[:, :-1]).any()):
        raise ValueError(f"{op}: each row of block_bounds must be non-decreasing")
    offsets = offsets.to(torch.int64)
    _check_offsets_values(op, offsets, values.numel())
    ranks = block_bounds.shape[1] - 1
    lengths = offsets[1:] - offsets[:-1]
    table_ids = torch.repeat_interleave(
        torch.arange(tables, device=values.device), lengths, output_size=values.numel()
    )
    interior = block_bounds[:, 1:ranks].to(torch.int64).contiguous()
    # Shift each table's keys and bounds into a band of its own so that one searchsorted over
    # all tables' interior bounds finds every key's rank (the bounds are sorted band by band).
    if ranks > 1:
        lo = torch.minimum(values.min(), interior.min()) if values.numel() else interior.min()
        hi = torch.maximum(values.max(), interior.max()) if values.numel() else interior.max()
        width = int(hi) - int(lo) + 1
        if width * tables >= 2**62:
            rank_ids = _rank_ids_per_table(values, offsets, interior)
        else:
            band = torch.arange(tables, device=values.device).unsqueeze(1) * width - int(lo)
            flat = (interior + band).flatten()
            keys = values.to(torch.int64) + table_ids * width - int(lo)
            rank_ids = torch.searchsorted(flat, keys, right=True) - table_ids * (ranks - 1)
    else:
        rank_ids = torch.zeros_like(table_ids)
    bucket_ids = rank_ids * tables + table_ids
    permutation = torch.sort(bucket_ids, stable=True).indices
    counts = torch.bincount(bucket_ids, minlength=ranks * tables)
    bucket_offsets = torch.zeros(ranks * tables + 1, dtype=torch.int64, device=values.device)
    bucket_offsets[1:] = torch.cumsum(counts, 0)
    return permutation, bucket_offsets


def _rank_ids_per_table(values, offsets, interior):
    """One searchsorted per table, for key ranges too wide to band into int64."""
    rank_ids = torch.empty(values.numel(), dtype=torch.int64, device=values.device)
    bounds = offsets.tolist()
    for t in range(interior.shape[0]):
        keys = values[bounds[t] : bounds[t + 1]].to(torch.int64)
        rank_ids[bounds[t] : bounds[t + 1]] = torch.searchsorted(interior[t], keys, right=True)
    return rank_ids


def row_wise_bounds(num_rows, world_size: int) -> torch.Tensor:
    """Block bounds of row-wise sharding: table t's rows split into world_size blocks of
    ceil(num_rows[t] / world_size) rows (the last ones may be short or empty), as TorchRec does.

    num_rows: sequence of T ints. Returns int64 [T, world_size + 1].
    """
    rows = torch.as_tensor(list(num_rows), dtype=torch.int64).reshape(-1, 1)
    block = (rows + world_size - 1) // world_size
    return torch.minimum(block * torch.arange(world_size + 1), rows)


def table_wise_bounds(num_rows, owners, world_size: int) -> torch.Tensor:
    """Block bounds of table-wise sharding: rank owners[t] owns all of table t.

    num_rows, owners: sequences of T ints. Returns int64 [T, world_size + 1].
    """
    rows = torch.as_tensor(list(num_rows), dtype=torch.int64).reshape(-1, 1)
    owner = torch.as_tensor(list(owners), dtype=torch.int64).reshape(-1, 1)
    if owner.numel() and (owner.min() < 0 or owner.max() >= world_size):
        raise ValueError(f"recxla.table_wise_bounds: owners must lie in [0, {world_size})")
    # Ranks after the owner start at num_rows: every key is below them, so all go to the owner.
    return torch.where(torch.arange(world_size + 1) > owner, rows, torch.zeros_like(rows))
