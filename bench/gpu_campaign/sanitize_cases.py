"""Small calls of every CUDA kernel recxla has, in every variant, for compute-sanitizer.

    compute-sanitizer --tool memcheck python -m bench.gpu_campaign.sanitize_cases
    compute-sanitizer --tool racecheck python -m bench.gpu_campaign.sanitize_cases
    python -m bench.gpu_campaign.sanitize_cases --device cpu     # the same calls on CPU

Sizes are small (the sanitizers run kernels tens of times slower) but odd: empty inputs, one
row, lengths that are not multiples of a warp, a vector width or a block. Every result is
compared with the reference, so a call that a sanitizer passes also computed the right thing.
Prints "<n> kernel calls" last; exits non-zero at the first wrong result.
"""

import argparse
import itertools
import sys

import torch

from recxla import _extension

CALLS = [0]


def _each_variant(family: str, device: str):
    """Yields each variant name of `family` with it selected (CUDA), or once on CPU."""
    from recxla.ops import gpu_variants

    if device != "cuda":
        yield "cpu"
        return
    for name in gpu_variants.variants(family):
        with gpu_variants.use_variant(family, name):
            yield name


def _counted(fn, *args, **kwargs):
    CALLS[0] += 1
    out = fn(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where NaN (NaN != NaN for torch.equal)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def fp8_rows(device: str) -> None:
    import recxla
    from recxla.reference.fp8_rows import dequantize_rows_ref, quantize_rows_ref

    shapes = ((0, 8), (1, 1), (3, 7), (33, 64), (17, 128), (5, 130), (2, 1024))
    for family in ("fp8_quantize", "fp8_dequantize"):
        for variant in _each_variant(family, device):
            for (rows, dim), dtype, fmt in itertools.product(
                    shapes, (torch.float32, torch.bfloat16, torch.float16), ("e4m3", "e5m2")):
                x = (torch.randn(rows, dim) * 10).to(dtype)
                if rows and dim > 2:
                    x[0, 1], x[-1, -1] = float("nan"), float("inf")
                want = quantize_rows_ref(x, fmt)
                case = f"{variant}: {family} {rows}x{dim} {dtype} {fmt}"
                if family == "fp8_quantize":
                    got = _counted(recxla.quantize_rows, x.to(device), fmt).cpu()
                    if not torch.equal(got, want):
                        raise AssertionError(case)
                else:
                    y = _counted(recxla.dequantize_rows, want.to(device), dim, fmt,
                                 dtype=dtype).cpu()
                    if not _same(y, dequantize_rows_ref(want, dim, fmt, dtype=dtype)):
                        raise AssertionError(case)


def dedup(device: str) -> None:
    import recxla
    from recxla.reference.dedup import segmented_unique_ref

    layouts = ([0], [0, 0], [0, 1], [0, 5, 5, 40], [0, 33, 34, 300, 300, 513])
    for variant in _each_variant("dedup", device):
        for offsets in layouts:
            for dtype in (torch.int32, torch.int64):
                n = offsets[-1]
                values = torch.randint(-50, 50, (n,), dtype=dtype)
                if n > 10:
                    values[3] = torch.iinfo(dtype).max  # a range that packs into no small key
                offs = torch.tensor(offsets, dtype=torch.int64)
                want = segmented_unique_ref(values, offs)
                got = _counted(recxla.unique_keys, values.to(device), offs.to(device))
                for g, w, name in zip(got, want, ("unique_values", "unique_offsets", "inverse")):
                    if not torch.equal(g.cpu(), w):
                        raise AssertionError(f"{variant}: dedup {offsets} {dtype}: {name}")


def cluster(device: str) -> None:
    from torchrec import KeyedJaggedTensor

    import recxla

    batch, features = 96, 5
    for variant in _each_variant("cluster", device):
        lengths = torch.randint(0, 6, (features * batch,))
        lengths[:batch] = 1
        values = torch.randint(0, 40, (int(lengths.sum()),))
        kjt = KeyedJaggedTensor([f"f{i}" for i in range(features)], values, lengths=lengths,
                                stride=batch)
        for m in (2, 4):
            want, _ = recxla.cluster_samples(kjt, m)  # the C++ CPU kernel
            got, _ = _counted(recxla.cluster_samples, kjt.to(torch.device(device)), m)
            if not torch.equal(got.cpu(), want):
                raise AssertionError(f"{variant}: cluster_samples M={m}")


def embedding_bag(device: str) -> None:
    from torchrec import KeyedJaggedTensor
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    from recxla.nn import EmbeddingBagCollection

    dev = torch.device(device)
    # The 3-row table's rows get about 40 ids each: more than the 32 a batched_ids warp reads
    # at once, and not a multiple of the 4 it loads ahead.
    for variant in _each_variant("embedding_update", device):
        for pooling in (PoolingType.SUM, PoolingType.MEAN):
            tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows,
                                         feature_names=[f"f{i}"], pooling=pooling)
                      for i, (rows, dim) in enumerate(((50, 8), (3, 33), (300, 64)))]
            for optimizer, kwargs in ((None, {}), ("sgd", {"lr": 0.1}),
                                      ("rowwise_adagrad", {"lr": 0.1, "eps": 1e-8})):
                module = EmbeddingBagCollection(tables, device=dev, optimizer=optimizer,
                                                **kwargs)
                batch = 30
                lengths = torch.randint(0, 9, (3 * batch,))
                values = torch.cat([torch.randint(0, t.num_embeddings, (int(n),))
                                    for t, n in zip(tables, lengths.view(3, batch).sum(1))])
                kjt = KeyedJaggedTensor(["f0", "f1", "f2"], values, lengths=lengths).to(dev)
                out = _counted(module, kjt).values()
                _counted(out.backward, torch.randn_like(out))
        _placed_embedding_bag(dev)  # the gradient runs the variant's update kernel
        _scattered_update(dev)


