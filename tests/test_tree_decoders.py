"""Tree decoders on real (tiny, seeded, float64) models: tree-masked verification, losslessness against ``ar``
and transformers' greedy generate, forward counts per cache strategy, and the embedded SmolLM2 pair (slow).
"""

from __future__ import annotations

import copy
import itertools
from functools import cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import examples, hf_greedy, model_zoo, run_decoder

from dtbench.decoders import kv
from dtbench.decoders import tree as T
from dtbench.decoders.ar import Autoregressive
from dtbench.decoders.dynatree import DynaTree, DynaTreeParams
from dtbench.decoders.fixed_tree import FixedTree, FixedTreeParams
from dtbench.decoders.tree import verify as loop  # select_path is looked up where the tree verification calls it
from dtbench.testing.fixtures import ARCHS, FLAT, SHARP, VOCAB

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

ATTNS = ["sdpa", "eager"]
KINDS = ["self", "perturbed", "unrelated"]
COMBOS = list(itertools.product(["compact", "rebuild"], ["per_level", "per_node"]))
SHAPES = list(itertools.product(["paper", "pending"], ["leaf", "skip"]))  # (tree_root, prune)
DECODERS = {"fixed_tree": FixedTree, "dynatree": DynaTree}


@cache
def ar_tokens(attn: str, prompt: tuple[int, ...], n: int, arch: str = "llama", sharpness: float = FLAT) -> list[int]:
    target = model_zoo(attn, arch, sharpness)["self"][0]
    out = run_decoder(Autoregressive(target, None, Autoregressive.Params()), list(prompt), n)
    assert out == hf_greedy(target, list(prompt), n)  # the reference itself is transformers' greedy output
    return out


def all_steps(decoder, prompt, n):
    return list(decoder.generate(torch.tensor([prompt]), n))


def check_steps(steps, n, params):
    """Step counters obey the contract; exactly n tokens, no over-generation. (Forward passes are not Step
    fields any more: test_target_forwards_per_iteration counts them with hooks.)"""
    assert steps[0].tokens and steps[0].drafted == 0
    assert sum(len(s.tokens) for s in steps) == n
    for s in steps[1:]:
        assert s.accepted == len(s.tokens) - 1
        assert s.drafted <= params.n_max
        assert s.accepted <= s.depth <= s.drafted
    return [t for s in steps for t in s.tokens]


def fixed_params(data, n_max_cap=48):
    return dict(
        depth=data.draw(st.integers(1, 8), label="depth"),
        branching=data.draw(st.integers(1, 4), label="B"),
        tau=data.draw(st.sampled_from([0.0, 1e-4, 1e-2, 0.05, 0.1]), label="tau"),
        n_max=data.draw(st.integers(1, n_max_cap), label="n_max"),
    )


def dynatree_params(data, n_max_cap=48):
    """Valid DynaTree params scaled to the tiny models' flat distributions (max probability ~0.05-0.15), so
    every breadth band, early stopping and deep expansion all occur."""
    b = sorted(data.draw(st.lists(st.integers(1, 4), min_size=3, max_size=3), label="B"))
    tl, th = sorted(data.draw(st.lists(st.floats(0.02, 0.3), min_size=2, max_size=2, unique=True), label="tau_lh"))
    rs, rd = sorted(data.draw(st.lists(st.floats(-9, -1), min_size=2, max_size=2, unique=True), label="log_rho"))
    d_max = data.draw(st.integers(2, 8), label="d_max")
    return dict(
        dynamic_breadth=data.draw(st.booleans()),
        dynamic_depth=data.draw(st.booleans()),
        history_adaptation=data.draw(st.booleans()),
        b_min=b[0],
        b_mid=b[1],
        b_max=b[2],
        branching=data.draw(st.integers(1, 3)),
        tau_l=tl,
        tau_h=th,
        d0=data.draw(st.integers(1, d_max - 1)),
        d_max=d_max,
        rho_stop=10**rs,
        rho_deep=10**rd,
        tau=data.draw(st.sampled_from([0.0, 1e-7, 1e-4, 1e-2])),
        n_max=data.draw(st.integers(1, n_max_cap)),
        window=data.draw(st.integers(1, 6)),
        node_acceptance=data.draw(st.floats(0.05, 0.95)),
        eta_depth=data.draw(st.floats(0.1, 4.0)),
        eta_h=data.draw(st.floats(0.01, 1.0)),
    )


