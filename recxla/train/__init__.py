"""recxla.train: the TorchRec-based trainer (`python -m recxla.train`, `recxla-train`).

It trains TorchRec's DLRM or DLRM_DCN across ranks with recxla's sharded path, or with plain
TorchRec (`--baseline torchrec`) on the same model, data and plan, and measures both the same
way. One idea per module:

- cli: the entry point and the order of a run; stages: each stage of it (plan and shard,
  resume, pipeline, the loop with its checkpoints, the summary);
- config: the options (TrainConfig), each declared once (options: how a declaration becomes
  the parser, the checks and the values); parse: a command line to a checked TrainConfig,
  before anything runs (the options, then the files and folders they name);
- rendezvous: this rank's place, the store and the process group; watchdog: every rank exits
  when one dies or hangs, naming it;
- data: this rank's batches (synthetic, or a Parquet dataset with its own tables and held-out
  split); models: TorchRec's models, seeded tables;
- sharding: the sharder (recxla's or TorchRec's), the plan, DMP and optimizers;
- loop: the training pipelines (TorchRec's, metered, or recxla's), step by step, measured;
- comm_meter: bytes and time of every collective; memory: freed memory kept, page faults;
- metrics: the summary and its JSON; checkpoint: DCP checkpoints; compare: runs side by side.

Importing this package imports neither torch.distributed nor TorchRec.
"""
