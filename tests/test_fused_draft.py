"""The draft phase as one compiled region (issue 46 item 2; ``linear``'s ``fused_draft``, decoders/draft_region.py).

A fused chain must change nothing but how the K draft forwards are launched: the same tokens as eager ``ar`` (float64
tiny models: no near ties), the same draft forwards counted at the same sizes and KV positions by the measurement's
hooks, no recompile once the compile step ran, no graph break, at most one host read per iteration. One execution
and K = 2 for the whole module: each region graph unrolls K draft forwards and compiles once here.
"""

from __future__ import annotations

from functools import cache
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import COMPILED_MAX_LEN, assert_lossless, examples, model_zoo, run_decoder

from dtbench.decoders import draft_region, static_kv
from dtbench.decoders.ar import ARParams, Autoregressive
from dtbench.decoders.chain import DRAFT_FEEDS
from dtbench.decoders.linear import LinearParams, LinearSpeculative
from dtbench.harness.measurement import host_reads
from dtbench.harness.measurement.measure import measure
from dtbench.testing.fixtures import VOCAB

TIER = "full"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")

K = 2
EXECUTION = static_kv.Execution(max_len=COMPILED_MAX_LEN)
PROMPT = list(range(3, 30))


@cache
def _pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The float64 perturbed pair with what a fused K = 2 cell's compile step compiles: the target's buckets up to
    K + 1, the draft's feeds, the draft's K-chain regions."""
    target, draft = model_zoo()["perturbed"]
    EXECUTION.precompile([target], K + 1)
    EXECUTION.precompile([draft], 0, sizes=DRAFT_FEEDS)
    draft_region.precompile_chain(EXECUTION, draft, K)
    return target, draft


def _linear(fused: bool) -> LinearSpeculative:
    target, draft = _pair()
    return LinearSpeculative(target, draft, LinearParams(k=K, fused_draft=fused))


def _compiled(run):
    """``run()`` in the module's compiled execution: (its result, graphs compiled meanwhile, fused regions run)."""
    with (
        static_kv.compiled(EXECUTION),
        mock.patch.object(draft_region, "draft_chain", wraps=draft_region.draft_chain) as spy,
    ):
        EXECUTION.begin_sample()
        before = static_kv.compiled_graphs()
        out = run()
        return out, static_kv.compiled_graphs() - before, spy.call_count


@settings(max_examples=examples(8), deadline=None)
@given(prompt=st.lists(st.integers(3, VOCAB - 1), min_size=2, max_size=20), T=st.integers(1, 40))
def test_a_fused_draft_chain_equals_eager_ar_without_recompiling(prompt, T):
    target, _ = _pair()
    ar = run_decoder(Autoregressive(target, None, ARParams()), prompt, T)
    tokens, recompiles, fused = _compiled(lambda: run_decoder(_linear(True), prompt, T))
    assert_lossless(target, prompt, tokens, ar, "exact")
    assert recompiles == 0  # the compile step's graphs (precompile_chain) serve every sample
    if T >= 12:  # a full chain (K drafts) after the draft's prefill iteration runs fused
        assert fused > 0


def test_the_hooks_count_the_same_draft_forwards_fused_or_not():
    """As a cell measures (the runner's forward counter and timer installed): fused, the draft's forwards are counted
    with the same new tokens and KV positions as one by one, and their seconds are the regions' (not zero)."""

    def measured(fused: bool):
        return _compiled(lambda: measure(_linear(fused), PROMPT, 30, torch.device("cpu")))

    (one_by_one, _, none), (fused, recompiles, regions) = measured(False), measured(True)
    assert none == 0 and regions >= 3 and recompiles == 0
    assert fused.tokens == one_by_one.tokens
    assert [r.draft_fed for r in fused.records] == [r.draft_fed for r in one_by_one.records]
    assert [r.draft_forwards for r in fused.records] == [r.draft_forwards for r in one_by_one.records]
    assert sum(r.draft_forwards for r in fused.records) > regions  # K forwards per region, not one
    assert fused.forward_s is not None and (fused.forward_s["draft"] or 0) > 0


def test_a_fused_chain_reads_the_host_once_per_iteration_and_never_breaks_its_graph():
    import torch._dynamo.utils as dynamo_utils

    _pair()
    dynamo_utils.counters["graph_break"].clear()  # only these: the run summary counts inductor's graphs (conftest)
    counts = host_reads.reads_per_iteration(_linear(True), PROMPT, 30, torch.device("cpu"), EXECUTION, counted=True)
    assert counts["host_reads"] and max(counts["host_reads"]) <= 1, counts["host_reads"]
    assert dict(dynamo_utils.counters["graph_break"]) == {}


def test_every_hook_fires_once_per_fused_forward():
    """Hooks taking kwargs and hooks that do not, pre and post: K calls each per region, pre-hooks before it."""
    target, draft = _pair()
    calls: list[str] = []
    handles = [
        draft.register_forward_pre_hook(lambda m, a: calls.append("pre")),
        draft.register_forward_pre_hook(
            lambda m, a, kw: calls.append(f"pre{kw['input_ids'].shape[-1]}"), with_kwargs=True
        ),
        draft.register_forward_hook(lambda m, a, out: calls.append("post")),
    ]
    try:
        with torch.inference_mode(), static_kv.compiled(EXECUTION):
            EXECUTION.begin_sample()
            cache = static_kv.StaticKV(EXECUTION)
            cache.forward(draft, torch.tensor([PROMPT]), None, None, True)
            calls.clear()
            drafts = draft_region.draft_chain(cache, draft, [5, 6], K)
    finally:
        for h in handles:
            h.remove()
    assert drafts.shape == (K,) and drafts.dtype == torch.long
    assert calls == ["pre", "pre2", "pre", "pre1", "post", "post"]
    assert cache.length == len(PROMPT) + 2 + K - 1


def test_a_fused_chain_refuses_what_it_cannot_run():
    _, draft = _pair()
    with torch.inference_mode(), static_kv.compiled(EXECUTION):
        EXECUTION.begin_sample()
        cache = static_kv.StaticKV(EXECUTION)
        with pytest.raises(ValueError, match="prefilled cache"):
            draft_region.draft_chain(cache, draft, [5], K)  # the prefill runs eager, never fused
        cache.forward(draft, torch.tensor([PROMPT]), None, None, True)
        with pytest.raises(ValueError, match="feed of 1 or 2"):
            draft_region.draft_chain(cache, draft, [5, 6, 7], K)
        cache.length = EXECUTION.max_len - 1
        with pytest.raises(ValueError, match="is full"):
            draft_region.draft_chain(cache, draft, [5, 6], K)
