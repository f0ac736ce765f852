"""hf_assisted: transformers' assisted generation is lossless vs ar, yields one Step per verification stamped with
its commit time (Step.at), runs in the measuring thread, propagates errors, and leaves the models as it found them."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import examples, model_zoo, run_decoder

from dtbench.decoders.ar import ARParams, Autoregressive
from dtbench.decoders.hf_assisted import HFAssisted, HFAssistedParams
from dtbench.testing.fixtures import VOCAB

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

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
@settings(max_examples=examples(20), deadline=None)
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


def test_each_step_is_stamped_between_its_verification_and_the_next():
    """Every Step carries its commit time (Step.at, issue 47): after its own target verification returned and before
    the next one was called; one verification per Step."""
    target, draft = model_zoo()["perturbed"]
    calls: list[tuple[str, float]] = []
    handles = [
        target.register_forward_pre_hook(lambda *a: calls.append(("call", time.perf_counter()))),
        target.register_forward_hook(lambda *a: calls.append(("return", time.perf_counter()))),
    ]
    try:
        steps = list(
            HFAssisted(target, draft, HFAssistedParams(num_assistant_tokens=3)).generate(torch.tensor([[3, 4, 5]]), 12)
        )
    finally:
        for h in handles:
            h.remove()
    returns = [t for kind, t in calls if kind == "return"]
    starts = [t for kind, t in calls if kind == "call"]
    assert len(returns) == len(steps) and all(s.at is not None for s in steps)
    for i, step in enumerate(steps):
        assert returns[i] <= step.at
        if i + 1 < len(starts):
            assert step.at <= starts[i + 1]


def test_measured_like_any_decoder_one_verification_per_iteration():
    """Through the one timing loop (measure): each iteration's record holds exactly its own target verification,
    the iteration times are the Steps' commit times from the start, and every forward is counted once."""
    from dtbench.harness.measurement.measure import measure

    target, draft = model_zoo()["perturbed"]
    m = measure(HFAssisted(target, draft, HFAssistedParams(num_assistant_tokens=3)), [3, 4, 5], 12, torch.device("cpu"))
    assert [r.target_forwards for r in m.records] == [1] * len(m.steps)
    assert sum(r.draft_forwards for r in m.records) >= sum(s.drafted for s in m.steps) > 0
    times = m.step_times
    assert all(0 < a < b for a, b in zip(times, times[1:], strict=False))
    assert len(m.tokens) == 12


def test_forwards_run_in_the_measuring_thread():
    """generate() runs in the caller's thread, as a user calls it: no worker thread (a worker thread made every
    forward 20-30% slower on CPU) and no greenlet (it segfaulted on CUDA); the models are left as found."""
    target, draft = model_zoo()["perturbed"]
    threads = []
    handles = [m.register_forward_pre_hook(lambda *a: threads.append(threading.get_ident())) for m in (target, draft)]
    try:
        before = threading.active_count()
        gen = HFAssisted(target, draft, HFAssistedParams()).generate(torch.tensor([[3, 4, 5]]), 30)
        next(gen)
        assert threading.active_count() == before
        gen.close()
    finally:
        for h in handles:
            h.remove()
    assert threads and set(threads) == {threading.get_ident()}
    assert _untouched(target, draft)
    import dtbench.decoders.hf_assisted as module

    assert "greenlet" not in module.__dict__


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
