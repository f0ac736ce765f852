"""The one sample record: every column of a measured sample, declared once, and the reference output a decoder's
sample is compared with.

:class:`SampleRecord` is what a worker produces for one (cell, prompt) and the ``samples`` table stores (the table's
columns are these fields plus its bookkeeping ``id``, ``cell_id`` and ``created_at``; tests/test_db.py asserts they
are equal, so a new column is a field here, a column in :class:`dtbench.harness.store.db.Sample` and a migration). Every
other shape is derived from it (issue 49 item 5: one shape from the measurement to the database): the measurers build
one record per row (:func:`~dtbench.harness.measurement.measurers.record_rows`), executors ship it as it is (it pickles), and the
runner maps it to the ORM once (:meth:`SampleRecord.as_row`, credentials masked); the reports read the columns back
(:data:`COLUMNS`). Definitions of the metrics:
:mod:`dtbench.harness.measurement.metrics` (:func:`~dtbench.harness.measurement.observation.sample_row` fills the measurement's part).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, NamedTuple

# How a per-prompt column aggregates (field metadata ``aggregate``), declared once beside the column:
# ``row``: each row's own value; a batched prompt group's row averages it over the group's rows, and a prompt's row
# takes its median over repeats. ``whole``: the group's or the prompt's whole (T, wall time, throughput, memory,
# energy), recomputed for a batched group and the median over repeats. Unmarked columns are identities, lists, text
# and verdicts, never averaged. Read with :func:`aggregated` (reports/stats.py: collapse_batches, collapse_repeats).
ROW = {"aggregate": "row"}
WHOLE = {"aggregate": "whole"}


@dataclass(frozen=True, kw_only=True)
class SampleRecord:
    """One prompt decoded by one cell. Times in seconds, memory in bytes, energy in joules, counts in tokens or
    forwards (definitions: :mod:`dtbench.harness.measurement.metrics`).

    Attributes:
        prompt_index, document, warmup, prompt_tokens: which prompt (its index in the cell, source document, whether
            it is one of the first W, its length in tokens).
        task_group, category, turn, question_id: a question dataset's task (None for raw text).
        new_tokens: T generated; total_s, ttft_s, tpot_s, throughput: wall times and T / total_s.
        iterations, tokens_per_iteration, drafted, accepted, draft_depth, acceptance_rate, acceptance_incl_bonus,
            mean_path_length, mean_path_length_all, target_forwards, draft_forwards: the speculation counters.
        step_tokens, step_stats, step_times_s: per iteration (committed tokens; drafted/accepted/depth/forwards and
            the decoder's state; seconds from start at each iteration's end).
        peak_rss_bytes, peak_allocated_bytes, peak_nvml_bytes, nvml_scope: peak memory.
        energy_j, energy_status, energy_source: energy over the sample (:mod:`dtbench.harness.measurement.energy`).
        output_hash, output_tokens: the output's identity and token ids.
        lossless, first_divergence: the verdict against the reference and the first differing position.
        lossless_*: the teacher-forced check of every emitted token (:mod:`dtbench.harness.measurement.lossless`).
        worker_host, device_name: where it was measured.
        batch_group, batch_rows, batch_total_s: a row of a batched cell (B > 1, issue 29): its prompt group's first
            prompt index, the rows decoded together (< B: the remainder group) and the group's wall time in seconds
            (until its last row finished); None at B = 1.
        repeat: the 0-based repeat of the prompt (suite key ``repeats``, issue 41); 0 without repeats.
        roofline: the sample's distance from the hardware limit (issue 37, :mod:`dtbench.harness.calibration.roofline`): the
            seconds its forwards would take at the device's memory bandwidth (every weight and attended KV byte read
            once per forward) over its measured total_s, a fraction; None where not measured.
    """

    prompt_index: int
    document: str
    warmup: bool
    prompt_tokens: int = field(metadata=ROW)
    new_tokens: int = field(metadata=WHOLE)
    total_s: float = field(metadata=WHOLE)
    ttft_s: float = field(metadata=ROW)
    throughput: float = field(metadata=WHOLE)
    iterations: int = field(metadata=ROW)
    tokens_per_iteration: float = field(metadata=ROW)
    drafted: int = field(metadata=ROW)
    accepted: int = field(metadata=ROW)
    draft_depth: int = field(metadata=ROW)
    step_tokens: list[int]
    step_stats: dict[str, Any]
    step_times_s: list[float]
    output_hash: str
    output_tokens: list[int]
    tpot_s: float | None = field(default=None, metadata=ROW)
    acceptance_rate: float | None = field(default=None, metadata=ROW)
    acceptance_incl_bonus: float | None = field(default=None, metadata=ROW)
    mean_path_length: float | None = field(default=None, metadata=ROW)
    mean_path_length_all: float | None = field(default=None, metadata=ROW)
    target_forwards: int | None = field(default=None, metadata=ROW)
    draft_forwards: int | None = field(default=None, metadata=ROW)
    task_group: str | None = None
    category: str | None = None
    turn: int | None = None
    question_id: str | None = None
    peak_rss_bytes: int | None = field(default=None, metadata=WHOLE)
    peak_allocated_bytes: int | None = field(default=None, metadata=WHOLE)
    peak_nvml_bytes: int | None = field(default=None, metadata=WHOLE)
    nvml_scope: str | None = None
    energy_j: float | None = field(default=None, metadata=WHOLE)
    energy_status: str | None = None
    energy_source: str | None = None
    lossless: bool | None = None
    first_divergence: int | None = None
    lossless_checked: int | None = None
    lossless_ties: int | None = None
    lossless_errors: int | None = None
    lossless_first_error: int | None = None
    lossless_error_margin: float | None = None
    lossless_tie_margin: float | None = None
    lossless_noise: float | None = None
    lossless_check_s: float | None = field(default=None, metadata=WHOLE)
    lossless_diagnoses: list[dict[str, Any]] | None = None
    worker_host: str | None = None
    device_name: str | None = None
    batch_group: int | None = None
    batch_rows: int | None = None
    batch_total_s: float | None = field(default=None, metadata=WHOLE)
    repeat: int = 0
    roofline: float | None = None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> SampleRecord:
        """The record of a row of columns (a worker's shipped dict).

        Raises:
            ValueError: a key that is no column, or a required column missing.
        """
        unknown = sorted(set(row) - set(COLUMNS))
        if unknown:
            raise ValueError(f"not sample columns: {', '.join(unknown)}")
        try:
            return cls(**row)
        except TypeError as exc:  # a required column missing
            raise ValueError(str(exc)) from None

    def as_row(self) -> dict[str, Any]:
        """The columns as a plain dict (JSON-able values: what executors ship and the runner stores)."""
        return asdict(self)


COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(SampleRecord))


def aggregated(*kinds: str) -> tuple[str, ...]:
    """The sample columns whose ``aggregate`` metadata is one of ``kinds`` (``"row"``, ``"whole"``), in column
    order."""
    return tuple(f.name for f in fields(SampleRecord) if f.metadata.get("aggregate") in kinds)


# Columns a per-cell report never reads back: per-iteration lists and the output itself (large JSON).
BULKY = frozenset({"step_tokens", "step_stats", "step_times_s", "output_tokens", "lossless_diagnoses", "document"})
SCALAR_COLUMNS: tuple[str, ...] = tuple(c for c in COLUMNS if c not in BULKY)


class Reference(NamedTuple):
    """The reference decoder's output on one prompt group, what a dependent decoder's samples are compared with.

    Attributes:
        tokens: its output token ids, one list per row (one row at B = 1).
        total_s: its wall time (s; the batch's at B > 1), the yardstick of ``timeout_s: auto``; None when unknown (a
            NamedTuple takes plain defaults, not ``dataclasses.field``: issue 58 item 6).
        cpu_s: its CPU seconds when measured in this process; None when read back from the database (a resumed run).
        prompts: the prompt index of each row of ``tokens``; None: the group's prompts in order. A served unit keeps
            the rows of the requests that did not fail (issue 59 item 7), so a dependent looks its rows up by prompt.
    """

    tokens: list[list[int]]
    total_s: float | None = None
    cpu_s: float | None = None
    prompts: tuple[int, ...] | None = None