PARAMS = {"fixed_tree": fixed_params, "dynatree": dynatree_params}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models, one thread


# ---------------------------------------------------------------------------------------------- verification


def random_bfs_tree(data, max_nodes=14):
    """(parents, depths) of a random tree numbered breadth-first (parents[0] = -1, parents[i] < i)."""
    n = data.draw(st.integers(1, max_nodes), label="nodes")
    parents = [-1] + [data.draw(st.integers(max(0, i - 4), i - 1)) for i in range(1, n)]
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    order = sorted(range(n), key=lambda i: (depths[i], i))
    pos = {u: k for k, u in enumerate(order)}
    return [-1] + [pos[parents[u]] for u in order[1:]], [depths[u] for u in order]


@settings(max_examples=examples(25), deadline=None)
@given(st.data(), st.sampled_from(ATTNS))
def test_tree_masked_forward_equals_sequential_decoding(data, attn):
    """Tree mask + position ids + cache: each node's logits are those of its root-to-node path decoded alone;
    and ``kv.keep_positions`` of a path leaves exactly the cache of the sequential path."""
    target = model_zoo(attn)["self"][0]
    prompt = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12), label="prompt")
    parents, depths = random_bfs_tree(data)
    n = len(parents)
    tokens = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n), label="tokens")
    tree = T.TokenTree(tokens[0], n, n, "cpu")
    for i in range(1, n):
        tree.add(torch.tensor([parents[i]]), torch.tensor([tokens[i]]), torch.zeros(1), torch.zeros(1), depths[i])

    cache, _ = kv.prefill(target, torch.tensor([prompt]))
    mask = T.tree_attention_mask(tree.ancestors(), len(prompt), T.attention_mask_kind(target), target.dtype)
    logits = kv.forward(
        target,
        tree.tokens[:n].unsqueeze(0),
        cache,
        position_ids=T.tree_position_ids(tree.depths[:n], len(prompt)),
        attention_mask=mask,
    )

    def path_to(u):
        p = [u]
        while parents[p[-1]] >= 0:
            p.append(parents[p[-1]])
        return p[::-1]

    # eager attention computes its softmax in float32 even for float64 models (transformers), sdpa in float64
    tol = 1e-5 if attn == "eager" else 1e-9
    for u in range(n):
        seq = prompt + [tokens[v] for v in path_to(u)]
        ref = target(torch.tensor([seq])).logits[0, -1]
        assert torch.allclose(logits[u], ref, atol=tol, rtol=0), (logits[u] - ref).abs().max()

    cache2, _ = kv.prefill(target, torch.tensor([prompt]))
    pred = T.tree_predictions(target, cache2, tree, T.attention_mask_kind(target))
    assert torch.equal(pred, logits.argmax(-1))
    end = data.draw(st.integers(0, n - 1), label="end")
    path = path_to(end)
    kv.keep_positions(cache2, len(prompt), [len(prompt) + v for v in path])
    ref_cache, _ = kv.prefill(target, torch.tensor([prompt + [tokens[v] for v in path]]))
    for got, want in zip(cache2.layers, ref_cache.layers):
        assert torch.allclose(got.keys, want.keys, atol=tol, rtol=0)
        assert torch.allclose(got.values, want.values, atol=tol, rtol=0)


