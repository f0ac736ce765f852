"""What the GPU check's steps share: the schema and step names, the model shapes, the paper's tables (loaded once
from ``paper.json`` in this package: data, not code), the ``--decoders`` restriction (:data:`ONLY`), the crash
injection of the tests and the decoder builder."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import click

from dtbench.harness.models.random_models import RANDOM_SHAPES


def tests_dir() -> Path:
    """The repository's tests/ (the property tests the ``tests`` step runs; ``suites/`` beside it for ``smoke``):
    beside this file in a checkout, else under the working directory (tools/gpu-check.sh runs from the checkout with
    dtbench installed elsewhere)."""
    for root in (Path(__file__).resolve().parents[1], Path.cwd()):
        if (root / "tests" / "models.py").is_file():
            return root / "tests"
    raise click.ClickException("cannot find the repository's tests/ folder: run from the dtbench checkout")


SCHEMA = "dtbench.gpu-check/1"
STEPS = ("lossless", "timing", "costmodel", "overhead", "compiled", "tests", "smoke")

# Pythia's GPT-NeoX shapes (the paper's target and draft) and the --small pair: harness/models/loading.py's table, which
# `random:<shape>` models of a suite use too (issue 38 item 4).
PYTHIA_2_8B = RANDOM_SHAPES["pythia-2.8b"]
PYTHIA_70M = RANDOM_SHAPES["pythia-70m"]
SMALL_TARGET = RANDOM_SHAPES["tiny"]  # --small (the CPU dry run and the tests): the same architecture, a few MB
SMALL_DRAFT = RANDOM_SHAPES["tiny-draft"]


@dataclass(frozen=True)
class PaperRow:
    """One method of the paper's Tables 1 and 3 at T = 1500 (the DynaTree paper, docs/architecture.md "The paper"; Section 4.4).

    Attributes:
        speedup: Table 1's speedup over AR; throughput: Table 1's tokens/s; tokens_per_iter: Table 3's L-bar;
        iterations: Table 3's #Iter.; drafted: for a chain its K; for a tree (depth D, branching B, pruning tau)
        used to bound the drafted nodes per tree (:func:`tree_node_bounds`).
    """

    method: str
    dataset: str
    l_max: int
    speedup: float
    throughput: float
    tokens_per_iter: float
    iterations: int
    k: int | None = None
    depth: int | None = None
    branching: int | None = None
    tau: float | None = None
    cite: str = ""


@cache
def paper_tables() -> dict[str, Any]:
    """``paper.json`` of this package, read once: ``T``, ``ar_throughput`` (tokens/s per dataset), ``ar_tpot_s``
    (seconds per AR token per L_max) and ``rows`` (the :class:`PaperRow` fields per method and dataset)."""
    text = resources.files(__package__).joinpath("paper.json").read_text(encoding="utf-8")
    return dict(json.loads(text))


T_PAPER: int = paper_tables()["T"]  # new tokens per sample in the paper's tables
PAPER = tuple(PaperRow(**row) for row in paper_tables()["rows"])
AR_THROUGHPUT: dict[str, float] = paper_tables()["ar_throughput"]  # Table 1, AR rows (tokens/s)
EVENT_REL_TOL, EVENT_ABS_TOL_S = 0.10, 0.5e-3  # CUDA events vs wall clock (as tests/test_cuda.py)
NVML_OVER_ALLOCATOR = 4 * 2**30  # NVML adds the CUDA context and the allocator's cache: well below this


def utc_now() -> str:
    """The time now, UTC, ISO 8601 to the second (the JSON's ``started`` and ``finished``)."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def sync(device) -> None:
    """Wait for ``device``'s queued work (:func:`dtbench.harness.measurement.memory.synchronize`; a no-op on a CPU)."""
    from dtbench.harness.measurement.memory import synchronize

    synchronize(device)


def neox(shape: dict, dtype, device, seed: int):
    """A GPT-NeoX causal LM of ``shape`` with seeded random weights on ``device`` in ``dtype``
    (:func:`dtbench.harness.models.random_models.random_neox`)."""
    from dtbench.harness.models.random_models import random_neox

    return random_neox(shape, dtype, device, seed)


CRASH_ENV = "DTBENCH_GPUCHECK_CRASH"  # fault injection for the tests: a decoder name whose row segfaults the child


def crash_if_asked(name: str) -> None:
    """Segfault this process when :data:`CRASH_ENV` names ``name`` (the tests' fault injection)."""
    import os

    if os.environ.get(CRASH_ENV) == name:
        import ctypes

        ctypes.string_at(0)  # a real SIGSEGV in native code, as a crashing CUDA path gives


ONLY: set[str] | None = None  # --decoders: restrict steps a and d to these names (None: all)


def lossless_decoders() -> list[tuple[str, dict]]:
    """(name, params) of every built-in lossless decoder, as ``tests/test_measurement.py`` covers them
    (:func:`dtbench.testing.fixtures.builtin_settings`, each decoder's declared settings; ``--decoders`` restricts them)."""
    from dtbench.harness import registry
    from dtbench.testing.fixtures import builtin_settings

    return [(n, p) for n, p in builtin_settings() if registry.get(n).lossless and (ONLY is None or n in ONLY)]


def build(name: str, params: dict, target, draft, workdir: Path):
    """``name``'s decoder on ``target``/``draft`` with ``params``; placeholder heads and datastores are written to
    ``workdir`` sized for the target (random weights in the published formats)."""
    import numpy as np

    from dtbench.harness import registry
    from dtbench.testing.fixtures import HEAD, STORE, write_eagle, write_medusa

    cls = registry.get(name)
    if params.get("head") == HEAD:
        cfg = target.config
        write = write_medusa if name == "medusa" else write_eagle
        folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=workdir))
        params = {**params, "head": str(write(folder, hidden=cfg.hidden_size, vocab=cfg.vocab_size))}
    if params.get("tokens") == STORE:
        path = Path(tempfile.mkdtemp(prefix="rest-", dir=workdir)) / "store.npy"
        vocab = target.config.vocab_size
        np.save(path, (np.arange(4096) * 7919 % (vocab - 3) + 3).astype(np.int64))
        params = {**params, "tokens": str(path)}
    return cls(target, draft if cls.needs_draft else None, cls.Params(**params))
