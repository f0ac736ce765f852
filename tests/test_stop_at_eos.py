"""Stop at EOS (issue 21): every decoder's output equals greedy AR cut after the first EOS, even when a draft chain or
a tree path crosses EOS, and no token after EOS is emitted or counted (the shared loops cut; the runner cuts too).

The EOS id is drawn from the model's own greedy continuation (any token can play EOS: the loops only compare ids),
so EOS lands anywhere, including inside accepted drafts (a draft equal to the target accepts whole chains and trees).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import examples, model_zoo, run_decoder

from dtbench.decoders.ar import Autoregressive
from dtbench.decoders.base import Step, cut_at_eos, eos_ids
from dtbench.decoders.dynatree import DynaTree, DynaTreeParams
from dtbench.decoders.fixed_tree import FixedTree, FixedTreeParams
from dtbench.decoders.hf_assisted import HFAssisted, HFAssistedParams, HFGenerate, HFGenerateParams
from dtbench.decoders.linear import LinearParams, LinearSpeculative
from dtbench.decoders.lookahead import Lookahead
from dtbench.decoders.ngram import Ngram, NgramParams
from dtbench.decoders.rest import Rest, RestParams
from dtbench.decoders.streaming import StreamingAR, StreamingParams, StreamingSpecParams, StreamingSpeculative
from dtbench.decoders.suffix import SuffixDecoding, SuffixParams
from dtbench.decoders.token_recycling import TokenRecycling
from dtbench.harness.measurement.measure import measure
from dtbench.testing.fixtures import VOCAB

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")

T = 40
prompts = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=16)


def decoders(target, draft):
    """Every built-in decoder that runs on the tiny models without extra files (medusa: below)."""
    out = {
        "ar": Autoregressive(target, None, Autoregressive.Params()),
        "linear": LinearSpeculative(target, draft, LinearParams(k=5)),
        "fixed_tree": FixedTree(target, draft, FixedTreeParams(depth=4, branching=2, tau=0.0)),
        "fixed_tree_rebuild": FixedTree(
            target,
            draft,
            FixedTreeParams(depth=3, branching=2, tau=0.0, cache_strategy="rebuild", draft_strategy="per_node"),
        ),
        "dynatree": DynaTree(
            target,
            draft,
            DynaTreeParams(tau=0.0, rho_stop=1e-9, rho_deep=1e-6, d0=2, d_max=6, tau_l=0.05, tau_h=0.2, n_max=24),
        ),
        "streaming_ar": StreamingAR(target, None, StreamingParams(sinks=2, window=16)),
        "streaming_spec": StreamingSpeculative(target, draft, StreamingSpecParams(sinks=2, window=16, k=4)),
        "hf_generate": HFGenerate(target, None, HFGenerateParams()),
        "hf_assisted": HFAssisted(target, draft, HFAssistedParams(assistant_confidence_threshold=0.0)),
        "token_recycling": TokenRecycling(target, None, TokenRecycling.Params()),
        "lookahead": Lookahead(target, None, Lookahead.Params()),
    }
    out["ngram"] = Ngram(target, None, NgramParams(k=6, min_n=1))
    out["suffix"] = SuffixDecoding(target, draft, SuffixParams(k=5, min_match=2, fallback="draft"))
    out["rest"] = Rest(target, None, RestParams(tokens=_rest_store(), n_max=12, depth=5))
    if importlib.util.find_spec("dtbench_prompt_lookup") is not None:  # the example plugin, when installed
        from dtbench_prompt_lookup import PromptLookup

        out["prompt_lookup"] = PromptLookup(target, None, PromptLookup.Params(ngram_size=1, num_draft_tokens=6))
    return out


def _rest_store() -> str:
    """A REST tokens file: the target's greedy continuation of a fixed prompt and random documents (made once)."""
    import tempfile
    from pathlib import Path

    import numpy as np

    path = Path(tempfile.gettempdir()) / f"dtbench-eos-rest-{VOCAB}.npy"
    if not path.exists():
        target, _ = model_zoo()["self"]
        prompt = list(range(5, 15))
        rng = np.random.default_rng(0)
        np.save(
            path,
            np.array(
                [
                    *prompt,
                    *run_decoder(Autoregressive(target, None, Autoregressive.Params()), prompt, T),
                    -1,
                    *rng.integers(3, VOCAB, 400),
                ]
            ),
        )
    return str(path)


def greedy_until_eos(reference, prompt, eos):
    """The reference's output (EOS ignored, T tokens) cut after the first ``eos``."""
    return reference[: reference.index(eos) + 1] if eos in reference else reference


def collect(decoder, prompt):
    """All Steps the decoder yields for T (no runner truncation: the loop itself must stop at EOS)."""
    return list(decoder.generate(torch.tensor([prompt]), T))


