"""The values the pipeline's options take, in a module that imports nothing: the pipeline checks
its arguments against them, and recxla.train declares its options (--split, --dbp-lookup,
--dense-allreduce, --ddp-bucket-merge) with them, without importing the pipeline or TorchRec.
"""

# TrainPipeline(split=...): micro-batches as loaded, or ordered by recxla.cluster_samples
# (recxla.pipeline.micro_batches).
SPLITS = ("contiguous", "clustered")
# TrainPipeline(dbp_lookup=...): the next batch's lookup after this batch's update, or before
# it, corrected after (recxla.torchrec.early_lookup).
DBP_LOOKUPS = ("after_update", "early")
# TrainPipeline(dense_allreduce=...): the dense gradients' wire format
# (recxla.pipeline.dense_sync).
DENSE_ALLREDUCE_FORMATS = ("fp32", "bf16", "fp8", "powersgd")
# DenseAllReduce(bucket_merge=...): a step's DDP buckets sent one by one ("off"), together
# ("on"), or the faster of the two by measured step time ("auto"; recxla.pipeline.bucket_merge),
# on the wires that send DDP's buckets as they are (the others compress them their own way).
BUCKET_MERGE = ("auto", "on", "off")
BUCKET_MERGE_WIRES = ("fp32", "bf16")
