"""The next batch's host-to-device copies, on a CUDA stream of their own.

On a GPU the pipeline moves each batch to the device while the previous batch still computes:
its dense features and labels when it is prepared (during the previous batch's first dense
micro-batch), its decoded ids when they are decoded (before the previous batch's update). The
copies go on a copy stream, so they run under the compute stream's kernels instead of between
them. The step that uses a batch makes the compute stream wait for the copies' event (no host
sync) and records the copied tensors' use on the compute stream, so that the caching allocator
never hands their memory to a later copy while a compute kernel may still read it.

On CPU `start` runs the move at once and `wait` returns its result: one code path for both.
"""

from typing import Any, Callable, Generic, List, Optional, Tuple, TypeVar

import torch

T = TypeVar("T")


class InFlight(Generic[T]):
    """Copies issued on a copy stream: `wait()` -> their result, usable on the current stream."""

    def __init__(self, value: T, tensors: List[torch.Tensor],
                 event: Optional["torch.cuda.Event"], device: Optional[torch.device] = None):
        self._value = value
        self._tensors = tensors
        self._event = event
        self._device = device

    def wait(self) -> T:
        """Orders the current stream after the copies (a device-side wait; the host goes on)
        and ties the copied tensors' memory to it. Later calls return the same value."""
        if self._event is not None:
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(self._event)
            for t in self._tensors:
                if t.is_cuda:
                    t.record_stream(stream)
            self._event, self._tensors = None, []
        return self._value


class CopyStream:
    """Issues host-to-device moves on a stream of their own for a CUDA `device`; on any other
    device the moves run as they are."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def start(self, move: Callable[[], Tuple[T, List[torch.Tensor]]]) -> InFlight[T]:
        """Runs `move` (-> its result and the device tensors it made, e.g. by
        `.to(device, non_blocking=True)` from pinned memory) with the copy stream current."""
        if self.stream is None:
            value, _ = move()
            return InFlight(value, [], None)
        with torch.cuda.stream(self.stream):
            value, tensors = move()
            event = torch.cuda.Event()
            event.record(self.stream)
        return InFlight(value, list(tensors), event, self.device)


def moved(value: Any) -> Tuple[Any, List[torch.Tensor]]:
    """(value, its tensors) for a value whose tensors are its fields (a LookupInput, via its
    `tensors()`), or a plain tensor."""
    if isinstance(value, torch.Tensor):
        return value, [value]
    return value, list(value.tensors())
