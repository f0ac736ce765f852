"""token_recycling and lookahead (issue 22): lossless on the one tree loop, their state, and the side branch that
lets Lookahead's Jacobi window ride in the verification forward. The greedy property test is parametrized over the
device (issue 38 item 3, ``models.DEVICES``): on CUDA (skipped without one) the same seeded models in float32 token
for token and in float16 under the tie-aware rule."""

from __future__ import annotations

import pytest
import torch
import yaml
from hypothesis import strategies as st
from kit import invoke, one_line_error, write_suite
from models import decoder_steps, device_zoo, model_zoo, run_decoder
from pydantic import ValidationError

from dtbench.decoders import kv
from dtbench.decoders.ar import ARParams, Autoregressive
from dtbench.decoders.lookahead import Lookahead, LookaheadDrafter, LookaheadParams, NgramPool
from dtbench.decoders.token_recycling import TokenRecycling, TokenRecyclingDrafter, TokenRecyclingParams
from dtbench.decoders.tree import TokenTree, attention_mask_kind, tree_logits
from dtbench.testing.fixtures import ARCHS, SHARP, VOCAB

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")

random_prompts = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=20)
repeating_prompts = st.builds(
    lambda unit, times: unit * times, st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=5), st.integers(2, 6)
)
PARAMS = {
    "token_recycling": st.builds(
        dict, k=st.sampled_from([8, 10]), cache_strategy=st.sampled_from(["compact", "rebuild"])
    ),
    "lookahead": st.builds(
        dict,
        window_size=st.integers(2, 6),
        ngram_size=st.integers(2, 5),
        guess_set_size=st.integers(1, 6),
        pool_from_prompt=st.booleans(),
        cache_strategy=st.sampled_from(["compact", "rebuild"]),
    ),
}
DECODERS = {"token_recycling": TokenRecycling, "lookahead": Lookahead}


def build(name, params, arch="llama", sharpness=SHARP, device="cpu", dtype=torch.float64):
    target, _ = device_zoo(device, dtype, arch=arch, sharpness=sharpness)["self"]
    cls = DECODERS[name]
    return target, cls(target, None, cls.Params(**params))


@pytest.mark.parametrize(
    "name, params",
    [
        ("token_recycling", {}),
        ("lookahead", {}),
        ("lookahead", {"window_size": 5, "ngram_size": 3, "guess_set_size": 5}),
    ],
)
@pytest.mark.parametrize("arch", ARCHS)
def test_proposals_are_made_accepted_and_rejected(name, params, arch):
    """On repeating and non-repeating contexts drafts are made, and some are accepted whole, some cut short."""
    drafted = accepted = full = cut = 0
    for prompt in ([5, 9, 14, 20] * 4, list(range(30, 50)), [7, 3, 61, 44, 12, 90, 33]):
        target, dec = build(name, params, arch)
        steps = decoder_steps(dec, prompt, 48)
        assert [t for s in steps for t in s.tokens][:48] == run_decoder(
            Autoregressive(target, None, ARParams()), prompt, 48
        )
        for s in steps[1:]:
            drafted += s.drafted
            accepted += s.accepted
            full += s.depth > 0 and s.accepted == s.depth
            cut += s.drafted > 0 and s.accepted < s.depth  # partly or not at all accepted
    assert drafted > 0 and accepted > 0 and full > 0 and cut > 0


def test_recycling_refreshes_the_matrix_from_every_verified_node():
    drafter = TokenRecyclingDrafter(VOCAB, 3, [[0], [1], [0, 0]], torch.device("cpu"))
    tree = TokenTree(5, 3, 4, "cpu")
    drafter.draft(tree, 5, 2)
    assert tree.size == 1  # the matrix is empty: nothing to draft
    logits = torch.zeros(1, VOCAB)
    logits[0, [40, 41, 42]] = torch.tensor([3.0, 2.0, 1.0])
    drafter.feed_logits(tree, logits, None)
    assert drafter.adjacency[5].tolist() == [40, 41, 42]
    drafter.adjacency[40] = torch.tensor([7, 8, 9], dtype=torch.int32)
    tree = TokenTree(5, 3, 4, "cpu")
    drafter.draft(tree, 5, 2)
    assert tree.tokens[: tree.size].tolist() == [5, 40, 41, 7] and tree.parents[: tree.size].tolist() == [0, 0, 0, 1]
    tree = TokenTree(5, 3, 4, "cpu")
    drafter.draft(tree, 5, 1)  # depth cap
    assert tree.tokens[: tree.size].tolist() == [5, 40, 41]
    # token 5 fed at two nodes: its row comes from the later one (BFS order)
    tree = TokenTree(5, 3, 4, "cpu")
    drafter.draft(tree, 5, 2)
    tree.tokens[3] = 5
    logits = torch.zeros(4, VOCAB)
    logits[0, [1, 2, 3]] = torch.tensor([3.0, 2.0, 1.0])
    logits[3, [60, 61, 62]] = torch.tensor([3.0, 2.0, 1.0])
    drafter.feed_logits(tree, logits, None)
    assert drafter.adjacency[5].tolist() == [60, 61, 62]


