"""Issue 68 item 2: forwards are timed by role, not by model object. A decoder that drafts with its own target (here
``linear`` with the target object as its draft, as LayerSkip, Kangaroo or a plugin's Proposer on ``self.target``
would) has its drafting forwards counted and timed as draft forwards, so its time split and draft cost are its own;
before, every forward was the target's and the draft's share read 0."""

from __future__ import annotations

import torch

from dtbench.decoders.linear import LinearParams, LinearSpeculative
from dtbench.decoders.roles import drafting, forward_role
from dtbench.harness.measurement.forwards import ForwardCounter
from dtbench.harness.measurement.measure import measure
from dtbench.harness.measurement.observation import measured_columns
from dtbench.testing.fixtures import tiny_model

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)
CPU = torch.device("cpu")
PROMPT = list(range(3, 15))


def test_a_self_drafting_decoders_draft_forwards_are_the_proposers():
    target = tiny_model("llama", 0)
    k, T = 3, 12
    m = measure(LinearSpeculative(target, target, LinearParams(k=k)), PROMPT, T, CPU)  # draft = the target object
    draft_fw = [r.draft_forwards for r in m.records]
    target_fw = [r.target_forwards for r in m.records]
    assert all(d is not None for d in draft_fw[1:]) and sum(d or 0 for d in draft_fw) > 0
    # the target's own forwards: the prefill, then one verification per iteration (the chain's one forward)
    assert target_fw[0] == 1 and all(t == 1 for t in target_fw[1:]), target_fw
    s = measured_columns(m)
    assert s["draft_forwards"] == sum(d or 0 for d in draft_fw) and s["target_forwards"] == len(m.records)
    fs = m.forward_s
    assert fs["draft"] is not None and fs["draft"] > 0 and fs["target"] > 0  # the draft's share is its own, not 0


def test_the_role_is_the_context_and_the_draft_object_is_always_the_draft():
    target, draft = tiny_model("llama", 0), tiny_model("llama", 7)
    ids = torch.tensor([PROMPT])
    with ForwardCounter(target, None) as plain:  # no drafting: nothing counted for the draft, as before
        target(input_ids=ids)
    assert plain.snapshot() == (1, None, len(PROMPT), None) and plain.forward_seconds()["draft"] is None
    with ForwardCounter(target, draft) as counter:
        target(input_ids=ids)
        assert forward_role() == "target"
        with drafting():
            assert forward_role() == "draft"
            target(input_ids=ids)  # the target object drafting: a draft forward
        draft(input_ids=ids)  # the draft object, outside drafting(): still the draft's
    assert counter.snapshot() == (1, 2, len(PROMPT), 2 * len(PROMPT))
    seconds = counter.forward_seconds()
    assert seconds["draft"] > 0 and seconds["target"] > 0
