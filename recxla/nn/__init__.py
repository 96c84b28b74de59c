"""recxla.nn: TorchRec-compatible modules built on recxla's kernels.

- EmbeddingBagCollection: TorchRec's EmbeddingBagCollection (same tables, outputs and
  state_dict) with deduplicated lookups and a fused sparse optimizer (SGD, Adagrad, row-wise
  Adagrad) applied in backward.
- workspace.Workspace: buffers that training steps hand to one another, so that a steady-state
  step allocates no new large blocks on CPU (the module uses one; a caller of
  recxla.ops.embedding_bag.FusedPooledLookup can pass one in its LookupPlan).

The module is imported on first use, so `import recxla` does not import TorchRec.
"""

__all__ = ["EmbeddingBagCollection"]


def __getattr__(name):
    if name == "EmbeddingBagCollection":
        from recxla.nn.embedding_bag_collection import EmbeddingBagCollection

        return EmbeddingBagCollection
    raise AttributeError(f"module 'recxla.nn' has no attribute {name!r}")