def test_recycling_params_and_state():
    with pytest.raises(ValidationError, match="below k"):
        TokenRecyclingParams(k=4)  # the 2.2.2 template uses ranks up to 7
    with pytest.raises(ValidationError):
        TokenRecyclingParams(template=[[0, 1]])  # no parent path [0]
    assert TokenRecycling.verify_sizes(TokenRecyclingParams()) == (0, 81)
    _, dec = build("token_recycling", {})
    decoder_steps(dec, [5, 6, 7] * 3, 12)
    state = dec.state_stats()
    assert state["adjacency_bytes"] == VOCAB * 8 * 4 and 0 < state["adjacency_rows"] <= VOCAB


def test_ngram_pool_keeps_the_newest_per_key():
    pool = NgramPool(2)
    pool.add_text([1, 2, 3, 1, 4, 5, 1, 2, 3], 3)
    assert pool.candidates(1) == [(4, 5), (2, 3)]  # (2, 3) refreshed by its second occurrence
    pool.add(1, (6, 7))
    assert pool.candidates(1) == [(2, 3), (6, 7)] and pool.ngrams == 2 + 2 + 1 + 1


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_side_branch_logits_equal_sequential_ones(arch, attn):
    """Every window token's logits equal those of a plain forward over its own context (prefix, root, then its
    column: the reference's mask and positions), and the tree's logits are unchanged by the side branch."""
    target, _ = model_zoo(attn=attn, arch=arch, sharpness=SHARP)["self"]
    atol = 1e-9 if attn == "sdpa" else 1e-5  # eager takes its softmax in float32 (differences ~1e-7)
    prompt = [11, 12, 13, 14, 15]
    drafter = LookaheadDrafter(prompt, 4, 4, 3, False, 0)
    drafter.levels = [[20, 21, 22], [30, 31, 32, 33], [40, 41, 42, 43]]
    drafter.pool.add(9, (50, 51, 52))
    drafter.pool.add(9, (50, 53, 54))
    tree = TokenTree(9, drafter.n_max, drafter.n_max + 1, "cpu")
    drafter.draft(tree, 9, 3)
    assert tree.tokens[: tree.size].tolist() == [9, 50, 51, 53, 52, 54]
    side = drafter.side_branch()
    cache, _ = kv.prefill(target, torch.tensor([prompt]))
    kind = attention_mask_kind(target)
    with torch.no_grad():
        both = tree_logits(target, cache, tree, kind, side=side)
        cache2, _ = kv.prefill(target, torch.tensor([prompt]))
        alone = tree_logits(target, cache2, tree, kind)
    assert torch.allclose(both[: tree.size], alone, atol=atol)
    assert kv.cache_len(cache) == len(prompt) + tree.size + side.size
    col0 = [9, 20, 21, 22]
    contexts = [col0[: j + 2] for j in range(3)]  # level 0: root and its own prefix
    contexts += [col0[: i + 1] + [drafter.levels[m][i] for m in range(1, lv + 1)] for lv in (1, 2) for i in range(4)]
    for row, context in enumerate(contexts):
        with torch.no_grad():
            ref = target(input_ids=torch.tensor([prompt + context])).logits[0, -1]
        assert torch.allclose(both[tree.size + row], ref, atol=atol), (row, context)


def test_lookahead_window_fills_then_yields_ngrams():
    target, _ = model_zoo(sharpness=SHARP)["self"]
    drafter = LookaheadDrafter([3, 4, 5, 6], 3, 4, 5, False, 0)
    dec = Lookahead(target, None, LookaheadParams(window_size=3, ngram_size=4))
    dec.drafter = drafter
    sizes, gen = [], torch.Generator().manual_seed(0)
    for _ in range(4):
        side = drafter.side_branch()
        tree = TokenTree(7, 1, 2, "cpu")
        sizes.append((side.size, drafter.pool.ngrams))
        drafter.feed_logits(tree, torch.randn(1, VOCAB, generator=gen), torch.randn(side.size, VOCAB, generator=gen))
    assert sizes == [(2, 0), (5, 0), (8, 0), (8, 3)]  # levels of W - 1, then W tokens; 3 (= W) n-grams per step
    assert all(len(c) == 3 for c in drafter.pool.candidates(7))
    assert dec.state_stats() == {"pool_ngrams": 6, "pool_tokens": 24, "window_tokens": 8}
    assert Lookahead.verify_sizes(LookaheadParams()) == (0, 1 + 15 * 4 + 14 + 3 * 15)


@pytest.mark.parametrize("name", list(DECODERS))
def test_sampling_is_refused_at_validation(tmp_path, name):
    suite = {
        "name": "s",
        "seed": 0,
        "device": "cpu",
        "target": {"model": "smollm2-135m", "dtype": "float32"},
        "datasets": [{"name": "wikitext-2", "prompts": 1, "warmup": 0, "L_max": 16}],
        "generation_lengths": [4],
        "sampling": {"temperature": 0.7},
        "decoders": [{"name": "ar"}, {"name": name}],
    }
    one_line_error(invoke("validate", write_suite(tmp_path, yaml.safe_dump(suite))), name, "does not support sampling")
