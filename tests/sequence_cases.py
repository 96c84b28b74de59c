"""Shared helpers of the sequence-embedding tests: tables, plans TorchRec's EC sharder also runs,
jagged batches with empty, repeated and long sequences, and the unsharded reference step.
Imported by the ranks that tests/distributed_utils.py spawns."""

from typing import Dict, List, Sequence

import torch
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

import sharded_cases

LR = 0.1


def tables(dim: int = 16) -> List[EmbeddingConfig]:
    """Three tables of one dim (an EmbeddingCollection's rule), a feature two tables read (f1:
    f1@t0 and f1@t2 in the output)."""
    return [
        EmbeddingConfig(name="t0", embedding_dim=dim, num_embeddings=53,
                        feature_names=["f0", "f1"]),
        EmbeddingConfig(name="t1", embedding_dim=dim, num_embeddings=31, feature_names=["f2"]),
        EmbeddingConfig(name="t2", embedding_dim=dim, num_embeddings=70,
                        feature_names=["f3", "f1"]),
    ]


def plan(configs: Sequence[EmbeddingConfig], kind: str, world: int, even: bool = False):
    """sharded_cases.plan, with `even` column blocks (two halves on ranks 0 and 1, the only
    column-wise layout TorchRec's EC sharder runs: one partition for all its tables)."""
    if not (even and kind in ("column_wise", "mixed")):
        return sharded_cases.plan(configs, kind, world)
    out = {}
    for t, c in enumerate(configs):
        k = kind if kind != "mixed" else ("table_wise", "row_wise", "column_wise")[t % 3]
        if k != "column_wise":
            out[c.name] = sharded_cases.plan([c], k, world)[c.name]
            continue
        half = c.embedding_dim // 2
        out[c.name] = sharded_cases._spec(k, [(0, c.num_embeddings, 0, half, 0),
                                              (0, c.num_embeddings, half, half, 1 % world)])
    return out


def batch(configs, size: int, generator: torch.Generator, max_len: int = 12) -> KeyedJaggedTensor:
    """`size` samples of every feature: Zipf ids (rows repeat within and across sequences),
    lengths 0 .. max_len (empty sequences included), and one sequence of 3 x max_len."""
    kjt = sharded_cases.global_batch(configs, size, generator, max_len=max_len, zipf_rows=True)
    if size == 0:
        return kjt
    keys = kjt.keys()
    lengths = kjt.lengths().view(len(keys), size).clone()
    per_key = list(kjt.values().split(lengths.sum(1).tolist()))
    rows = min(c.num_embeddings for c in configs if keys[0] in c.feature_names)
    long = (torch.rand(3 * max_len, generator=generator) ** 3 * rows).long()
    first = int(lengths[0, 0])
    per_key[0] = torch.cat([long, per_key[0][first:]])
    lengths[0, 0] = long.numel()
    return KeyedJaggedTensor(keys=keys, values=torch.cat(per_key), lengths=lengths.flatten())


def samples_of(jagged: JaggedTensor, start: int, stop: int) -> torch.Tensor:
    """The values of samples [start, stop) of a JaggedTensor."""
    offsets = jagged.offsets()
    return jagged.values()[int(offsets[start]): int(offsets[stop])]


def coefficients(reference: Dict[str, JaggedTensor], generator) -> Dict[str, torch.Tensor]:
    """A random coefficient per value of the whole batch's output: the loss is their dot."""
    return {k: torch.randn(j.values().shape, generator=generator) for k, j in reference.items()}


def loss(output: Dict[str, JaggedTensor], coef: Dict[str, torch.Tensor], start: int,
         stop: int, full: Dict[str, JaggedTensor]) -> torch.Tensor:
    """sum over keys of output values . coef (samples [start, stop) of the batch `full`)."""
    total = torch.zeros(())
    for key, jagged in output.items():
        offsets = full[key].offsets()
        total = total + (jagged.values() * coef[key][int(offsets[start]): int(offsets[stop])]).sum()
    return total


def sgd_step(reference: torch.nn.Module, world: int) -> None:
    """The unsharded reference's step with the sharded module's gradient scaling."""
    with torch.no_grad():
        for p in reference.parameters():
            if p.grad is not None:
                p -= LR * sharded_cases.gradient_factor(world) * p.grad
                p.grad = None