@pytest.mark.parametrize("kind", ["self", "perturbed"])
@settings(max_examples=examples(8), deadline=None)
@given(prompt=prompts, j=st.integers(0, T - 1))
def test_every_decoder_stops_at_eos(kind, prompt, j):
    target, draft = model_zoo()[kind]
    full = run_decoder(Autoregressive(target, None, Autoregressive.Params()), prompt, T)
    eos = full[j]
    expected = greedy_until_eos(full, prompt, eos)
    for name, dec in decoders(target, draft).items():
        if name.startswith("streaming"):  # streaming_ar is lossy past S + R: streaming_spec must equal it
            expected_here = greedy_until_eos(
                run_decoder(StreamingAR(target, None, StreamingParams(sinks=2, window=16)), prompt, T), prompt, eos
            )
        else:
            expected_here = expected
        dec.eos_token_id = eos
        steps = collect(dec, prompt)
        tokens = [t for s in steps for t in s.tokens]
        assert tokens == expected_here, name
        assert tokens.count(eos) <= 1 and (eos not in tokens or tokens[-1] == eos), name
        for s in steps[1:]:
            assert 0 <= s.accepted <= len(s.tokens) and s.accepted <= s.drafted, name


def test_a_draft_crosses_eos():
    """The property above is not vacuous: with a draft equal to the target, a chain and a tree commit EOS in the
    middle of an iteration's accepted drafts, and the Step is cut right after it (accepted counts drafts kept)."""
    target, draft = model_zoo()["self"]
    prompt = [5, 9, 17, 33]
    full = run_decoder(Autoregressive(target, None, Autoregressive.Params()), prompt, T)
    eos = full[12]
    cut = full[: full.index(eos) + 1]
    for dec in (
        LinearSpeculative(target, draft, LinearParams(k=8)),
        FixedTree(target, draft, FixedTreeParams(depth=8, branching=2, tau=0.0)),
    ):
        uncut = list(dec.generate(torch.tensor([prompt]), T))
        dec.eos_token_id = eos
        steps = collect(dec, prompt)
        assert [t for s in steps for t in s.tokens] == cut
        n = len(steps) - 1
        crossing = uncut[n]  # the same iteration without EOS committed tokens past it
        assert len(crossing.tokens) > len(steps[-1].tokens)
        assert steps[-1].accepted == len(steps[-1].tokens)  # EOS was an accepted draft: no bonus token kept


def test_medusa_tree_drafter_stops_at_eos(tmp_path):
    """The TreeDrafter path of speculate_tree (learned heads) cuts at EOS too; the Oracle plants the target's greedy
    continuation so paths of several tokens are accepted across EOS."""
    from heads_kit import Oracle

    from dtbench.decoders.medusa import MC_SIM_7B_63, MedusaDrafter
    from dtbench.decoders.medusa_head import load_medusa
    from dtbench.decoders.tree import speculate_tree
    from dtbench.testing.fixtures import write_medusa

    target, _ = model_zoo()["self"]
    write_medusa(tmp_path / "head", hidden=target.config.hidden_size, vocab=VOCAB)
    heads = load_medusa(str(tmp_path / "head"), target)
    prompt = [7, 3, 40, 41, 12]
    full = run_decoder(Autoregressive(target, None, Autoregressive.Params()), prompt, T)
    for j in (3, 10, 25):
        eos = full[j]
        oracle = Oracle(MedusaDrafter(heads, MC_SIM_7B_63, target.config.num_hidden_layers), full, plant=(4, 5, 3))
        with torch.inference_mode():
            steps = list(
                speculate_tree(target, None, torch.tensor([prompt]), T, oracle, tree_root="pending", eos_token_id=eos)
            )
        assert [t for s in steps for t in s.tokens] == full[: full.index(eos) + 1]


def test_cut_at_eos():
    step = Step(tokens=(4, 2, 7, 9), drafted=5, accepted=3, depth=5)
    assert cut_at_eos(step, eos_ids(2)) == (Step(tokens=(4, 2), drafted=5, accepted=2, depth=5), True)
    assert cut_at_eos(step, eos_ids((9, 7))) == (Step(tokens=(4, 2, 7), drafted=5, accepted=3, depth=5), True)
    assert cut_at_eos(step, eos_ids(None)) == (step, False)
    assert cut_at_eos(step, eos_ids([50])) == (step, False)


class _RunsPastEos(Autoregressive):
    """A third-party loop that ignores ``eos_token_id``: yields chains of 3 tokens, EOS (2) inside the second."""

    def generate(self, input_ids, max_new_tokens):
        yield Step(tokens=(5,))
        yield Step(tokens=(6, 2, 8), drafted=3, accepted=2, depth=3)
        yield Step(tokens=(9, 10, 11), drafted=3, accepted=2, depth=3)


def test_measure_cuts_a_loop_that_runs_past_eos():
    target, _ = model_zoo()["self"]
    dec = _RunsPastEos(target, None, Autoregressive.Params())
    dec.eos_token_id = 2
    m = measure(dec, [3, 4, 5], 10, torch.device("cpu"))
    assert m.tokens == [5, 6, 2]
    assert [s.tokens for s in m.steps] == [(5,), (6, 2)] and m.steps[-1].accepted == 2
    dec.eos_token_id = None  # the paper's protocol: EOS is a token like any other, T = 10 are required
    with pytest.raises(Exception, match="stopped after 7 of 10"):
        measure(dec, [3, 4, 5], 10, torch.device("cpu"))
