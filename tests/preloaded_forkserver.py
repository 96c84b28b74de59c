"""The one multiprocessing forkserver of a test run, with torch, TorchRec and recxla imported.

Both the gloo ranks of tests/distributed_utils.py and the trainer ranks of tests/warm_ranks.py
are forked from it, instead of each rank importing torch, TorchRec and FBGEMM anew: seconds of
CPU per rank on a 2-core machine, more than most tests' own work.

There is one forkserver per process, whatever context asks for it: the first `start()` fixes its
preload list and a later `set_forkserver_preload` changes nothing. So the list lives here, once,
and holds what either kind of rank imports.

The server has run no op, so it holds no thread pool that a fork could break; each rank still
starts from a clean process (no state of the test's own process is inherited, unlike a plain
fork). An environment variable that these imports read is read once, when the server starts.
"""

import multiprocessing
import sys
from typing import List

# Installed modules only: Python 3.11's forkserver imports them without the tests' sys.path.
PRELOAD = ["torch", "torch.distributed", "fbgemm_gpu", "torchrec", "torchmetrics.classification",
           "recxla", "recxla.torchrec", "recxla.pipeline", "recxla.train.checkpoint",
           "recxla.train.cli", "recxla.train.comm_meter", "recxla.train.data",
           "recxla.train.loop", "recxla.train.metrics", "recxla.train.models",
           "recxla.train.sharding"]
_context = None


def context():
    """The forkserver context, its server started and checked to hold every PRELOAD module."""
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        # The forkserver skips a preload module it cannot import without a word (and one started
        # earlier keeps its own list): every rank would then import the module again. Say so
        # instead of running the suite slowly.
        receive, send = ctx.Pipe(duplex=False)
        probe = ctx.Process(target=_not_imported, args=(PRELOAD, send))
        probe.start()
        send.close()
        missing = receive.recv()
        probe.join()
        if missing:
            raise RuntimeError(f"tests/preloaded_forkserver.py: the forkserver has not imported "
                               f"{missing}")
        _context = ctx
    return _context


def _not_imported(names: List[str], send) -> None:
    send.send([name for name in names if name not in sys.modules])
