"""The conformance kit finds real defects (issue 56 item 6): decoders planted with one defect each fail the check named
for it, with a one-line verdict and a counterexample, and only that check; a correct third-party decoder written only
against ``dtbench.api`` passes every check that applies.

The planted decoders are written against ``dtbench.api`` as a plugin author would (one uses dtbench's own compiled
``ar`` to plant a recompile). Each decodes by recomputing the target from scratch (no KV cache): slow, but tiny.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dtbench.api import Decoder, DecoderParams, Step
from dtbench.decoders.ar import Autoregressive
from dtbench.testing import check_decoder

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = [pytest.mark.usefixtures("one_thread")]


@pytest.fixture(autouse=True)
def _uncapped(monkeypatch):
    """The examples these tests ask for, not the fast tier's cap: a planted defect must be found (tests/conftest.py)."""
    monkeypatch.delenv("DTBENCH_HYPOTHESIS_EXAMPLES", raising=False)


CHEAP = ["state", "greedy_equals_reference", "batch_rows", "step_accounting"]


class Params(DecoderParams):
    pass


def _argmax(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.argmax(model(input_ids=torch.tensor([ids], device=model.device)).logits[0], dim=-1)


class Chain(Decoder[Params]):
    """A correct chain decoder (K = 3 greedy drafts, greedy verification, no cache): the base of the planted ones."""

    Params = Params
    needs_draft = True
    lossless = True
    K = 3

    def verify(self, ids: list[int]) -> tuple[list[int], list[int], int]:
        drafts: list[int] = []
        for _ in range(self.K):
            drafts.append(int(_argmax(self.draft, ids + drafts)[-1]))
        pred = _argmax(self.target, ids + drafts)[len(ids) - 1 :].tolist()
        a = 0
        while a < self.K and drafts[a] == pred[a]:
            a += 1
        return drafts, pred, a

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> Iterator[Step]:
        ids = input_ids[0].tolist()
        first = int(_argmax(self.target, ids)[-1])
        ids.append(first)
        yield Step((first,))
        while True:
            drafts, pred, a = self.verify(ids)
            committed = (*drafts[:a], pred[a])
            ids = self.advance(ids, committed, drafts, a)
            yield Step(committed, drafted=self.K, accepted=a, depth=self.K)

    def advance(self, ids: list[int], committed: tuple[int, ...], drafts: list[int], a: int) -> list[int]:
        return ids + list(committed)


class RollbackOffByOne(Chain):
    """After a rejection the context keeps the first rejected draft (a cache cropped one position too late)."""

    def advance(self, ids, committed, drafts, a):
        ids = ids + list(committed)
        return ids + [drafts[a]] if a < self.K else ids


class OverCounted(Chain):
    """Reports one more accepted draft than it committed."""

    def generate(self, input_ids, max_new_tokens):
        for step in super().generate(input_ids, max_new_tokens):
            yield Step(step.tokens, step.drafted, min(step.accepted + 1, step.drafted + 1), step.depth)


class EmptyStep(Chain):
    """Yields an empty Step after every real one."""

    def generate(self, input_ids, max_new_tokens):
        for step in super().generate(input_ids, max_new_tokens):
            yield step
            yield Step(())


class Leaky(Chain):
    """Remembers the last token of its previous prompt and emits it first on the next one."""

    def generate(self, input_ids, max_new_tokens):
        carried = getattr(self, "carried", None)
        for i, step in enumerate(super().generate(input_ids, max_new_tokens)):
            if i == 0 and carried is not None:
                step = Step((carried,))
            self.carried = step.tokens[-1]
            yield step


class LossyDeclaredLossless(Chain):
    """Commits the draft's tokens without checking them, and declares lossless."""

    def verify(self, ids):
        drafts, pred, _ = super().verify(ids)
        return drafts, [*drafts, pred[-1]], self.K


class MixedRows(Chain):
    """Decodes batches, and hands each row's tokens to the next row."""

    batching = True

    def generate_batch(self, prompts, max_new_tokens):
        gens = [self.generate(p, max_new_tokens) for p in prompts]
        while True:
            steps = [next(g) for g in gens]
            yield {r: steps[(r + 1) % len(steps)] if len(steps) > 1 else steps[r] for r in range(len(steps))}


class RecompilesEveryIteration(Autoregressive):
    """dtbench's ``ar`` that also compiles a new graph at every iteration (a shape or a guard that changes per step)."""

    def generate(self, input_ids, max_new_tokens):
        for i, step in enumerate(super().generate(input_ids, max_new_tokens)):
            scope: dict = {}
            exec(f"def shift(x):\n    return x + {i}", scope)  # a new code object: dynamo compiles a new graph
            torch.compile(scope["shift"], backend="eager")(torch.zeros(2))
            yield step


PLANTED = [
    (RollbackOffByOne, "greedy_equals_reference"),
    (LossyDeclaredLossless, "greedy_equals_reference"),
    (OverCounted, "step_accounting"),
    (EmptyStep, "step_accounting"),
    (Leaky, "state"),
    (MixedRows, "batch_rows"),
]


@pytest.mark.parametrize(("decoder", "check"), PLANTED, ids=[d.__name__ for d, _ in PLANTED])
def test_a_planted_defect_fails_its_check_and_only_it(decoder, check):
    report = check_decoder(decoder, checks=CHEAP, examples=12)
    failed = {o.check: o for o in report.outcomes if o.status in ("failed", "error")}
    assert set(failed) == {check}, [o.verdict for o in report.outcomes]
    outcome = failed[check]
    assert outcome.status == "failed" and len(outcome.verdict.splitlines()) == 1
    assert outcome.verdict.startswith(f"{decoder.__name__}: {check} failed on cpu: ")
    assert outcome.counterexample  # the inputs that show it
    assert "params" in outcome.counterexample
    assert not report.ok


@pytest.mark.full
def test_a_recompile_per_iteration_fails_the_compiled_check_only():
    report = check_decoder(
        RecompilesEveryIteration, checks=["greedy_equals_reference", "compiled_equals_eager"], examples=2
    )
    status = {o.check: o for o in report.outcomes}
    assert status["greedy_equals_reference"].status == "passed"
    compiled = status["compiled_equals_eager"]
    assert compiled.status == "failed" and "compiled inside the sample" in compiled.detail, compiled.verdict
    assert compiled.counterexample["prompt"]


def test_a_correct_decoder_written_against_the_api_passes():
    report = check_decoder(Chain, checks=[*CHEAP, "host_reads"], examples=10)
    assert report.ok, report.verdicts
    status = {o.check: o.status for o in report.outcomes}
    assert status == {
        "state": "passed",
        "greedy_equals_reference": "passed",
        "batch_rows": "n/a",  # declares batching = False
        "step_accounting": "passed",
        "host_reads": "reported",  # no bound declared: counted, not judged
    }


def test_the_example_plugin_passes_from_its_source():
    """examples/dtbench-prompt-lookup, imported from its source folder (its installed form: tests/test_plugin.py)."""
    src = Path(__file__).resolve().parents[1] / "examples" / "dtbench-prompt-lookup" / "src"
    sys.path.insert(0, str(src))
    try:
        from dtbench_prompt_lookup import PromptLookup
    finally:
        sys.path.remove(str(src))
    report = check_decoder(PromptLookup, checks=CHEAP, examples=8)
    assert report.ok, report.verdicts
    assert [o.status for o in report.outcomes if o.check == "greedy_equals_reference"] == ["passed"]


def test_bad_names_are_one_line_errors():
    from dtbench.core import DtbenchError

    with pytest.raises(DtbenchError, match="unknown check nope"):
        check_decoder("ar", checks=["nope"])
    with pytest.raises(DtbenchError, match="unknown device"):
        check_decoder("ar", device="tpu")
    with pytest.raises(DtbenchError):
        check_decoder("no_such_decoder")
