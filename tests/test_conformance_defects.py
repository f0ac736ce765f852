"""The conformance kit finds real defects (issue 56 item 6): decoders planted with one defect each fail the check named
for it, with a one-line verdict and a counterexample, and only that check; a correct third-party decoder written only
against ``dtbench.api`` passes every check that applies.

The planted decoders are written against ``dtbench.api`` as a plugin author would (one uses dtbench's own compiled
``ar`` to plant a recompile). Each decodes by recomputing the target from scratch (no KV cache): slow, but tiny.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dtbench.api import Decoder, DecoderParams, Step, cut_at_eos, eos_ids
from dtbench.decoders.ar import Autoregressive
from dtbench.testing import check_decoder, check_names

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = [pytest.mark.usefixtures("one_thread")]


@pytest.fixture(autouse=True)
def _uncapped(monkeypatch):
    """The examples these tests ask for, not the fast tier's cap: a planted defect must be found (tests/conftest.py)."""
    monkeypatch.delenv("DTBENCH_HYPOTHESIS_EXAMPLES", raising=False)


CHEAP = [n for n in check_names() if n not in ("host_reads", "compiled_equals_eager", "sampling")]


class Params(DecoderParams):
    pass


def _argmax(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.argmax(model(input_ids=torch.tensor([ids], device=model.device)).logits[0], dim=-1)


class Chain(Decoder[Params]):
    """A correct chain decoder (K = 3 greedy drafts capped at T, greedy verification, stops at EOS when asked, no
    cache): the base of the planted ones."""

    Params = Params
    needs_draft = True
    lossless = True
    K = 3

    def verify(self, ids: list[int], k: int) -> tuple[list[int], list[int], int]:
        drafts: list[int] = []
        for _ in range(k):
            drafts.append(int(_argmax(self.draft, ids + drafts)[-1]))
        pred = _argmax(self.target, ids + drafts)[len(ids) - 1 :].tolist()
        a = 0
        while a < k and drafts[a] == pred[a]:
            a += 1
        return drafts, pred, a

    def drafts_for(self, produced: int, max_new_tokens: int) -> int:
        return min(self.K, max_new_tokens - produced - 1)  # with the bonus token, never past T

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> Iterator[Step]:
        ids = input_ids[0].tolist()
        eos = eos_ids(self.eos_token_id)
        first = int(_argmax(self.target, ids)[-1])
        ids.append(first)
        yield Step((first,))
        produced = 1
        if first in eos:
            return
        while produced < max_new_tokens:
            k = self.drafts_for(produced, max_new_tokens)
            drafts, pred, a = self.verify(ids, k)
            committed = (*drafts[:a], pred[a])
            ids = self.advance(ids, committed, drafts, a)
            step, hit = self.cut(Step(committed, drafted=k, accepted=a, depth=k), eos)
            produced += len(step.tokens)
            yield step
            if hit:
                return

    def advance(self, ids: list[int], committed: tuple[int, ...], drafts: list[int], a: int) -> list[int]:
        return ids + list(committed)

    def cut(self, step: Step, eos: frozenset[int]) -> tuple[Step, bool]:
        return cut_at_eos(step, eos)


class RollbackOffByOne(Chain):
    """After a rejection the context keeps the first rejected draft (a cache cropped one position too late)."""

    def advance(self, ids, committed, drafts, a):
        ids = ids + list(committed)
        return ids + [drafts[a]] if a < len(drafts) else ids


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

    def verify(self, ids, k):
        drafts, pred, _ = super().verify(ids, k)
        return drafts, [*drafts, pred[-1]], k


class Overshoots(Chain):
    """Drafts K tokens even when fewer remain before T (a chain not capped at T): its last Step commits past T on the
    prompts where the drafts are accepted, an extra verification the runner's cut at T hides."""

    def drafts_for(self, produced, max_new_tokens):
        return self.K


class PastEos(Chain):
    """Goes on generating past the EOS it commits when stopping at EOS was asked."""

    def cut(self, step, eos):
        return step, False


class WritesInputs(Chain):
    """Uses the caller's ``input_ids`` as scratch space once it has read them."""

    def generate(self, input_ids, max_new_tokens):
        gen = super().generate(input_ids, max_new_tokens)
        first = next(gen)
        input_ids.fill_(0)
        yield first
        yield from gen


class WallClock(Chain):
    """Commits another token than the target's when the microsecond clock is odd: its output depends on the wall
    clock (every other check would fail it too, blaming the wrong thing, on some runs and not others)."""

    def verify(self, ids, k):
        drafts, pred, a = super().verify(ids, k)
        if time.perf_counter_ns() // 1000 % 2:
            pred = [*pred[:a], (pred[a] + 1) % 96, *pred[a + 1 :]]
        return drafts, pred, a


class MixedRows(Chain):
    """Decodes batches (one token a row per iteration), and hands each row's tokens to the next live row."""

    batching = True
    K = 0

    def generate_batch(self, prompts, max_new_tokens):
        gens = [self.generate(p, max_new_tokens) for p in prompts]
        live = list(range(len(gens)))
        while live:
            steps = {r: next(gens[r], None) for r in live}
            live = [r for r in live if steps[r] is not None]
            if live:
                yield {r: steps[live[(i + 1) % len(live)]] for i, r in enumerate(live)}


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
    (Overshoots, "length"),
    (PastEos, "eos"),
    (WritesInputs, "inputs_unchanged"),
    (WallClock, "deterministic"),
]


