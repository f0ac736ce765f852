"""Lossless property tests the conformance kit does not make (issue 56 moved `linear`, `hf_assisted` and `hf_generate`
equal `ar` into it: tests/test_conformance.py): `ar` equals transformers' greedy generate; `streaming_spec` equals
`streaming_ar` (a reference other than `ar`, lossy by declaration); `streaming_ar` with nothing evicted equals `ar`.

Parametrized over the device (issue 38 item 3, ``models.DEVICES``): CPU float64 as always; on CUDA (skipped without
one) the same seeded pairs in float32 token for token and in float16 under the tie-aware rule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import DEVICES, assert_lossless, device_zoo, examples, hf_greedy, model_zoo, run_decoder

from dtbench.decoders.ar import ARParams, Autoregressive
from dtbench.decoders.hf_assisted import HFAssisted, HFAssistedParams
from dtbench.decoders.linear import LinearParams, LinearSpeculative
from dtbench.decoders.streaming import StreamingAR, StreamingParams, StreamingSpecParams, StreamingSpeculative
from dtbench.testing.fixtures import VOCAB

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")

prompts = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=24)
DRAFTS = ["self", "perturbed", "unrelated"]


@pytest.mark.parametrize("on", DEVICES)
@settings(max_examples=examples(25), deadline=None)
@given(prompt=prompts, T=st.integers(1, 40))
def test_ar_equals_hf_generate(on, prompt, T):
    device, dtype, rule = on
    target, _ = device_zoo(device, dtype)["self"]
    out = run_decoder(Autoregressive(target, None, ARParams()), prompt, T)
    assert_lossless(target, prompt, out, hf_greedy(target, prompt, T), rule)


def _steps(decoder, prompt, T):
    n = 0
    for step in decoder.generate(torch.tensor([prompt], device=decoder.target.device), T):
        yield step
        n += len(step.tokens)
        if n >= T:
            return


def test_acceptance_depends_on_the_draft():
    """The three drafts span full, partial and (almost) no acceptance, so the properties above exercise all paths."""
    rates = {}
    prompt = list(range(5, 25))
    for kind in DRAFTS:
        target, draft = model_zoo()[kind]
        steps = list(_steps(LinearSpeculative(target, draft, LinearParams(k=4)), prompt, 64))[1:]
        rates[kind] = sum(s.accepted for s in steps) / sum(s.drafted for s in steps)
    assert rates["self"] == 1.0
    assert 0.1 < rates["perturbed"] < 1.0
    assert rates["unrelated"] < rates["perturbed"]


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 4, 7])
def test_linear_equals_ar_on_smollm2(smollm2, data_dir, k):
    target, draft, tok = smollm2
    text = (data_dir / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")[2000:3000]
    prompt = tok.encode(text)[:48]
    ar = run_decoder(Autoregressive(target, None, ARParams()), prompt, 32)
    assert run_decoder(LinearSpeculative(target, draft, LinearParams(k=k)), prompt, 32) == ar
    assert ar == hf_greedy(target, prompt, 32)


# --- the decoders a GPU user meets first (issue 47): transformers' pair and the StreamingLLM pair, on every device ---


@pytest.mark.parametrize("on", DEVICES)
@settings(max_examples=examples(10), deadline=None)
@given(prompt=prompts, T=st.integers(1, 40), sinks=st.integers(0, 4))
def test_streaming_ar_with_a_window_wider_than_the_text_equals_ar(on, prompt, T, sinks):
    """Nothing evicted (S + R >= prompt + T): the StreamingLLM cache is the full cache, so streaming_ar is ar."""
    device, dtype, rule = on
    target, _ = device_zoo(device, dtype)["self"]
    ar = run_decoder(Autoregressive(target, None, ARParams()), prompt, T)
    params = StreamingParams(sinks=sinks, window=len(prompt) + T)
    assert_lossless(target, prompt, run_decoder(StreamingAR(target, None, params), prompt, T), ar, rule)


@pytest.mark.parametrize("on", DEVICES)
@pytest.mark.parametrize("kind", DRAFTS)
@settings(max_examples=examples(10), deadline=None)
@given(prompt=prompts, T=st.integers(1, 40), k=st.integers(1, 6), sinks=st.integers(0, 3), window=st.integers(4, 24))
def test_streaming_spec_equals_streaming_ar(on, kind, prompt, T, k, sinks, window):
    """streaming_spec equals its reference, streaming_ar with the same S and R. Under the exact rule with evicting
    windows; under the tie-aware rule (fp16) with a window wider than the text, because that rule recomputes the
    target's full-attention argmax, which an evicting window does not compute."""
    device, dtype, rule = on
    target, draft = device_zoo(device, dtype)[kind]
    if rule != "exact":
        window = len(prompt) + T
    ref = run_decoder(StreamingAR(target, None, StreamingParams(sinks=sinks, window=window)), prompt, T)
    spec = StreamingSpeculative(target, draft, StreamingSpecParams(sinks=sinks, window=window, k=k))
    assert_lossless(target, prompt, run_decoder(spec, prompt, T), ref, rule)


@pytest.mark.parametrize("on", DEVICES)
def test_hf_assisted_after_another_decoder_and_after_a_first_prompt(on):
    """The two orders in which hf_assisted crashed on CUDA when generate ran in a greenlet (issues 38, 47): after
    another decoder in the same process, and on its second prompt. Both through the measurement loop, as a cell runs."""
    from dtbench.harness.measurement.measure import measure

    device, dtype, rule = on
    target, draft = device_zoo(device, dtype)["perturbed"]
    dev = torch.device(device)
    first, second = list(range(3, 20)), [7, 9, 11, 13, 5, 3]
    measure(LinearSpeculative(target, draft, LinearParams(k=4)), first, 24, dev)  # another decoder first
    for prompt in (first, second):  # then a first prompt and a second one
        m = measure(HFAssisted(target, draft, HFAssistedParams(num_assistant_tokens=4)), prompt, 24, dev)
        ar = run_decoder(Autoregressive(target, None, ARParams()), prompt, 24)
        assert_lossless(target, prompt, m.tokens, ar, rule)
        assert [r.target_forwards for r in m.records] == [1] * len(m.steps)
