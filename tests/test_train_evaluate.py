"""The trainer's held-out evaluation (recxla.train.metrics.evaluate) on 2 gloo ranks: AUC and
log loss over every rank's batches, as computed over all of them at once, and a call after
each batch, so that the trainer's watchdog hears an evaluation longer than --timeout move."""

import random

import torch
from distributed_utils import run_distributed
from torchmetrics.functional.classification import binary_auroc


class _Batch:
    def __init__(self, logits, labels):
        self.logits, self.labels = logits, labels

    def to(self, device):
        return self


class _Scores(torch.nn.Module):
    """DLRMTrain's interface: model(batch) -> (loss, (loss, logits, labels))."""

    def forward(self, batch):
        return None, (None, batch.logits, batch.labels)


def _held_out(seed: int, rank: int, batches: int):
    g = torch.Generator().manual_seed(seed * 10 + rank)
    out = []
    for _ in range(batches):
        labels = (torch.rand(16, generator=g) < 0.4).float()
        out.append(_Batch(torch.randn(16, generator=g) + labels, labels))
    return out


def _evaluate(rank, world_size, seed, batches):
    from recxla.train.metrics import evaluate

    seen = []
    got = evaluate(_Scores(), _held_out(seed, rank, batches[rank]), torch.device("cpu"),
                   seen.append)
    return got, seen


def test_evaluation_combines_the_ranks_and_reports_each_batch():
    seed, batches = random.randint(0, 999), [random.randint(2, 6), random.randint(2, 6)]
    results = run_distributed(_evaluate, world_size=2, args=(seed, batches))
    every = [b for rank in range(2) for b in _held_out(seed, rank, batches[rank])]
    logits = torch.cat([b.logits for b in every])
    labels = torch.cat([b.labels for b in every])
    want_loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.double(),
                                                                     labels.double())
    for rank, (got, seen) in enumerate(results):
        assert seen == list(range(batches[rank]))
        assert got["eval_examples"] == len(labels)
        assert abs(got["auc"] - float(binary_auroc(logits, labels.long()))) < 1e-6
        assert abs(got["eval_loss"] - float(want_loss)) < 1e-6  # float32 terms, summed in float64