@pytest.mark.parametrize(("decoder", "check"), PLANTED, ids=[d.__name__ for d, _ in PLANTED])
def test_a_planted_defect_fails_its_check_and_only_it(decoder, check):
    """In this process (``isolation="none"``): the subject is what the checks find; the child process and its
    deadlines are tests/test_check_process.py's."""
    report = check_decoder(decoder, checks=CHEAP, examples=12, isolation="none")
    failed = {o.check: o for o in report.outcomes if o.status in ("failed", "error")}
    assert set(failed) == {check}, [o.verdict for o in report.outcomes]
    if check == "deterministic":  # the others are not run: they would blame something else
        assert {o.status for o in report.outcomes if o.check != check} == {"skipped"}
        assert failed[check].detail.startswith("nondeterministic")
        assert {"first", "second"} <= set(failed[check].counterexample) or "first_steps" in failed[check].counterexample
    outcome = failed[check]
    assert outcome.status == "failed" and len(outcome.verdict.splitlines()) == 1
    assert outcome.verdict.startswith(f"{decoder.__name__}: {check} failed on cpu: ")
    assert outcome.counterexample  # the inputs that show it
    assert "params" in outcome.counterexample
    assert not report.ok


@pytest.mark.full
def test_a_recompile_per_iteration_fails_the_compiled_check_only():
    report = check_decoder(
        RecompilesEveryIteration,
        checks=["greedy_equals_reference", "compiled_equals_eager"],
        examples=2,
        isolation="none",
    )
    status = {o.check: o for o in report.outcomes}
    assert status["greedy_equals_reference"].status == "passed"
    compiled = status["compiled_equals_eager"]
    assert compiled.status == "failed" and "compiled inside the sample" in compiled.detail, compiled.verdict
    assert compiled.counterexample["prompt"]


def test_a_correct_decoder_written_against_the_api_passes():
    report = check_decoder(Chain, checks=[*CHEAP, "host_reads"], examples=10, isolation="none")
    assert report.ok, report.verdicts
    status = {o.check: o.status for o in report.outcomes}
    assert status == {
        "deterministic": "passed",
        "state": "passed",
        "length": "passed",
        "eos": "passed",
        "inputs_unchanged": "passed",
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
        sys.modules.pop("dtbench_prompt_lookup", None)  # tests/test_plugin.py imports the installed copy after us
    report = check_decoder(PromptLookup, checks=CHEAP, examples=8, isolation="none")
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


class KnownOvershoot(Overshoots):
    """Overshoots, declaring it (scikit-learn's ``_xfail_checks``)."""

    xfail_checks = {"length": "drafts K past T on purpose (a planted known failure)"}


class StaleDeclaration(Chain):
    """Declares a known failure it no longer has."""

    xfail_checks = {"length[cpu]": "fixed long ago"}


def test_a_declared_known_failure_is_xfail_and_a_stale_declaration_fails():
    report = check_decoder(KnownOvershoot, checks=["greedy_equals_reference", "length"], examples=12, isolation="none")
    status = {o.check: o for o in report.outcomes}
    assert status["greedy_equals_reference"].status == "passed"
    assert status["length"].status == "xfail", status["length"].verdict
    assert status["length"].detail.startswith("known failure (drafts K past T on purpose")
    assert "past T" in status["length"].detail  # what the check found, still shown
    assert report.ok
    stale = check_decoder(StaleDeclaration, checks=["length"], examples=3, isolation="none")
    (outcome,) = stale.outcomes
    assert outcome.status == "xpass" and "remove 'length[cpu]' from xfail_checks" in outcome.detail
    assert not stale.ok


class LimitParams(DecoderParams):
    k: int = 2


class Unbound(Decoder[LimitParams]):
    """Written as the annotation says, without ``Params = LimitParams`` (issue 65 item 6)."""

    def generate(self, input_ids, max_new_tokens):
        ids = input_ids[0].tolist()
        for _ in range(max_new_tokens):
            token = int(_argmax(self.target, ids)[-1]) if self.params.k == 2 else 0
            ids.append(token)
            yield Step((token,))


def test_decoder_of_p_without_params_binds_p():
    assert Unbound.Params is LimitParams
    assert Chain.Params is Params and Overshoots.Params is Params  # set or inherited: untouched
    report = check_decoder(Unbound, checks=["greedy_equals_reference", "length"], examples=4, isolation="none")
    assert report.ok, report.verdicts


def test_the_clis_check_names_are_the_kits():
    from dtbench.cli.check import CHECK_NAMES
    from dtbench.testing import check_names

    assert list(CHECK_NAMES) == check_names()