@settings(max_examples=examples(25), deadline=None)
@given(st.data(), st.sampled_from(ATTNS))
def test_draft_session_matches_sequential_decoding(data, attn):
    """The draft cache: root forward, tree-masked feeds (whole levels or single nodes, as the two drafting
    strategies do) give each node its sequential logits; commit keeps exactly the committed path's KV."""
    model = model_zoo(attn)["unrelated"][1]
    tol = 1e-5 if attn == "eager" else 1e-9
    prompt = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10), label="prompt")
    root = data.draw(st.integers(0, VOCAB - 1), label="root")
    parents, depths = random_bfs_tree(data)
    n = len(parents)
    tokens = [root] + data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n - 1, max_size=n - 1), label="tok")
    tree = T.TokenTree(root, n, n, "cpu")
    for i in range(1, n):
        tree.add(torch.tensor([parents[i]]), torch.tensor([tokens[i]]), torch.zeros(1), torch.zeros(1), depths[i])

    def path_to(u):
        p = [u]
        while parents[p[-1]] >= 0:
            p.append(parents[p[-1]])
        return p[::-1]

    def sequential(u):
        return model(torch.tensor([prompt + [tokens[v] for v in path_to(u)]])).logits[0, -1]

    session = T.DraftSession(model, prompt)
    assert torch.allclose(session.start(root)[-1], sequential(0), atol=tol, rtol=0)
    expanded = sorted({parents[i] for i in range(1, n)} - {0})  # ancestor-closed, breadth-first
    for d in sorted({depths[u] for u in expanded}):
        level = [u for u in expanded if depths[u] == d]
        groups = [level] if data.draw(st.booleans(), label="per_level") else [[u] for u in level]
        for group in groups:
            logits, _ = session.feed(tree, group, d)
            for row, u in zip(logits, group):
                assert torch.allclose(row, sequential(u), atol=tol, rtol=0)
    end = data.draw(st.integers(0, n - 1), label="end")
    path = path_to(end)
    committed = [tokens[v] for v in path[1:]] + [data.draw(st.integers(0, VOCAB - 1), label="bonus")]
    session.commit(root, path, committed)
    kept = len(path) - 1 - len(session.backlog)
    assert session.backlog == committed[kept:-1] and all(u in expanded for u in path[1 : kept + 1])
    ref_cache, _ = kv.prefill(model, torch.tensor([prompt + [root] + committed[:kept]]))
    for got, want in zip(session.cache.layers, ref_cache.layers):
        assert got.keys.shape == want.keys.shape
        assert torch.allclose(got.keys, want.keys, atol=tol, rtol=0)
        assert torch.allclose(got.values, want.values, atol=tol, rtol=0)


# ---------------------------------------------------------------------------------------------- losslessness


def tree_guaranteed(params, n) -> bool:
    """Whether the rules guarantee a non-empty tree in some iteration of an n-token generation: n >= 3 leaves a
    drafted token to verify in the first iteration, and its first level is never empty with the paper's
    root (u0 is always drafted), with leaf pruning (the top child is kept as a leaf), or with tau < 1/VOCAB
    (the top child's probability is at least 1/VOCAB)."""
    return n >= 3 and (params.tree_root == "paper" or params.prune == "leaf" or params.tau < 1 / VOCAB)


@pytest.mark.full  # every strategy x arch x draft; the fast tier's tree losslessness: tests/test_conformance.py
@pytest.mark.parametrize("name", list(DECODERS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("arch", ARCHS)
@settings(max_examples=examples(3), deadline=None)
@given(data=st.data())
def test_lossless_every_strategy(arch, attn, kind, name, data):
    """fixed_tree / dynatree x {compact, rebuild} x {per_level, per_node} x tree_root {paper, pending} x prune
    {leaf, skip} reproduce ar (= hf greedy) exactly, on float64 Llama- and GPT-NeoX-style models, with drafts
    that accept all (self), some (perturbed) and almost nothing (unrelated), flat or sharp distributions; and
    trees were actually drafted and verified."""
    sharpness = data.draw(st.sampled_from([FLAT, SHARP]), label="sharpness")
    target, draft = model_zoo(attn, arch, sharpness)[kind]
    prompt = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24), label="prompt")
    n = data.draw(st.integers(1, 40), label="T")
    base = PARAMS[name](data)
    ref = ar_tokens(attn, tuple(prompt), n, arch, sharpness)
    cls = DECODERS[name]
    for (cache_strategy, draft_strategy), (tree_root, prune) in itertools.product(COMBOS, SHAPES):
        params = cls.Params(
            **base, cache_strategy=cache_strategy, draft_strategy=draft_strategy, tree_root=tree_root, prune=prune
        )
        steps = all_steps(cls(target, draft, params), prompt, n)
        assert check_steps(steps, n, params) == ref, params
        if tree_guaranteed(params, n):
            assert sum(s.drafted for s in steps) > 0, params
        if kind == "self":  # the draft is the target: every drafted top-1 chain is accepted
            assert all(s.accepted >= 1 for s in steps[1:] if s.drafted and tree_root == "paper"), params


