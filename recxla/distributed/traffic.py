"""What the collectives issued inside a block carry, for whoever meters them
(recxla.train.comm_meter): `with carrying("dense"): ...` tags them; `carried()` reads the tag
(None outside any block). A meter cannot tell an FP8 all_to_all of dense gradients
(recxla.distributed.fp8_all_reduce) from one of embeddings by its tensors alone.

The tag is per thread: DDP's comm hooks run on the thread that runs the backward.
"""

import contextlib
import threading
from typing import Iterator, Optional

_LOCAL = threading.local()


@contextlib.contextmanager
def carrying(kind: str) -> Iterator[None]:
    previous = getattr(_LOCAL, "kind", None)
    _LOCAL.kind = kind
    try:
        yield
    finally:
        _LOCAL.kind = previous


def carried() -> Optional[str]:
    return getattr(_LOCAL, "kind", None)
