"""What the pipeline reads from a batch, for any batch type TorchRec's pipelines move.

TorchRec's pipelines take any batch that moves itself (`.to(device, non_blocking)`,
`record_stream`: TorchRec's `Pipelineable`), e.g. `torchrec.datasets.utils.Batch`, the test
harness's `ModelInput` (float_features, idlist_features, idscore_features, label) or
`recxla.data.Batch`. They find each sharded module's KeyedJaggedTensor by FX-tracing the model
(the argument path, such as `batch.idlist_features`). recxla's pipeline calls the sharded
modules itself and does not trace: it reads the batch's top-level fields instead (dataclass
fields, NamedTuple fields, dict items, or an object's attributes) and gives each sharded module
the one KeyedJaggedTensor field that holds every feature the module reads (`module_features`).

Micro-batches cut every field along the samples: KeyedJaggedTensor fields by sample, tensor
fields whose dim 0 is the batch size by row; other fields (None, scalars, metadata) are kept
as they are. A new batch of the same type is built with the fields replaced.
"""

import copy
import dataclasses
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recxla.host_copy import to_device

OWNER = "recxla.pipeline.TrainPipeline"


def batch_fields(batch: Any) -> Dict[str, Any]:
    """{name: value} of the batch's top-level fields. TypeError for a batch without fields."""
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return dict(batch._asdict())
    if isinstance(batch, dict):
        return dict(batch)
    if hasattr(batch, "__dict__"):
        return dict(vars(batch))
    raise TypeError(f"{OWNER}: a batch must be a dataclass, NamedTuple, dict or object whose "
                    f"fields hold its KeyedJaggedTensor(s); got {type(batch).__name__}")


def replace_fields(batch: Any, changes: Dict[str, Any]) -> Any:
    """A batch of the same type with `changes` ({field: new value}) applied; the input is left
    as it was. The new batch is a shallow copy, so __init__ does not run again."""
    if not changes:
        return batch
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return batch._replace(**changes)
    if isinstance(batch, dict):
        return type(batch)({**batch, **changes})
    new = copy.copy(batch)
    for name, value in changes.items():
        object.__setattr__(new, name, value)  # frozen dataclasses too
    return new


def sparse_fields(batch: Any) -> Dict[str, KeyedJaggedTensor]:
    """{name: KeyedJaggedTensor} of the batch, in field order."""
    return {name: value for name, value in batch_fields(batch).items()
            if isinstance(value, KeyedJaggedTensor)}


def batch_size(batch: Any) -> int:
    """The number of samples: the stride of the batch's KeyedJaggedTensor fields (which must
    agree). TypeError when there is none, ValueError when they disagree."""
    sparse = sparse_fields(batch)
    if not sparse:
        raise TypeError(f"{OWNER}: the batch ({type(batch).__name__}) has no KeyedJaggedTensor "
                        f"field (fields: {list(batch_fields(batch))})")
    strides = {name: kjt.stride() for name, kjt in sparse.items()}
    if len(set(strides.values())) > 1:
        raise ValueError(f"{OWNER}: the batch's KeyedJaggedTensor fields have different batch "
                         f"sizes {strides}")
    return next(iter(strides.values()))


def module_features(batch: Any, modules: Sequence[Tuple[str, Any]]) -> List[KeyedJaggedTensor]:
    """Per sharded module ((path in the model, module) pairs), the batch's KeyedJaggedTensor
    field that holds every feature the module reads. ValueError naming the module and the
    fields when none or several do (several: the pipeline cannot tell which one the model
    passes; give the fields distinct keys)."""
    sparse = sparse_fields(batch)
    found = []
    for path, module in modules:
        needed = module.layout.feature_names
        holders = [name for name, kjt in sparse.items() if set(needed) <= set(kjt.keys())]
        if len(holders) == 1:
            found.append(sparse[holders[0]])
            continue
        keys = {name: kjt.keys() for name, kjt in sparse.items()}
        if not holders:
            raise ValueError(f"{OWNER}: no KeyedJaggedTensor field of the batch "
                             f"({type(batch).__name__}) holds all features {needed} of the "
                             f"sharded module '{path}' (fields and keys: {keys})")
        raise ValueError(f"{OWNER}: ambiguous batch: fields {holders} of "
                         f"{type(batch).__name__} all hold the features {needed} of the sharded "
                         f"module '{path}', and the pipeline cannot tell which one the model "
                         "gives it; keep one field per sharded module's features")
    return found


def map_samples(batch: Any, size: int, on_kjt: Callable[[KeyedJaggedTensor], Any],
                on_rows: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The batch with `on_kjt` applied to its KeyedJaggedTensor fields and `on_rows` to its
    tensor fields whose dim 0 is `size` (the samples); other fields unchanged."""
    changes = {}
    for name, value in batch_fields(batch).items():
        if isinstance(value, KeyedJaggedTensor):
            changes[name] = on_kjt(value)
        elif isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == size:
            changes[name] = on_rows(value)
    return replace_fields(batch, changes)


def dense_to(batch: Any, device: torch.device) -> Tuple[Any, List[torch.Tensor]]:
    """(the batch with its tensor fields on `device`, the tensors moved): non-blocking copies,
    from pinned memory to a GPU. The KeyedJaggedTensors stay where they are (the input dist
    reads them there, and the sharded modules never read the model's copy)."""
    device = torch.device(device)

    changes = {name: to_device(value, device) for name, value in batch_fields(batch).items()
               if isinstance(value, torch.Tensor) and value.device != device}
    return replace_fields(batch, changes), list(changes.values())