@pytest.mark.parametrize("arch", ARCHS)
def test_default_params_are_lossless(arch):
    """The decoders' defaults (the paper's: tree_root=paper, prune=leaf, tau=0.1, D_0=5, D_max=8, ...) on sharp
    test models, whose confident drafts pass the paper's thresholds: lossless, real trees drafted (several
    nodes per iteration on average), and the self / perturbed drafts accept tokens."""
    for attn, kind, (name, cls) in itertools.product(ATTNS, KINDS, DECODERS.items()):
        target, draft = model_zoo(attn, arch, SHARP)[kind]
        prompt = [3, 14, 15, 92, 65, 35]
        steps = all_steps(cls(target, draft, cls.Params()), prompt, 30)
        assert check_steps(steps, 30, cls.Params()) == ar_tokens(attn, tuple(prompt), 30, arch, SHARP)
        iters = steps[1:]
        assert sum(s.drafted for s in iters) >= 2 * len(iters), (attn, kind, name)
        if kind != "unrelated":
            assert sum(s.accepted for s in iters) >= len(iters), (attn, kind, name)


@pytest.mark.parametrize("arch", ARCHS)
def test_paper_root_and_leaf_pruning_shape_the_trees(arch):
    """On the same prompt: a paper-rooted tree has one more level of depth than a pending-rooted one for the
    same D (u0 at depth 0), leaf pruning verifies the children below tau that skip never creates, and when the
    target rejects u0 the iteration commits exactly the target's own token (accepted 0)."""
    target, draft = model_zoo("sdpa", arch, SHARP)["unrelated"]
    prompt, n = [5, 17, 29, 41, 53], 30
    sizes, depths = {}, {}
    for tree_root, prune in SHAPES:
        params = FixedTreeParams(depth=3, branching=3, tau=0.1, tree_root=tree_root, prune=prune)
        steps = all_steps(FixedTree(target, draft, params), prompt, n)
        assert check_steps(steps, n, params) == ar_tokens("sdpa", tuple(prompt), n, arch, SHARP)
        sizes[tree_root, prune] = sum(s.drafted for s in steps)
        depths[tree_root, prune] = max(s.depth for s in steps)
        if tree_root == "paper":
            assert all(s.depth <= 4 for s in steps) and depths[tree_root, prune] == 4
            rejected = [s for s in steps[1:] if s.accepted == 0]
            assert rejected and all(len(s.tokens) == 1 for s in rejected)
        else:
            assert all(s.depth <= 3 for s in steps)
    for root in ("paper", "pending"):
        assert sizes[root, "leaf"] > sizes[root, "skip"] > 0


# ---------------------------------------------------------------------------------------------- forward counts


class ForwardLog:
    """Records the input length of every top-level forward of a model (a forward hook, removed on exit)."""

    def __init__(self, model):
        self.model, self.lengths = model, []

    def __enter__(self):
        self.handle = self.model.register_forward_hook(
            lambda m, args, kwargs, out: self.lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
        )
        return self

    def __exit__(self, *exc):
        self.handle.remove()