def _placed_embedding_bag(dev: torch.device) -> None:
    """The lookup pooled into a column range of a wider tensor, each feature at its own column
    (out of table order, with gaps), and the gradient read where it lies: the output dist's
    receiver path (feature_columns)."""
    from recxla.ops.embedding_bag import SUM, MEAN, BagLookup, pooled_forward, unique_grad
    from recxla.reference.embedding_bag import (embedding_bag_forward_ref,
                                                embedding_bag_unique_grad_ref, place_features_ref)

    batch, rows, dims, feature_table = 30, (50, 3, 300), (8, 33, 64), [2, 0, 1]
    lengths = torch.randint(0, 9, (len(feature_table) * batch,))
    ids = [torch.randint(0, rows[t], (int(n),))
           for t, n in zip(feature_table, lengths.view(-1, batch).sum(1))]
    bounds = [0, *itertools.accumulate(rows)]
    lookup = BagLookup([torch.randn(r, d) for r, d in zip(rows, dims)],
                       torch.cat([torch.arange(r) for r in rows]), torch.tensor(bounds),
                       torch.cat([i + bounds[t] for i, t in zip(ids, feature_table)]),
                       torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
                       None, feature_table, [SUM, MEAN, SUM], batch)
    columns = [45, 1, 10]  # 110 columns: feature 1 at 1, feature 2 at 10, feature 0 at 45
    wide, grad_wide = torch.randn(batch, 115), torch.randn(batch, 115)
    want = wide.clone()
    want[:, 3:113] = place_features_ref(embedding_bag_forward_ref(lookup), lookup,
                                        wide[:, 3:113], columns)
    want_grad = embedding_bag_unique_grad_ref(grad_wide[:, 3:113], lookup, columns)
    on_dev = lookup._replace(weights=[w.to(dev) for w in lookup.weights],
                             **{name: getattr(lookup, name).to(dev) for name in
                                ("unique_values", "unique_offsets", "inverse", "offsets")})
    got = wide.to(dev)
    _counted(pooled_forward, on_dev, got[:, 3:113], columns)
    got_grad = _counted(unique_grad, grad_wide.to(dev)[:, 3:113], on_dev, columns)
    close = dict(rtol=1e-5, atol=1e-5)
    if not torch.allclose(got.cpu(), want, **close) or not all(
            torch.allclose(g.cpu(), w, **close) for g, w in zip(got_grad, want_grad)):
        raise AssertionError("embedding_bag with feature_columns: differs from the reference")


