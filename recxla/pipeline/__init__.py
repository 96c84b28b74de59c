"""recxla.pipeline: overlap of the embedding all-to-alls with dense compute, synchronously.

- `TrainPipeline`: frozen-window micro-batch pipelining (FWP) inside a batch and
  staleness-free double buffering (DBP) across batches, with TorchRec's `progress(iterator)`
  interface, for models sharded with `recxla.torchrec.EmbeddingBagCollectionSharder`. Every step
  equals the sequential step up to float rounding (train_pipeline.py says why). The user's
  loop is TorchRec's: epochs, eval mode, detach/attach, any batch type (docs/pipeline.md).
- `Timeline` / `write_chrome_trace`: what ran when, as a Chrome trace.
- `split_batch`: the micro-batches of a batch (contiguous or clustered).
"""

from recxla.pipeline.micro_batches import MicroBatches, split_batch
from recxla.pipeline.timeline import Timeline, write_chrome_trace
from recxla.pipeline.train_pipeline import TrainPipeline

__all__ = ["MicroBatches", "Timeline", "TrainPipeline", "split_batch", "write_chrome_trace"]