@pytest.mark.parametrize("kind", ["perturbed", "unrelated"])
@pytest.mark.parametrize("name", list(DECODERS))
@pytest.mark.parametrize("arch", ARCHS)
def test_target_forwards_per_iteration(arch, kind, name):
    """compact: exactly one target forward per iteration, over [root + tree]; rebuild: that one plus the
    re-run of [root + accepted path]. Counted by hooking the target's forward, not by timing."""
    target, draft = model_zoo("sdpa", arch)[kind]
    prompt, n = [7, 1, 44, 90, 12, 5, 61, 33], 40
    extra = (
        dict(depth=5, branching=3, tau=0.0, n_max=60)
        if name == "fixed_tree"
        else dict(tau_h=0.12, tau_l=0.06, rho_stop=1e-7, rho_deep=1e-5, tau=0.0, n_max=60)
    )
    cls = DECODERS[name]
    draft_forwards = {}
    for cache_strategy, draft_strategy in COMBOS:
        params = cls.Params(cache_strategy=cache_strategy, draft_strategy=draft_strategy, **extra)
        with ForwardLog(target) as tlog, ForwardLog(draft) as dlog:
            steps = all_steps(cls(target, draft, params), prompt, n)
        iters = steps[1:]
        assert check_steps(steps, n, params) == ar_tokens("sdpa", tuple(prompt), n, arch)
        assert tlog.lengths[0] == len(prompt)  # prefill
        if cache_strategy == "compact":
            assert len(tlog.lengths) == 1 + len(iters)
            assert tlog.lengths[1:] == [s.drafted + 1 for s in iters]
        else:
            assert len(tlog.lengths) == 1 + 2 * len(iters)
            assert tlog.lengths[1::2] == [s.drafted + 1 for s in iters]
            assert tlog.lengths[2::2] == [s.accepted + 1 for s in iters]
        assert sum(s.drafted for s in iters) > 2 * len(iters)  # real trees were verified
        draft_forwards[cache_strategy, draft_strategy] = len(dlog.lengths)
        if draft_strategy == "per_level":  # one draft forward per tree level (the root's included)
            assert len(dlog.lengths) <= sum(s.depth + 1 for s in iters)
    for cs in ("compact", "rebuild"):
        assert draft_forwards[cs, "per_node"] > draft_forwards[cs, "per_level"]


# ---------------------------------------------------------------------------------------------- behaviour


@pytest.mark.parametrize("attn", ATTNS)
def test_self_draft_accepts_the_whole_top1_chain(attn):
    """With the target as its own draft, every iteration commits the deepest drafted level: a decoder that
    never accepted (or mis-indexed the tree) would still be lossless, but would fail this."""
    target, draft = model_zoo(attn)["self"]
    for params in (
        FixedTreeParams(depth=4, branching=2, tau=0.0, n_max=40),
        FixedTreeParams(depth=6, branching=3, tau=0.0, n_max=20, draft_strategy="per_node"),
    ):
        steps = all_steps(FixedTree(target, draft, params), [9, 8, 7, 6], 50)
        assert all(s.accepted == s.depth for s in steps[1:])
        assert sum(s.accepted for s in steps) >= 35


def test_accepted_paths_use_side_branches(monkeypatch):
    """With a perturbed draft, some committed path goes through a non-top-1 child: the tree (not just its
    top-1 chain) is verified and its branches' KV entries are kept correctly (output still equals ar)."""
    target, draft = model_zoo("sdpa")["perturbed"]
    side = []
    real = T.select_path

    def spy(tokens, parents, depths, ancestors, pred):
        path, committed = real(tokens, parents, depths, ancestors, pred)
        par = parents.tolist()
        first_child = {}
        for i in range(1, len(par)):
            first_child.setdefault(par[i], i)
        side.append(any(first_child[par[u]] != u for u in path[1:]))
        return path, committed

    monkeypatch.setattr(loop, "select_path", spy)  # where the tree verification looks it up
    for cache_strategy, draft_strategy in COMBOS:
        params = FixedTreeParams(
            depth=5, branching=3, tau=0.0, n_max=80, cache_strategy=cache_strategy, draft_strategy=draft_strategy
        )
        for prompt in ([1, 2, 3, 4, 5], [50, 60, 70, 80]):
            side.clear()
            assert run_decoder(FixedTree(target, draft, params), prompt, 60) == ar_tokens("sdpa", tuple(prompt), 60)
            assert any(side), (cache_strategy, draft_strategy, prompt)


