"""Lossless property tests: `ar` equals transformers' greedy generate, `linear` equals `ar`, token for token.

Parametrized over the device (issue 38 item 3, ``models.DEVICES``): CPU float64 as always; on CUDA (skipped without
one) the same seeded pairs in float32 token for token and in float16 under the tie-aware rule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import DEVICES, assert_lossless, device_zoo, examples, hf_greedy, model_zoo, run_decoder

from dtbench.decoders.ar import ARParams, Autoregressive
from dtbench.decoders.linear import LinearParams, LinearSpeculative
from dtbench.harness.testkit import VOCAB

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


@pytest.mark.parametrize("on", DEVICES)
@pytest.mark.parametrize("kind", DRAFTS)
@settings(max_examples=examples(20), deadline=None)
@given(prompt=prompts, T=st.integers(1, 48), k=st.integers(1, 8))
def test_linear_equals_ar(on, kind, prompt, T, k):
    device, dtype, rule = on
    target, draft = device_zoo(device, dtype)[kind]
    ar = run_decoder(Autoregressive(target, None, ARParams()), prompt, T)
    dec = LinearSpeculative(target, draft, LinearParams(k=k))
    steps = list(_steps(dec, prompt, T))
    tokens = [t for s in steps for t in s.tokens][:T]
    assert_lossless(target, prompt, tokens, ar, rule)
    for s in steps[1:]:
        assert 0 <= s.accepted <= s.drafted <= k
        assert len(s.tokens) == s.accepted + 1  # accepted drafts plus the bonus token
    if kind == "self":  # a draft equal to the target is always right
        assert all(s.accepted == s.drafted for s in steps[1:])


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
