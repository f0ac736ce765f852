"""The conformance kit's ``sampling`` check on every built-in decoder (issue 56; split from test_conformance.py
so that two xdist workers share the full tier's kit checks, issue 57): sampling follows the target's distribution (every built-in that samples: a chi-square
test over a thousand generations per setting). Ids end in the device, as in
test_conformance.py.
"""

from __future__ import annotations

import pytest
from test_conformance import BUILTINS, DEVICES  # the one list of built-ins and devices

from dtbench.testing import parametrize_with_checks

TIER = "full"
pytestmark = pytest.mark.usefixtures("one_thread")


@parametrize_with_checks(BUILTINS, devices=DEVICES, checks=["sampling"])
def test_builtin_sampling(decoder, check):
    check(decoder)


@pytest.mark.parametrize("length", ["kit", "M"])
def test_a_wrong_rule_for_a_later_draft_fails_the_sampling_check(monkeypatch, length):
    """A rule wrong from the second drafted token on (accepted whenever the first is) fails the kit's sampling check on
    ``linear`` (its declared k = 3). Its generations ask for LENGTH = 7 tokens; asked for M = 3 only, as the check did
    before, a chain's first iteration drafted one token and the same defect passed (the ``M`` case shows it)."""
    from dtbench.decoders import chain
    from dtbench.decoders.linear import LinearSpeculative
    from dtbench.decoders.sampling import sample
    from dtbench.testing import check_decoder
    from dtbench.testing import sampling as conformance_sampling

    real = chain.verify_chain_sampled

    def later_drafts_always_accepted(drafts, draft_probs, target_probs, generator):
        accepted, committed = real(drafts, draft_probs, target_probs, generator)
        if accepted == 0 or len(drafts) < 2:
            return accepted, committed
        return len(drafts), (*drafts, sample(target_probs[len(drafts)], generator))

    monkeypatch.setattr(chain, "verify_chain_sampled", later_drafts_always_accepted)
    if length == "M":
        monkeypatch.setattr(conformance_sampling, "LENGTH", conformance_sampling.M)
    (outcome,) = check_decoder(LinearSpeculative, checks=["sampling"], isolation="none").outcomes  # the patch is here
    if length == "M":
        assert outcome.status == "passed", outcome.verdict  # the defect the shorter generations could not see
    else:
        assert outcome.status == "failed" and "do not follow the target's distribution" in outcome.verdict
        assert outcome.counterexample["params"] and outcome.counterexample["runs"] == conformance_sampling.RUNS


def test_batched_rows_that_do_not_sample_fail_the_sampling_check():
    """A decoder declaring ``batch_sampling`` whose ``generate_batch`` decodes its rows greedily (its ``generate``
    samples right) fails the kit's sampling check on the batched leg (issue 68 item 7); declaring no
    ``batch_sampling``, the same class passes (only its B = 1 law is drawn, twice as two legs would be one setting)."""
    from dtbench.decoders.ar import Autoregressive
    from dtbench.testing import check_decoder
    from dtbench.testing import sampling as conformance_sampling

    class GreedyRows(Autoregressive):
        def generate_batch(self, prompts, max_new_tokens):
            sampling, self.sampling = self.sampling, None
            try:
                yield from super().generate_batch(prompts, max_new_tokens)
            finally:
                self.sampling = sampling

    (outcome,) = check_decoder(GreedyRows, checks=["sampling"], isolation="none").outcomes
    assert outcome.status == "failed", outcome.verdict
    assert f"at B = {conformance_sampling.ROWS}" in outcome.verdict
    assert outcome.counterexample["batch_rows"] == conformance_sampling.ROWS
    GreedyRows.batch_sampling = False
    (outcome,) = check_decoder(GreedyRows, checks=["sampling"], isolation="none").outcomes
    assert outcome.status == "passed", outcome.verdict
