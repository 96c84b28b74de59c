"""recxla's operators, one file per op family (fp8_rows, dedup, route_ids, id_blocks,
embedding_bag*, copy_runs, cluster*): torch.library registrations (fake kernels, autograd),
the public functions that validate arguments and dispatch to the CPU, CUDA or Triton kernels
(without the compiled extension they raise a RuntimeError naming the op), and the ops'
contracts (enums, result types, constants). recxla.reference, the tests' oracle, may import
those contracts (and the clustering steps of recxla.ops.cluster_steps) but is never imported
from here."""
