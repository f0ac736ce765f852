"""Device-to-host reads per iteration (issue 46 item 1): what makes a decoding loop wait for the device.

On a GPU every read of device data by the host (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``, ...) waits for
every queued kernel, so a loop that reads more than once per iteration serializes the host with the device and its
own Python becomes the bottleneck once forwards are fast (compiled). Two counters, one per iteration:

- :class:`HostReads`, a ``TorchFunctionMode`` that counts calls of the Tensor methods that copy data to the host
  (:data:`READS`), the models' own forwards included: device-independent, so it runs on a CPU too.
- on CUDA, the synchronizations CUDA itself reports (``torch.cuda.set_sync_debug_mode("warn")``): every
  synchronizing operation warns, and each warning is counted.

:func:`reads_per_iteration` runs a decoder on one prompt and returns both per iteration (the GPU check records them;
``tests/test_host_reads.py`` holds the loops to their bounds).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

READS = frozenset(
    {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__", "__float__", "nonzero", "__array__"}
)


class HostReads(TorchFunctionMode):
    """Counts calls of the Tensor methods that copy device data to the host (:data:`READS`) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _CudaSyncs:
    """Counts CUDA's own synchronization warnings (``set_sync_debug_mode("warn")``) while active; 0 off CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.on = device.type == "cuda"
        self.caught: list[warnings.WarningMessage] = []

    def __enter__(self) -> _CudaSyncs:
        if self.on:
            self._warnings = warnings.catch_warnings(record=True)
            self.caught = self._warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.on:
            torch.cuda.set_sync_debug_mode("default")
            self._warnings.__exit__(*exc)

    @property
    def count(self) -> int:
        return sum("synchroniz" in str(w.message) for w in self.caught)


def reads_per_iteration(
    decoder: Any,
    prompt_ids: Sequence[int],
    gen_length: int,
    device: torch.device,
    execution: Any = None,
    counted: bool = False,
) -> dict[str, list[int]]:
    """Run ``decoder`` (``generate``) on one prompt for ``gen_length`` tokens and count per iteration (iteration i:
    the work between Step i-1 and Step i, the prefill's first) the host reads (:class:`HostReads`) and, on CUDA,
    the synchronizations CUDA reports.

    Args:
        decoder: a bound :class:`~dtbench.decoders.base.Decoder`.
        prompt_ids: the prompt's token ids.
        gen_length: T.
        device: where the models live.
        execution: a :class:`~dtbench.decoders.static_kv.Execution` to run in compiled execution (None: eager).
        counted: with the measurement's :class:`~dtbench.harness.measurement.forwards.ForwardCounter` installed, as a cell
            measures: its hooks' reads count too (the harness must not add a read per forward).

    Returns:
        ``{"host_reads": [...], "cuda_syncs": [...]}`` (``cuda_syncs`` all 0 off CUDA), one entry per iteration.
    """
    from dtbench.decoders import static_kv

    reads, syncs = [], []
    with static_kv.compiled(execution) if execution is not None else nullcontext():
        if execution is not None:
            execution.begin_sample()
        gen = decoder.generate(torch.tensor([list(prompt_ids)], device=device), gen_length)
        produced = 0
        from dtbench.harness.measurement.forwards import ForwardCounter

        hooks = ForwardCounter(decoder.target, decoder.draft) if counted else nullcontext()
        with hooks, HostReads() as counter, _CudaSyncs(device) as cuda:
            last = (0, 0)
            for step in gen:
                reads.append(counter.count - last[0])
                syncs.append(cuda.count - last[1])
                last = (counter.count, cuda.count)
                produced += len(step.tokens)
                if produced >= gen_length:
                    break
        gen.close()
    return {"host_reads": reads, "cuda_syncs": syncs}
