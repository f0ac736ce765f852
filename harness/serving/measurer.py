"""The served :class:`~dtbench.harness.measurement.measurers.Measurer` (issue 49 item 1): a server cell's unit of prompts measured
through requests by the client (:func:`~dtbench.harness.serving.client.observe_requests`), then the shared tail of
every cell (:func:`~dtbench.harness.measurement.measurers.measure_outcome`) makes its rows, as for dtbench's own decoders.

A server that does not start, exits, or answers with an error fails its cell with one line naming the server and its
log (an exception group: its first real error, issue 50).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dtbench.harness.errors import error_line
from dtbench.harness.measurement.measurers import Measured
from dtbench.harness.measurement.sample import Reference
from dtbench.harness.serving.client import observe_requests
from dtbench.harness.serving.params import ServerParams
from dtbench.harness.serving.process import ServerPool
from dtbench.harness.suites.plan import CellPlan, PromptGroup
from dtbench.harness.suites.suite import Suite


class ServedMeasurer:
    """Measures a cell whose decoder declares ``requests`` (the ``server`` entry) on one unit of prompts: at every
    load level C the unit's requests are kept C in flight, paired in blocks of C (at C = 1: per prompt).

    Args:
        suite: the run's suite (its seed seeds the arrivals, its ``lossless_check`` is the output check's rule).
        servers: the worker's :class:`~dtbench.harness.serving.process.ServerPool`.
        tokenizer: the target's tokenizer (text prompts, text-only engines, the vocabulary's size).
        stop_at_eos: end each request at the target's EOS (T at most).
    """

    def __init__(self, suite: Suite, servers: ServerPool, tokenizer: Any, stop_at_eos: bool = False):
        self.suite, self.servers, self.tokenizer, self.stop_at_eos = suite, servers, tokenizer, stop_at_eos

    def measure(
        self, cp: CellPlan, prompts: list[Any], group: PromptGroup, ref: Reference | None, compare: bool
    ) -> Measured[None]:
        """The unit's requests as observations (``compare`` is always True for a server: it does not sample).

        Raises:
            ServerError: as :func:`~dtbench.harness.serving.client.observe_requests`.
        """
        params = _server_params(cp)
        reference = next(((c.label, _server_params(c)) for c in group.decoders if c.label == cp.reference_label), None)
        observed = observe_requests(
            cp.label,
            params,
            prompts,
            group.gen_length,
            group.batch_size,
            group.cell,  # the dataset entry's key, not its name (issue 58 item 3)
            self.servers,
            seed=self.suite.seed,
            stop_at_eos=self.stop_at_eos,
            references=references_of(ref, prompts),
            reference=reference,
            rule=self.suite.lossless_check,
            tokenizer=self.tokenizer,
            batch_group=group.prompt_index if group.batch_size > 1 else None,  # blocks of C (at C = 1 per prompt)
        )
        return Measured(observed)

    def finish(self, cp: CellPlan, measured: Measured[None], r: int, row: Mapping[str, Any]) -> dict[str, Any]:
        """Nothing more: a request's output check came with its observation (the reference server's candidates are
        asked while its server runs)."""
        return {}

    def failure(self, cp: CellPlan, prompts: list[Any], group: PromptGroup, exc: BaseException) -> str:
        """The error's one line (it names the server and its log)."""
        return error_line(exc)


def references_of(ref: Reference | None, prompts: list[Any]) -> list[list[int] | None] | None:
    """Per prompt the reference's output tokens (None where its request failed: not compared), looked up by prompt
    index where the reference says which rows it kept (issue 59 item 7); None without a reference."""
    if ref is None:
        return None
    if ref.prompts is None:
        return list(ref.tokens)
    by_prompt = dict(zip(ref.prompts, ref.tokens))
    return [by_prompt.get(p.index) for p in prompts]


def _server_params(cp: CellPlan) -> ServerParams:
    """A served cell's params: a decoder declaring ``requests`` takes a server's params."""
    assert isinstance(cp.params, ServerParams), f"{cp.label}: a served cell takes ServerParams"
    return cp.params
