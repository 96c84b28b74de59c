"""recxla.pipeline: overlap of the embedding all-to-alls with dense compute, synchronously.

- `TrainPipeline`: frozen-window micro-batch pipelining (FWP) inside a batch and
  staleness-free double buffering (DBP) across batches, with TorchRec's `progress(iterator)`
  interface, for models sharded with `recxla.torchrec.EmbeddingBagCollectionSharder`. Every step
  equals the sequential step up to float rounding (train_pipeline.py says why). The user's
  loop is TorchRec's: epochs, eval mode, detach/attach, any batch type (docs/pipeline.md).
- `DenseAllReduce`: how the pipeline all-reduces the dense gradients (wire, node layout,
  PowerSGD's options), one value.
- `Timeline` / `write_chrome_trace`: what ran when, as a Chrome trace.
- `split_batch`: the micro-batches of a batch (contiguous or clustered).
- `recxla.pipeline.choices`: the values of the pipeline's options (split, dbp_lookup,
  dense_allreduce), importable without TorchRec.

Importing this package does not import torchrec; the names load it on first use.
"""

_LAZY = {
    "DenseAllReduce": "recxla.pipeline.dense_sync",
    "MicroBatches": "recxla.pipeline.micro_batches",
    "split_batch": "recxla.pipeline.micro_batches",
    "Timeline": "recxla.pipeline.timeline",
    "write_chrome_trace": "recxla.pipeline.timeline",
    "TrainPipeline": "recxla.pipeline.train_pipeline",
}

__all__ = ["DenseAllReduce", "MicroBatches", "Timeline", "TrainPipeline", "split_batch",
           "write_chrome_trace"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'recxla.pipeline' has no attribute {name!r}")
