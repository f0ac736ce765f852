"""Push-based decoders (issue 47): a decoder whose loop is a blocking call stamps each Step with its commit time
(``Step.at``, :func:`dtbench.decoders.base.commit_clock`) and yields the Steps afterwards; the one timing loop
(``measure_rows``) takes each iteration's time and the forwards counted up to it from the stamp, exactly as if the
Step had been yielded then. Stamps the loop cannot trust are refused in one line."""

from __future__ import annotations

import pytest
import torch
from models import model_zoo

from dtbench.decoders.ar import ARParams, Autoregressive
from dtbench.decoders.base import Step, commit_clock
from dtbench.harness.errors import DtbenchError
from dtbench.harness.measurement.measure import measure, measure_rows

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
PROMPT = list(range(3, 20))


class PushedAR(Autoregressive):
    """``ar`` run to completion first, each Step stamped when its token was known, then yielded: a push-based
    decoder. ``shift`` moves every stamp (seconds) to make it untrustworthy."""

    shift = 0.0

    def generate(self, input_ids, max_new_tokens):
        stamped = [
            Step(s.tokens, s.drafted, s.accepted, s.depth, commit_clock(input_ids.device) + self.shift)
            for s in super().generate(input_ids, max_new_tokens)
        ]
        yield from stamped


def test_a_push_based_decoder_is_timed_and_counted_as_if_it_had_yielded_each_step():
    target, _ = model_zoo()["perturbed"]
    pulled = measure(Autoregressive(target, None, ARParams()), PROMPT, 12, CPU)
    pushed = measure(PushedAR(target, None, ARParams()), PROMPT, 12, CPU)
    assert pushed.tokens == pulled.tokens
    # one target forward per iteration, fed the same tokens: the forwards are attributed to their own iteration
    assert [r.target_forwards for r in pushed.records] == [1] * 12
    assert [r.target_fed for r in pushed.records] == [r.target_fed for r in pulled.records]
    times = pushed.step_times
    assert all(0 < a < b for a, b in zip(times, times[1:], strict=False))


@pytest.mark.parametrize(
    ("shift", "why"),
    [(-1e6, "a time outside its sample"), (1e6, "a time outside its sample")],
)
def test_a_stamp_outside_the_sample_is_refused(shift, why):
    target, _ = model_zoo()["perturbed"]
    decoder = PushedAR(target, None, ARParams())
    decoder.shift = shift
    with pytest.raises(DtbenchError, match=why):
        measure(decoder, PROMPT, 6, CPU)


def test_stamps_going_back_or_disagreeing_between_rows_are_refused():
    target, _ = model_zoo()["perturbed"]

    class Back(Autoregressive):
        def generate(self, input_ids, max_new_tokens):
            late = commit_clock(input_ids.device)
            steps = list(super().generate(input_ids, max_new_tokens))
            yield Step(steps[0].tokens, at=commit_clock(input_ids.device))
            yield Step(steps[1].tokens, at=late)  # before the previous stamp

    with pytest.raises(DtbenchError, match="before the previous one"):
        measure(Back(target, None, ARParams()), PROMPT, 4, CPU)

    class Rows(Autoregressive):
        def generate_batch(self, prompts, max_new_tokens):
            at = commit_clock(prompts[0].device)
            yield {0: Step((5,), at=at), 1: Step((6,), at=at + 1e-9)}

    with pytest.raises(DtbenchError, match="different commit times"):
        measure_rows(Rows(target, None, ARParams()), [PROMPT, PROMPT], 1, CPU)
