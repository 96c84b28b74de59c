"""Fault injection for tests: a rank kills itself with SIGKILL (as `kill -9` would) at a named
point of training, so that a test can stop a run exactly where it wants and check what
`--resume` makes of what is left on disk.

This is the trainer's only fault-injection hook. It does nothing unless the environment variable
RECXLA_TRAIN_KILL_AT is set; never set it outside tests.

    RECXLA_TRAIN_KILL_AT="<point>"          every rank that reaches <point> kills itself there
    RECXLA_TRAIN_KILL_AT="<point>@<rank>"   only rank <rank> does
    several, separated by ";"

The points (N: steps done):
    "step N"                  after step N and the checkpoint that follows it, if any
    "checkpoint N writing"    inside the checkpoint's write: this rank's data files are written,
                              DCP's metadata and the other ranks' files may not be
    "checkpoint N written"    every rank's files and DCP's metadata are written, no marker yet
    "checkpoint N marked"     rank 0 only: the marker is in the temporary folder, not yet renamed
    "checkpoint N committed"  the checkpoint is complete (renamed) and every rank knows it
"""

import os
import signal
import sys

KILL_AT_ENV = "RECXLA_TRAIN_KILL_AT"


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def kill_point(point: str) -> None:
    """SIGKILL this process if RECXLA_TRAIN_KILL_AT names `point` for this rank (see above)."""
    spec = os.environ.get(KILL_AT_ENV)
    if not spec:
        return
    for item in spec.split(";"):
        name, _, rank = item.strip().partition("@")
        if name.strip() == point and (not rank.strip() or int(rank) == _rank()):
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