@pytest.mark.full  # every strategy x arch x draft; the fast tier's tree losslessness: tests/test_conformance.py
@pytest.mark.parametrize("kind", KINDS)
def test_dynatree_without_components_is_the_fixed_tree(kind):
    target, draft = model_zoo("sdpa")[kind]
    off = dict(dynamic_breadth=False, dynamic_depth=False, history_adaptation=False)
    for (d0, branching, tau, n_max), (tree_root, prune) in itertools.product(
        ((3, 2, 0.0, 30), (5, 3, 1e-3, 64), (2, 1, 0.0, 5), (3, 3, 0.02, 40)), SHAPES
    ):
        shape = dict(tree_root=tree_root, prune=prune)
        dyn = DynaTree(
            target,
            draft,
            DynaTreeParams(**off, **shape, d0=d0, d_max=d0 + 1, branching=branching, tau=tau, n_max=n_max),
        )
        fixed = FixedTree(target, draft, FixedTreeParams(**shape, depth=d0, branching=branching, tau=tau, n_max=n_max))
        prompt = [4, 40, 80, 20]
        assert all_steps(dyn, prompt, 45) == all_steps(fixed, prompt, 45)


def test_history_adaptation_acts_and_resets_per_generate():
    target, draft = model_zoo("sdpa")["perturbed"]
    base = dict(
        tau=0.0,
        rho_stop=1e-9,
        rho_deep=1e-6,
        tau_h=0.12,
        tau_l=0.06,
        n_max=64,
        d0=4,
        d_max=8,
        node_acceptance=0.9,
        eta_depth=2.0,
        eta_h=0.5,
        window=3,
    )
    adaptive = DynaTree(target, draft, DynaTreeParams(**base))
    static = DynaTree(target, draft, DynaTreeParams(**base, history_adaptation=False))
    prompt = [11, 22, 33, 44, 55]
    first = all_steps(adaptive, prompt, 50)
    assert [s.drafted for s in first] != [s.drafted for s in all_steps(static, prompt, 50)]
    assert all_steps(adaptive, prompt, 50) == first  # no adapted state leaks into the next generate()
    policy = adaptive.make_policy()
    for s in first[1:]:
        policy.observe(s)
    # low acceptance: more conservative (shallower, and both thresholds up: wider nodes)
    assert policy.d0 < base["d0"] and policy.tau_h > base["tau_h"] and policy.tau_l > base["tau_l"]
    fresh = adaptive.make_policy()
    assert (fresh.d0, fresh.tau_h, fresh.tau_l) == (base["d0"], base["tau_h"], base["tau_l"])
    fixed_l = DynaTree(target, draft, DynaTreeParams(**base, adapt_tau_l=False)).make_policy()
    for s in first[1:]:
        fixed_l.observe(s)
    assert fixed_l.tau_l == base["tau_l"] and fixed_l.tau_h == policy.tau_h


def test_flash_attention_is_rejected_clearly():
    target, draft = model_zoo("sdpa")["perturbed"]
    flash = copy.deepcopy(target)
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='sdpa' or 'eager'"):
        all_steps(FixedTree(flash, draft, FixedTreeParams()), [1, 2, 3], 5)


# ---------------------------------------------------------------------------------------------- SmolLM2 (slow)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DECODERS))
def test_smollm2_pair_is_lossless(name, smollm2):
    """fp32 target, bf16 draft (tests/conftest.py): acceptance is decided by the fp32 target, so equal to ar."""
    target, draft, tokenizer = smollm2
    text = "The history of the city begins in the early Middle Ages, when a small settlement grew around"
    prompt = tokenizer(text).input_ids
    n = 24
    ref = run_decoder(Autoregressive(target, None, Autoregressive.Params()), prompt, n)
    cls = DECODERS[name]
    accepted = 0
    for cache_strategy, draft_strategy in COMBOS:
        params = cls.Params(cache_strategy=cache_strategy, draft_strategy=draft_strategy)
        steps = all_steps(cls(target, draft, params), prompt, n)
        assert check_steps(steps, n, params) == ref, (cache_strategy, draft_strategy)
        accepted += sum(s.accepted for s in steps)
    assert accepted >= 4 * n / 2  # the bf16 draft agrees with the fp32 target most of the time
