"""`parallel.pp_schedule` name -> how the micro-batches flow, and what each schedule needs.

gpipe             all m forwards, then all m backwards: bubble (p-1)/m, m micro-batches of activations alive.
1f1b              warm-up, then one forward / one backward: same bubble, at most p - rank alive.
1f1b_reference    1f1b written here from isend/irecv (reference.py), for reading and testing.
interleaved_1f1b  v virtual stages per rank, dealt round-robin: bubble (p-1)/(v·m) for v times the messages.
zero_bubble       interleaved, with backward split into input-gradient B (on the critical path) and weight-
                  gradient W (deferred into the bubbles): ZB-1P of Qi et al. 2023.
zbv               zero bubble with two stages per rank in a V (rank r holds stages r and 2p-1-r).
dualpipev         DeepSeek's DualPipe folded into a V: forwards and backwards of two micro-batches overlap.
"""

from __future__ import annotations

import torch.distributed.pipelining

from llmtrain.catalog import ScheduleSpec


def torch_schedule(spec: ScheduleSpec) -> type | None:
    """torch's class for a schedule (None for the reference written here, reference.py)."""
    return None if spec.torch_class is None else getattr(torch.distributed.pipelining, spec.torch_class)
