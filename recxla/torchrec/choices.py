"""The values of ReplicaSync's options (recxla.torchrec.replicas), in a module that imports
nothing: recxla.train declares --replica-sync and --replica-precision with them without
importing TorchRec.
"""

# ReplicaSync(sync=...): the replicas sum their gradients every step (exact), or average their
# weights every sync_every steps.
REPLICA_SYNCS = ("gradients", "weights")
# ReplicaSync(precision=...): the wire format of the gradients' all-reduce across the replicas.
REPLICA_PRECISIONS = ("fp32", "bf16")
