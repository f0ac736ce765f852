"""The offline GPU check (issue 31): what a borrowed GPU node can verify in minutes, with no network and no model file.

``tools/gpu-check.sh OUT`` installs the kit (``make gpu-kit``) on the node and runs ``python -m dtbench.gpucheck
--out OUT`` (:mod:`dtbench.gpucheck.command`; ``dtbench.cli.gpucheck`` is the same command); ``make gpu-check-dry``
runs the same on this CPU with ``--device cpu --small``. Every model is built on the device from a fixed seed (no
download, no embedded GGUF):

a. **lossless** (:func:`step_lossless`): every built-in lossless decoder (the parameter list
   :func:`dtbench.testing.fixtures.builtin_settings`: each decoder's declared check settings) against ``ar`` on tiny
   Llama and GPT-NeoX pairs (:mod:`dtbench.testing.fixtures`: target and a perturbed copy as the draft, sharp output
   layer). float32: the exact rule (token for token). float16 (bfloat16 on a CPU): the tie-aware rule of
   :mod:`dtbench.harness.measurement.lossless` (every emitted token is the target's argmax given the decoder's own prefix, up to
   the measured numeric noise).
b. **timing** (:func:`step_timing`): the forward timer's CUDA-event forward times
   (:class:`~dtbench.harness.measurement.forwards.ForwardTimer` in :class:`~dtbench.harness.measurement.measure.ForwardCounter`)
   against the wall clock around synchronized forwards of the Pythia-2.8B-shaped target; NVML's per-process peak
   against the allocator's peak (:class:`~dtbench.harness.measurement.memory.MemoryTracker`); energy per token of ``ar`` through
   Zeus (:mod:`dtbench.harness.measurement.energy`; "unavailable" with its reason where no counter can be read).
c. **cost model** (:func:`step_costmodel`): the calibration of :mod:`dtbench.harness.calibration.calibrate` for GPT-NeoX at
   Pythia-2.8B's and Pythia-70M's shapes (fp16, random weights): target verification latency (causal and tree mask)
   for 1..256 new tokens on caches of L_max and L_max + T positions, L_max = 800 (WikiText-2) and 1000 (PG-19),
   T = 1500 (paper Section 4.1), and the draft's per-token latency; then the speedups these curves predict from the
   paper's own Table 3 (tokens per iteration L-bar, iterations #Iter) for linear (K = 8 on WikiText-2, 5 on PG-19),
   the fixed tree (D = 8, B = 3, tau = 0.1) and DynaTree, beside the paper's Table 1 (:data:`PAPER`, read from this
   package's ``paper.json``).
d. **loop overhead** (:func:`step_overhead`): each decoder at the same shapes, random weights (a random draft accepts
   almost nothing, so every iteration commits about one token): wall time minus the time inside model forwards,
   per iteration, against the paper's own time per iteration (T / throughput / #Iter).
e. **compiled** (:func:`step_compiled`, issue 37): the same shapes eager and compiled (static KV cache, bucketed
   ``torch.compile``, CUDA graphs on CUDA; :mod:`dtbench.decoders.kv`): one target forward's time for n = 1, 9, 64
   and 190 new tokens on a cache of L_max = 800 beside its memory-bandwidth limit (weights + attended KV over the
   copy-benchmark bandwidth, :mod:`dtbench.harness.calibration.roofline`), ``ar``'s tokens/s and roofline fraction both ways,
   and the loop overhead per iteration of ``linear`` and ``dynatree`` both ways; the compile time apart.

Output: ``OUT/gpu-check.json`` (:data:`SCHEMA`, validated by ``tests/test_gpucheck.py``) and ``OUT/gpu-check.log``.
Exit code 0 when every step passed, 1 when one failed (the JSON says which), 2 for bad arguments.

Modules, one per step (``lossless``, ``timing``, ``costmodel``, ``overhead``, ``compiled``, ``proptests``,
``smoke``), what they share (``common``), the child processes (``children``), the environment and summary
(``report``), the lease's time budget (``budget``) and the command (``command``).
"""

from dtbench.gpucheck.command import main

# The names the tests and tools use, from the modules that define them.
from dtbench.gpucheck.common import (
    CRASH_ENV,
    PAPER,
    SCHEMA,
    SMALL_DRAFT,
    SMALL_TARGET,
    STEPS,
    PaperRow,
    lossless_decoders,
    neox,
)
from dtbench.gpucheck.compiled import COMPILED_DECODERS, step_compiled
from dtbench.gpucheck.costmodel import level_sizes, predict, step_costmodel, tree_node_bounds
from dtbench.gpucheck.lossless import step_lossless
from dtbench.gpucheck.overhead import OVERHEAD_DECODERS, step_overhead
from dtbench.gpucheck.proptests import TEST_MODULES, parse_hypothesis_statistics, parse_junit, step_tests
from dtbench.gpucheck.smoke import step_smoke
from dtbench.gpucheck.timing import step_timing

__all__ = [
    "COMPILED_DECODERS",
    "CRASH_ENV",
    "OVERHEAD_DECODERS",
    "PAPER",
    "SCHEMA",
    "SMALL_DRAFT",
    "SMALL_TARGET",
    "STEPS",
    "TEST_MODULES",
    "PaperRow",
    "level_sizes",
    "lossless_decoders",
    "main",
    "neox",
    "parse_hypothesis_statistics",
    "parse_junit",
    "predict",
    "step_compiled",
    "step_costmodel",
    "step_lossless",
    "step_overhead",
    "step_smoke",
    "step_tests",
    "step_timing",
    "tree_node_bounds",
]
