"""Argument checks of the cluster family's public functions (recxla.ops.cluster), with messages
that name the op, the argument and the limit. The C++ kernels check the lengths in their first
pass; the torch paths run `check_lengths` first (torch would raise bare errors or read the wrong
keys). The tests' oracle (recxla.reference.cluster.cluster_samples_ref) runs the same checks, so
that both raise alike."""

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # torchrec is imported on first use: `import recxla` stays light
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

_ID_DTYPES = (torch.int32, torch.int64)


def check_kjt(kjt, op: str) -> "KeyedJaggedTensor":
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if not isinstance(kjt, KeyedJaggedTensor):
        raise ValueError(
            f"{op}: kjt must be a torchrec KeyedJaggedTensor, got {type(kjt).__name__}"
        )
    if kjt.variable_stride_per_key():
        raise ValueError(f"{op}: kjt must have one batch size for every key (no variable stride)")
    return kjt


def check_num_micro_batches(num_micro_batches, batch_size: int, op: str) -> int:
    if not isinstance(num_micro_batches, int) or isinstance(num_micro_batches, bool):
        raise ValueError(
            f"{op}: num_micro_batches must be an int, got {type(num_micro_batches).__name__}"
        )
    if not 1 <= num_micro_batches <= batch_size:
        raise ValueError(
            f"{op}: num_micro_batches must be in [1, batch size {batch_size}], "
            f"got {num_micro_batches}"
        )
    return num_micro_batches


def check_id_dtypes(kjt: "KeyedJaggedTensor", op: str) -> None:
    """Ids and lengths must be integers: a float id would be truncated into another key."""
    if kjt.values().dtype not in _ID_DTYPES:
        raise TypeError(f"{op}: kjt.values() must be int32 or int64 ids, got {kjt.values().dtype}")
    if kjt.lengths().dtype not in _ID_DTYPES:
        raise TypeError(f"{op}: kjt.lengths() must be int32 or int64, got {kjt.lengths().dtype}")


_INT64_MAX = 2**63 - 1


def _bag_name(kjt: "KeyedJaggedTensor", index: int) -> str:
    batch = kjt.stride()
    return f"at index {index} (feature {kjt.keys()[index // batch]!r}, sample {index % batch})"


def check_lengths(kjt: "KeyedJaggedTensor", op: str) -> None:
    """Lengths that are integers >= 0 and stay within kjt.values(): the checks the C++ kernel
    makes in its first pass, for the paths that run torch ops (which would raise bare errors
    or read the wrong keys). O(F * B), two host syncs (the bounds, the sum).

    The sum is exact: an int64 sum of lengths near 2**62 wraps to a negative total that passes
    a plain `sum > numel` test (torch then fails on negative repeats, or reads the wrong keys).
    So each length is first bounded by the values' count, and the sum is then taken over chunks
    short enough that no chunk's int64 sum can wrap, adding the chunks in Python ints."""
    lengths, num_values = kjt.lengths(), kjt.values().numel()
    if lengths.dtype not in _ID_DTYPES:
        raise TypeError(f"{op}: kjt.lengths() must be int32 or int64, got {lengths.dtype}")
    if lengths.numel() == 0:
        return
    flat = lengths.reshape(-1)
    low, high = torch.stack(torch.aminmax(flat)).tolist()
    if low < 0:
        index = int(torch.nonzero(flat < 0)[0])
        raise ValueError(
            f"{op}: kjt.lengths() must be >= 0, got {int(flat[index])} {_bag_name(kjt, index)}"
        )
    if high > num_values:
        index = int(torch.nonzero(flat > num_values)[0])
        raise ValueError(
            f"{op}: kjt.lengths() overrun kjt.values(): length {int(flat[index])} "
            f"{_bag_name(kjt, index)} exceeds the {num_values} values kjt.values() holds"
        )
    # 0 <= length <= high, so a chunk of _INT64_MAX // high lengths sums without wrapping (one
    # chunk unless the lengths' count times the values' count passes 2**63).
    chunk = _INT64_MAX // max(high, 1)
    parts = flat.split(chunk)
    total = 0
    for i, part in enumerate(parts):
        total += int(part.sum(dtype=torch.int64))
        if total > num_values:
            exact = "" if i == len(parts) - 1 else "at least "
            raise ValueError(
                f"{op}: kjt.lengths() overrun kjt.values(): they sum to {exact}{total}, "
                f"kjt.values() holds {num_values}"
            )


def check_ids(kjt: "KeyedJaggedTensor", op: str) -> None:
    """`check_id_dtypes` and `check_lengths`."""
    check_id_dtypes(kjt, op)
    check_lengths(kjt, op)


def key_bytes_tensor(kjt: "KeyedJaggedTensor", key_bytes, op: str) -> torch.Tensor:
    """Per-feature bytes per key as float64 [F] on CPU.

    key_bytes: None (1 per key), a sequence or 1-D tensor of F numbers in KJT key order, or a
    dict from feature name to bytes covering every key.
    """
    keys = kjt.keys()
    if key_bytes is None:
        return torch.ones(len(keys), dtype=torch.float64)
    if isinstance(key_bytes, dict):
        missing = [k for k in keys if k not in key_bytes]
        if missing:
            raise ValueError(f"{op}: key_bytes has no entry for features {missing}")
        key_bytes = [key_bytes[k] for k in keys]
    try:
        out = torch.as_tensor(key_bytes, dtype=torch.float64).detach().cpu()
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{op}: key_bytes must be numbers, one per feature, got {key_bytes!r}")
    if out.shape != (len(keys),):
        raise ValueError(
            f"{op}: key_bytes must hold one number per feature ({len(keys)}), "
            f"got shape {tuple(out.shape)}"
        )
    if not bool(torch.isfinite(out).all()) or bool((out < 0).any()):
        raise ValueError(f"{op}: key_bytes must be finite and >= 0, got {out.tolist()}")
    return out


def check_permutation(permutation, batch: int, device, op: str) -> torch.Tensor:
    """permutation as an int64 [B] tensor on `device` holding each of range(B) once: O(B) (a
    range check and a presence count, no sort)."""
    if not isinstance(permutation, torch.Tensor) or permutation.dtype != torch.int64:
        got = permutation.dtype if isinstance(permutation, torch.Tensor) else \
            type(permutation).__name__
        raise TypeError(f"{op}: permutation must be an int64 tensor, got {got}")
    if permutation.shape != (batch,):
        raise ValueError(
            f"{op}: permutation must have shape ({batch},), got {tuple(permutation.shape)}"
        )
    permutation = permutation.to(device)
    if batch == 0:
        return permutation
    lo, hi = int(permutation.min()), int(permutation.max())
    if lo < 0 or hi >= batch:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"{op}: permutation entries must lie in [0, {batch}), got {bad}"
        )
    seen = torch.bincount(permutation, minlength=batch)
    if not bool((seen == 1).all()):
        twice = int(torch.nonzero(seen > 1)[0])
        missing = int(torch.nonzero(seen == 0)[0])
        raise ValueError(
            f"{op}: permutation must hold each of range({batch}) once, but {twice} appears "
            f"{int(seen[twice])} times and {missing} is missing"
        )
    return permutation
