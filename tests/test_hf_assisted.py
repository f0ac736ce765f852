"""hf_assisted: transformers' assisted generation is lossless vs ar, streams one Step per verification in
lockstep with the consumer, propagates worker errors, stops its worker when closed early, and leaves the models
as it found them."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import hf_greedy, model_zoo, run_decoder

from dtbench.decoders.ar import ARParams, Autoregressive
from dtbench.decoders.hf_assisted import HFAssisted, HFAssistedParams
from dtbench.harness.testkit import VOCAB

prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24)
DRAFTS = ["self", "perturbed", "unrelated"]
params_st = st.builds(
    HFAssistedParams,
    num_assistant_tokens=st.integers(1, 8),
    num_assistant_tokens_schedule=st.sampled_from(["constant", "heuristic", "heuristic_transient"]),
    assistant_confidence_threshold=st.sampled_from([0.0, 0.05, 0.4]),
)


pytestmark = pytest.mark.usefixtures("one_thread")


def _untouched(target, draft):
    return (
        "_get_candidate_generator" not in target.__dict__
        and draft.generation_config.eos_token_id == 2
        and all(
            getattr(draft.generation_config, name, None) is None
            for name in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
        )
    )


@pytest.mark.parametrize("kind", DRAFTS)
@settings(max_examples=20, deadline=None)
@given(prompt=prompts, T=st.integers(1, 48), params=params_st)
def test_lossless_vs_ar(kind, prompt, T, params):
    target, draft = model_zoo()[kind]
    steps = list(HFAssisted(target, draft, params).generate(torch.tensor([prompt]), T))
    tokens = [t for s in steps for t in s.tokens]
    assert tokens == run_decoder(Autoregressive(target, None, ARParams()), prompt, T)
    assert len(tokens) == T  # transformers never overshoots
    for s in steps:
        assert s.accepted == len(s.tokens) - 1 <= s.drafted == s.depth
        if params.num_assistant_tokens_schedule == "constant":
            assert s.drafted <= params.num_assistant_tokens
    assert _untouched(target, draft)


def test_equals_transformers_greedy():
    target, draft = model_zoo()["perturbed"]
    prompt = [5, 17, 33, 2, 9]
    assert run_decoder(HFAssisted(target, draft, HFAssistedParams()), prompt, 40) == hf_greedy(target, prompt, 40)


def test_drafted_counts_follow_the_settings():
    """A perfect draft (the target itself), threshold off, constant schedule: every verification drafts exactly
    num_assistant_tokens (fewer only at the end) and accepts them all."""
    target, draft = model_zoo()["self"]
    params = HFAssistedParams(num_assistant_tokens=4, assistant_confidence_threshold=0.0)
    steps = list(HFAssisted(target, draft, params).generate(torch.tensor([[7, 8, 9]]), 23))
    assert [s.drafted for s in steps] == [4, 4, 4, 4, 2]
    assert [len(s.tokens) for s in steps] == [5, 5, 5, 5, 3]


def test_draft_ignores_eos_too():
    """Drafts neither stop at nor avoid EOS (id 2, frequent in these tiny models): a perfect draft with a constant
    schedule is always fully accepted."""
    target, draft = model_zoo()["self"]
    params = HFAssistedParams(num_assistant_tokens=3, assistant_confidence_threshold=0.0)
    prompt = [4, 5]
    assert 2 in run_decoder(Autoregressive(target, None, ARParams()), prompt, 30)
    steps = list(HFAssisted(target, draft, params).generate(torch.tensor([prompt]), 30))
    assert all(s.accepted == s.drafted for s in steps)


def test_heuristic_schedule_restarts_every_call():
    """transformers persists the adapted num_assistant_tokens on the assistant's config; hf_assisted restores
    it, so the same prompt drafts the same way every time."""
    target, draft = model_zoo()["self"]
    params = HFAssistedParams(
        num_assistant_tokens=2, num_assistant_tokens_schedule="heuristic", assistant_confidence_threshold=0.0
    )
    runs = [[s.drafted for s in HFAssisted(target, draft, params).generate(torch.tensor([[4, 5]]), 30)] for _ in "ab"]
    assert runs[0] == runs[1] and runs[0][:3] == [2, 4, 6]  # a perfect draft: +2 per fully accepted round
    assert _untouched(target, draft)


def test_lockstep_worker_waits_for_the_consumer():
    """While the consumer holds a Step (the runner timestamps it), the worker runs no further target forward."""
    target, draft = model_zoo()["perturbed"]
    calls = []
    handle = target.register_forward_hook(lambda *args: calls.append(1))
    try:
        seen = []
        for _step in HFAssisted(target, draft, HFAssistedParams(num_assistant_tokens=3)).generate(
            torch.tensor([[3, 4, 5]]), 12
        ):
            before = len(calls)
            time.sleep(0.02)
            assert len(calls) == before
            seen.append(before)
        assert seen == sorted(seen) and len(set(seen)) == len(seen)  # one verification per Step
        assert len(calls) == len(seen)
    finally:
        handle.remove()


def test_forwards_run_in_the_measuring_thread_and_early_close_stops_the_call():
    """generate() runs in a greenlet of the caller's thread (a worker thread made every forward 20-30% slower on
    CPU); closing the Step iterator early ends the call within the current iteration and undoes its changes."""
    target, draft = model_zoo()["perturbed"]
    threads = []
    handles = [m.register_forward_pre_hook(lambda *a: threads.append(threading.get_ident())) for m in (target, draft)]
    try:
        before = threading.active_count()
        gen = HFAssisted(target, draft, HFAssistedParams()).generate(torch.tensor([[3, 4, 5]]), 500)
        next(gen)
        next(gen)
        at_close = len(threads)
        gen.close()
    finally:
        for h in handles:
            h.remove()
    assert threads and set(threads) == {threading.get_ident()}
    assert len(threads) - at_close <= 2 * (HFAssistedParams().num_assistant_tokens + 1)  # at most one more round
    assert threading.active_count() == before
    assert _untouched(target, draft)


def test_errors_inside_generate_reach_the_consumer(monkeypatch):
    target, draft = model_zoo()["unrelated"]

    def broken(*args, **kwargs):
        raise RuntimeError("draft exploded")

    monkeypatch.setattr(draft, "generate", broken)
    with pytest.raises(RuntimeError, match="draft exploded"):
        list(HFAssisted(target, draft, HFAssistedParams()).generate(torch.tensor([[3, 4, 5]]), 10))
    monkeypatch.undo()
    assert _untouched(target, draft)


def test_needs_a_draft_and_validates_params():
    target, _ = model_zoo()["self"]
    with pytest.raises(ValueError, match="draft"):
        HFAssisted(target, None, HFAssistedParams())
    with pytest.raises(ValueError):
        HFAssistedParams(num_assistant_tokens_schedule="dynamic")
    with pytest.raises(ValueError):
        HFAssistedParams(num_assistant_tokens=5, k=3)
    assert HFAssistedParams().model_dump() == {
        "num_assistant_tokens": 20,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.4,
    }
