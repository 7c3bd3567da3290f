"""Bytes each collective and point-to-point op moves on this rank, counted from torch.profiler's trace of a block.

    with CommCounter() as counter:
        step()
    counter.bytes  # {"all_gather": 1216, "reduce_scatter": 608}
    counter.calls  # {"all_gather": 4, "reduce_scatter": 2}

The profiler sees every op, whoever issues it: Python calls, DDP's C++ reducer, FSDP2, DTensor's functional
collectives and the P2P ops of pipelining all go through one dispatcher op `c10d::<op>`, so nothing needs patching.
What its chrome trace holds (torch 2.13, recorded with shapes):
- the `c10d::<op>` event's Input Dims give each tensor argument's shape (a list of shapes for a Tensor[] argument,
  nothing for a Tensor[][] one), but its Input type for a Tensor[] argument is only 'TensorList';
- the backend records its own event (`gloo:<op>`, on gloo's worker thread except for send / recv; `nccl:<op>` on
  NCCL) whose Input Dims and Input type are those of the tensors it is handed, which is where a Tensor[] argument's
  dtype is read;
- `_c10d_functional::<op>` events wrap a `c10d::` op, so only the `c10d::` events are counted;
- gloo runs reduce_scatter as an all_reduce of the whole input, so ops are named after the `c10d::` op.

Sizes follow nccl-tests (the whole buffer, as comm_bench reports them): all_reduce and broadcast, the tensor;
all_gather, the gathered output; reduce_scatter, the unreduced input; all_to_all, the send buffer; send and recv,
what this rank sends and receives. Coalesced variants count as their base op, one call each. The list forms of
all_gather and reduce_scatter (dist.all_gather, dist.reduce_scatter, all_gather_object) show only this rank's share,
which is multiplied by the default group's size: they are exact on the default group only (DDP, FSDP2, DTensor and
pipelining do not use them). An op not listed here is counted under "other:<op>" as the tensors its event shows.
"""

from __future__ import annotations

import bisect
import json
import os
import tempfile
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

# The profiler's names of dtypes (the C++ type's demangled name) -> bytes per element.
_ELEMENT_BYTES = {
    name: dtype.itemsize
    for name, dtype in {
        "float": torch.float32,
        "double": torch.float64,
        "c10::Half": torch.float16,
        "c10::BFloat16": torch.bfloat16,
        "c10::Float8_e4m3fn": torch.float8_e4m3fn,
        "c10::Float8_e5m2": torch.float8_e5m2,
        "c10::Float8_e4m3fnuz": torch.float8_e4m3fnuz,
        "c10::Float8_e5m2fnuz": torch.float8_e5m2fnuz,
        "c10::Float8_e8m0fnu": torch.float8_e8m0fnu,
        "c10::complex<c10::Half>": torch.complex32,
        "c10::complex<float>": torch.complex64,
        "c10::complex<double>": torch.complex128,
        "bool": torch.bool,
        "signed char": torch.int8,
        "short int": torch.int16,
        "int": torch.int32,
        "long int": torch.int64,
        "unsigned char": torch.uint8,
        "short unsigned int": torch.uint16,
        "unsigned int": torch.uint32,
        "long unsigned int": torch.uint64,
    }.items()
}
_TENSOR_LIST = "TensorList"

# c10d op -> (counted as, the argument holding the counted buffer, whether that argument is only this rank's share
# of a buffer the group's size times larger).
_OPS: dict[str, tuple[str, int, bool]] = {
    "allreduce_": ("all_reduce", 0, False),
    "allreduce_coalesced_": ("all_reduce", 0, False),
    "_allgather_base_": ("all_gather", 0, False),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, False),
    "allgather_": ("all_gather", 1, True),
    "allgather_coalesced_": ("all_gather", 1, True),
    "_reduce_scatter_base_": ("reduce_scatter", 1, False),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, False),
    "reduce_scatter_": ("reduce_scatter", 0, True),
    "broadcast_": ("broadcast", 0, False),
    "alltoall_base_": ("all_to_all", 1, False),
    "alltoall_": ("all_to_all", 1, False),
    "send": ("send", 0, False),
    "recv_": ("recv", 0, False),
    "recv_any_source_": ("recv", 0, False),
}
# c10d ops without a payload (check_for_nan moves nothing at all).
_IGNORED = {"barrier", "monitored_barrier_", "check_for_nan"}
_C10D, _BACKENDS = "c10d::", ("gloo:", "nccl:")