def _scattered_update(dev: torch.device) -> None:
    """The fused update reading each bag's gradient row where a received message holds it
    (grad_offsets: the rows shuffled, with gaps; the empty bags' offsets never read), against the
    reference on the same rows gathered into [B, total_dim]."""
    from recxla.ops.embedding_bag import ROWWISE_ADAGRAD, SUM, BagLookup, backward_update
    from recxla.reference.embedding_bag import embedding_bag_backward_update_ref

    batch, rows, dims, feature_table = 30, (50, 3, 300), (8, 33, 64), [2, 0, 1]
    lengths = torch.randint(0, 9, (len(feature_table) * batch,))
    bounds = [0, *itertools.accumulate(rows)]
    ids = [torch.randint(0, rows[t], (int(n),)) + bounds[t]
           for t, n in zip(feature_table, lengths.view(-1, batch).sum(1))]
    lookup = BagLookup([torch.randn(r, d) for r, d in zip(rows, dims)],
                       torch.cat([torch.arange(r) for r in rows]), torch.tensor(bounds),
                       torch.cat(ids), torch.cat([torch.zeros(1, dtype=torch.int64),
                                                  lengths.cumsum(0)]),
                       None, feature_table, [SUM] * 3, batch)
    bags, slot = len(feature_table) * batch, max(dims) + 5
    grad_offsets = torch.randperm(bags) * slot + torch.randint(0, 5, (bags,))
    flat = torch.randn(bags * slot)
    grad = torch.cat([flat[grad_offsets[f * batch: (f + 1) * batch, None] +
                           torch.arange(dims[t])] for f, t in enumerate(feature_table)], 1)
    grad_offsets[lengths == 0] = -(10**12)  # never read
    states = [torch.rand(r) for r in rows]
    hparams = [0.1, 1e-8, 0.0, 1.0] * 3
    want = lookup._replace(weights=[w.clone() for w in lookup.weights])
    want_states = [s.clone() for s in states]
    embedding_bag_backward_update_ref(grad, want, want_states, [ROWWISE_ADAGRAD] * 3, hparams)
    on_dev = lookup._replace(weights=[w.to(dev) for w in lookup.weights],
                             **{name: getattr(lookup, name).to(dev) for name in
                                ("unique_values", "unique_offsets", "inverse", "offsets")})
    got_states = [s.to(dev) for s in states]
    _counted(backward_update, flat.to(dev), on_dev, got_states, [ROWWISE_ADAGRAD] * 3, hparams,
             grad_offsets.to(dev))
    close = dict(rtol=1e-5, atol=1e-6)
    if not all(torch.allclose(g.cpu(), w, **close) for g, w in
               zip(on_dev.weights + got_states, want.weights + want_states)):
        raise AssertionError("embedding_bag update with grad_offsets: differs from the reference")


def copy_runs(device: str) -> None:
    from recxla.ops.copy_runs import Run, copy_runs as copy, pack
    from recxla.reference.copy_runs import copy_runs_ref

    # Column runs over a [33, 37] target from two sources (one read with stride 0), a second
    # wave of adds into the same columns, an empty run, and a run of one wide row.
    for dtype in (torch.float32, torch.bfloat16):
        sources = [torch.randn(1300).to(dtype), torch.randn(40).to(dtype)]
        runs = pack([Run(0, 5, 37, 0, 0, 37, 33, 20), Run(1, 3, 0, 0, 20, 37, 33, 17),
                     Run(0, 0, 39, 0, 4, 37, 33, 9, 1), Run(1, 0, 1, 0, 6, 37, 33, 3, 1),
                     Run(0, 0, 0, 0, 0, 37, 0, 5), Run(0, 100, 0, 1, 0, 0, 1, 1000)])
        want = [torch.zeros(33, 37, dtype=dtype), torch.zeros(1000, dtype=dtype)]
        copy_runs_ref(sources, want, runs)
        got = [t.to(device) for t in (torch.zeros(33, 37, dtype=dtype),
                                      torch.zeros(1000, dtype=dtype))]
        _counted(copy, [s.to(device) for s in sources], got, runs)
        if not all(torch.equal(g.cpu(), w) for g, w in zip(got, want)):
            raise AssertionError(f"copy_runs {dtype}: differs from the reference")


FAMILIES = {"fp8_rows": fp8_rows, "dedup": dedup, "cluster": cluster,
            "embedding_bag": embedding_bag, "copy_runs": copy_runs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_campaign.sanitize_cases")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--families", default=",".join(FAMILIES))
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if not _extension.HAVE_EXTENSION:
        print("recxla._C is not built", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    for name in args.families.split(","):
        FAMILIES[name](args.device)
        print(f"{name}: done ({CALLS[0]} kernel calls so far)", flush=True)
    print(f"{CALLS[0]} kernel calls", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