class CommCounter:
    """Context manager: `with CommCounter() as counter: ...`; then counter.bytes -> dict[str, int] (op -> bytes)
    and counter.calls -> dict[str, int] (op -> number of calls), holding only the ops the block issued.

    It runs torch.profiler for the block, so it cannot be nested in another profiler session. If the block raises,
    the counts stay empty."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self._profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        self._group_size = 1

    def __enter__(self) -> CommCounter:
        self._group_size = dist.get_world_size() if dist.is_initialized() else 1
        self._profiler.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._profiler.__exit__(exc_type, exc, traceback)
        if exc_type is None:
            with tempfile.TemporaryDirectory() as directory:
                path = os.path.join(directory, "trace.json")
                self._profiler.export_chrome_trace(path)
                with open(path) as f:
                    events = json.load(f)["traceEvents"]
            self._count(events)

    def _count(self, events: list[dict[str, Any]]) -> None:
        complete = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])
        backend = [e for e in complete if e["name"].startswith(_BACKENDS) and e.get("args", {}).get("Input Dims")]
        claims = _Claims(backend)
        for event in complete:
            if not event["name"].startswith(_C10D):
                continue
            op = event["name"].removeprefix(_C10D)
            if op in _IGNORED:
                continue
            dims, kinds = event["args"]["Input Dims"], event["args"]["Input type"]
            shown = [t for d, k in zip(dims, kinds) if k == _TENSOR_LIST or k in _ELEMENT_BYTES for t in _tensors(d, k)]
            dtype = claims.dtype(event, [shape for shape, _ in shown])
            key, index, share = _OPS.get(op, (f"other:{op}", -1, False))
            counted = _tensors(dims[index], kinds[index]) if index >= 0 else shown
            total = sum(_numel(shape) * _element_bytes(kind or dtype, event) for shape, kind in counted)
            self.bytes[key] = self.bytes.get(key, 0) + total * (self._group_size if share else 1)
            self.calls[key] = self.calls.get(key, 0) + 1


class _Claims:
    """Pairs each c10d op with the backend's own event of it, which records the dtype of a Tensor[] argument: the
    first event not yet claimed that starts no earlier than the op and whose first tensor has one of the op's
    shapes. gloo's worker threads take work in the order it was issued, so claiming in time order finds each op's
    own event; every op claims one, also when its own event names the dtype, lest a later op take it."""

    def __init__(self, backend: list[dict[str, Any]]) -> None:
        self._events = backend
        self._starts = [e["ts"] for e in backend]
        self._claimed = [False] * len(backend)

    def dtype(self, event: dict[str, Any], shapes: list[list[int]]) -> str | None:
        for i in range(bisect.bisect_left(self._starts, event["ts"]), len(self._events)):
            args = self._events[i]["args"]
            if not self._claimed[i] and args["Input Dims"][0] in shapes:
                self._claimed[i] = True
                return args["Input type"][0]
        return None


def _tensors(dims: list, kind: str) -> list[tuple[list[int], str | None]]:
    """The (shape, dtype name) of each tensor of a Tensor or Tensor[] argument: the dtype is None for a Tensor[],
    whose dtype the event does not record."""
    if kind == _TENSOR_LIST:
        return [(shape, None) for shape in dims]
    return [(dims, kind)]


def _element_bytes(kind: str | None, event: dict[str, Any]) -> int:
    if kind is None:
        raise RuntimeError(
            f"{event['name']} at {event['ts']} us: no gloo:/nccl: event records the dtype of its tensors, "
            "so its bytes are unknown"
        )
    if kind not in _ELEMENT_BYTES:
        raise RuntimeError(f"{event['name']} at {event['ts']} us: unknown dtype {kind!r} in the profiler's trace")
    return _ELEMENT_BYTES[kind]


def _numel(shape: list[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n
