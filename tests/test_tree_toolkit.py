"""Pure tests of the tree toolkit (decoders/tree/__init__.py); DynaTree's rules are in test_dynatree_rules.py. No language
model involved.

Every property is checked against an independent brute-force reference written here, not against the
implementation's own helpers.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import examples
from pydantic import ValidationError

from dtbench.decoders import tree as T
from dtbench.decoders.dynatree import DynamicPolicy, DynaTreeParams
from dtbench.decoders.fixed_tree import FixedPolicy, FixedTreeParams

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

FAST = settings(max_examples=examples(60), deadline=None)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models, one thread


# ---------------------------------------------------------------------------------------------- helpers


@st.composite
def bfs_parents(draw, max_nodes: int = 40):
    """Parent arrays of BFS-ordered trees: node 0 the root, each node's parent a node of the previous level."""
    n = draw(st.integers(1, max_nodes))
    parents, prev_level = [-1], [0]
    while len(parents) < n:
        level = []
        width = draw(st.integers(1, n - len(parents)))
        for p in sorted(draw(st.lists(st.sampled_from(prev_level), min_size=width, max_size=width))):
            parents.append(p)  # children of a level in parent order: index order is BFS order
            level.append(len(parents) - 1)
        prev_level = level
    return parents


def depths_of(parents):
    d = [0] * len(parents)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return d


def ancestors_brute(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


def build_tree(parents, tokens, n_max=None) -> T.TokenTree:
    """A TokenTree holding the given BFS tree, built only through TokenTree.add (one child at a time)."""
    n = len(parents)
    tree = T.TokenTree(tokens[0], n_max if n_max is not None else n, n, "cpu")
    depths = depths_of(parents)
    for i in range(1, n):
        tree.add(
            torch.tensor([parents[i]]),
            torch.tensor([tokens[i]]),
            torch.tensor([-0.5]),
            torch.tensor([-0.5 * depths[i]]),
            depths[i],
        )
    return tree


# ---------------------------------------------------------------------------------------------- BFS


@FAST
@given(st.data())
def test_bfs_order_puts_parents_before_children(data):
    n = data.draw(st.integers(1, 30))
    perm = data.draw(st.permutations(list(range(n))))  # arbitrary numbering of a random tree
    shape = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, n)]
    parents = [0] * n
    for i in range(n):
        parents[perm[i]] = -1 if shape[i] < 0 else perm[shape[i]]
    order = T.bfs_order(parents)
    assert sorted(order) == list(range(n))
    assert parents[order[0]] == -1
    pos = {u: k for k, u in enumerate(order)}
    depth = {order[0]: 0}
    for u in order[1:]:
        assert pos[parents[u]] < pos[u]
        depth[u] = depth[parents[u]] + 1
    assert [depth[u] for u in order] == sorted(depth[u] for u in order)


def test_bfs_order_rejects_non_trees():
    with pytest.raises(ValueError):
        T.bfs_order([-1, -1])
    with pytest.raises(ValueError):
        T.bfs_order([-1, 2, 1])  # a cycle detached from the root


# ---------------------------------------------------------------------------------------------- mask


@FAST
@given(bfs_parents(), st.integers(0, 7), st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_tree_mask_sees_exactly_prefix_and_ancestors(parents, prefix_len, dtype):
    n = len(parents)
    tree = build_tree(parents, list(range(n)))
    anc = tree.ancestors()
    assert torch.equal(anc, T.ancestor_matrix(torch.tensor([0] + parents[1:])))
    boolean = T.tree_attention_mask(anc, prefix_len, "bool")
    additive = T.tree_attention_mask(anc, prefix_len, "additive", dtype)
    assert boolean.shape == additive.shape == (1, 1, n, prefix_len + n)
    assert boolean.dtype == torch.bool and additive.dtype == dtype
    expected = torch.zeros((n, prefix_len + n), dtype=torch.bool)
    for i in range(n):
        for j in set(range(prefix_len)) | {prefix_len + a for a in ancestors_brute(parents, i)}:
            expected[i, j] = True
    assert torch.equal(boolean[0, 0], expected)
    min_ = torch.tensor(torch.finfo(dtype).min, dtype=dtype)
    assert torch.equal(additive[0, 0], torch.where(expected, torch.zeros((), dtype=dtype), min_))


@FAST
@given(bfs_parents(), st.integers(0, 50))
def test_position_ids_are_prefix_plus_depth(parents, prefix_len):
    tree = build_tree(parents, [0] * len(parents))
    pos = T.tree_position_ids(tree.depths[: tree.size], prefix_len)
    assert pos.shape == (1, len(parents))
    assert pos[0].tolist() == [prefix_len + d for d in depths_of(parents)]
    assert tree.max_depth == max(depths_of(parents))


def test_attention_mask_kind():
    fake = lambda impl: SimpleNamespace(config=SimpleNamespace(_attn_implementation=impl))  # noqa: E731
    assert T.attention_mask_kind(fake("eager")) == "additive"
    assert T.attention_mask_kind(fake("sdpa")) == "bool"
    for impl in ("flash_attention_2", "flash_attention_3", "flex_attention"):
        with pytest.raises(ValueError, match="4D attention mask"):
            T.attention_mask_kind(fake(impl))


def test_token_tree_budget_is_enforced():
    tree = T.TokenTree(7, n_max=2, capacity=10, device="cpu")
    tree.add(torch.tensor([0, 0]), torch.tensor([1, 2]), torch.zeros(2), torch.zeros(2), 1)
    assert tree.budget_left == 0
    with pytest.raises(ValueError):
        tree.add(torch.tensor([1]), torch.tensor([3]), torch.zeros(1), torch.zeros(1), 2)
    nodes = tree.nodes()
    assert [(x.token, x.parent, x.depth) for x in nodes] == [(7, -1, 0), (1, 0, 1), (2, 0, 1)]


@FAST
@given(st.integers(1, 5), st.integers(0, 10), st.integers(1, 300))
def test_tree_capacity(breadth, depth, n_max):
    full = sum(breadth**d for d in range(1, depth + 1))
    assert T.tree_capacity(breadth, depth, n_max) == min(full, n_max) + 1


# ---------------------------------------------------------------------------------------------- path selection


def select_brute(parents, tokens, pred):
    """Enumerate every node's root path; keep the deepest greedy-consistent one (first in BFS on ties)."""
    best = [0]
    for u in range(1, len(parents)):
        path = [u]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        if all(tokens[path[k]] == pred[path[k - 1]] for k in range(1, len(path))) and len(path) > len(best):
            best = path
    return best, [tokens[u] for u in best[1:]] + [pred[best[-1]]]


@settings(max_examples=examples(300), deadline=None)
@given(bfs_parents(), st.integers(1, 4), st.data())
def test_select_path_matches_brute_force(parents, vocab, data):
    n = len(parents)
    tokens = data.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    pred = data.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    tree = build_tree(parents, tokens)
    path, committed = T.select_path(
        tree.tokens[:n], tree.parents[:n], tree.depths[:n], tree.ancestors(), torch.tensor(pred)
    )
    assert (path, committed) == select_brute(parents, tokens, pred)


def test_select_path_fallback_and_bonus():
    # root 0 -> children 1 (token 5), 2 (token 6); 1 -> 3 (token 7)
    parents, tokens = [-1, 0, 0, 1], [9, 5, 6, 7]
    tree = build_tree(parents, tokens)
    args = (tree.tokens[:4], tree.parents[:4], tree.depths[:4], tree.ancestors())
    assert T.select_path(*args, torch.tensor([4, 0, 0, 0])) == ([0], [4])  # no child matches: one token
    assert T.select_path(*args, torch.tensor([6, 0, 8, 0])) == ([0, 2], [6, 8])  # second branch + bonus
    assert T.select_path(*args, torch.tensor([5, 7, 0, 3])) == ([0, 1, 3], [5, 7, 3])  # full depth + bonus


# ---------------------------------------------------------------------------------------------- drafting


class FakeSession:
    """Stands in for DraftSession: logits depend only on (token, depth), so every strategy sees the same."""

    def __init__(self, vocab: int, seed: int, temperature: float):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, 32, vocab, generator=g) * temperature
        self.device = torch.device("cpu")
        self.forwards = 0
        self.root = None

    def start(self, root):
        self.root, self.forwards = root, self.forwards + 1
        return self.table[root, 0].unsqueeze(0)

    def feed(self, tree, nodes, depth):
        self.forwards += 1
        nodes_t = torch.tensor(nodes)
        assert tree.depths[nodes_t].tolist() == [depth] * len(nodes)
        return self.table[tree.tokens[nodes_t], depth], nodes_t


def random_policy(data):
    if data.draw(st.booleans()):
        return FixedPolicy(
            data.draw(st.integers(1, 6)),
            data.draw(st.integers(1, 4)),
            data.draw(st.sampled_from([0.0, 1e-4, 1e-2, 0.1])),
            data.draw(st.integers(1, 80)),
        )
    return DynamicPolicy(random_dynatree_params(data))


def random_dynatree_params(data) -> DynaTreeParams:
    b = sorted(data.draw(st.lists(st.integers(1, 4), min_size=3, max_size=3)))
    tl, th = sorted(data.draw(st.lists(st.floats(0.01, 0.99), min_size=2, max_size=2, unique=True)))
    rs, rd = sorted(data.draw(st.lists(st.floats(1e-8, 0.9), min_size=2, max_size=2, unique=True)))
    d_max = data.draw(st.integers(2, 8))
    return DynaTreeParams(
        dynamic_breadth=data.draw(st.booleans()),
        dynamic_depth=data.draw(st.booleans()),
        history_adaptation=data.draw(st.booleans()),
        b_min=b[0],
        b_mid=b[1],
        b_max=b[2],
        branching=data.draw(st.integers(1, 4)),
        tau_l=tl,
        tau_h=th,
        d0=data.draw(st.integers(1, d_max - 1)),
        d_max=d_max,
        rho_stop=rs,
        rho_deep=rd,
        tau=data.draw(st.sampled_from([0.0, 1e-6, 1e-3, 0.05])),
        n_max=data.draw(st.integers(1, 80)),
        window=data.draw(st.integers(1, 5)),
    )


@settings(max_examples=examples(120), deadline=None)
@given(st.data())
def test_drafted_tree_obeys_rules_and_strategies_agree(data):
    vocab = data.draw(st.integers(2, 12))
    seed = data.draw(st.integers(0, 1000))
    temperature = data.draw(st.sampled_from([0.5, 2.0, 6.0]))
    policy = random_policy(data)
    tree_root = data.draw(st.sampled_from(["paper", "pending"]), label="tree_root")
    prune = data.draw(st.sampled_from(["leaf", "skip"]), label="prune")
    r = T.root_offset(tree_root)
    depth_cap = min(policy.depth_limit + r, data.draw(st.integers(1, 9)))
    root = data.draw(st.integers(0, vocab - 1))
    trees = {}
    for strategy in ("per_level", "per_node"):
        session = FakeSession(vocab, seed, temperature)
        tree = T.TokenTree(root, policy.n_max, T.tree_capacity(policy.max_breadth, depth_cap, policy.n_max), "cpu")
        T.draft_tree(session, tree, root, policy, depth_cap, strategy, tree_root=tree_root, prune=prune)
        trees[strategy] = (tree, session.forwards)
    (tree, lvl_forwards), (tree_n, node_forwards) = trees["per_level"], trees["per_node"]
    nodes = tree.nodes()
    assert nodes == tree_n.nodes()  # same tree, same BFS order
    n = len(nodes)
    assert n - 1 <= policy.n_max
    assert torch.equal(tree.ancestors(), T.ancestor_matrix(tree.parents[:n]))
    table = FakeSession(vocab, seed, temperature).table
    children = {i: [] for i in range(n)}
    for i, u in enumerate(nodes[1:], 1):
        children[u.parent].append(i)
        assert u.parent < i and u.depth == nodes[u.parent].depth + 1 and 1 <= u.depth <= depth_cap
        assert nodes[i - 1].depth <= u.depth  # BFS
        assert math.isclose(u.cum_logp, nodes[u.parent].cum_logp + u.logp, rel_tol=1e-5, abs_tol=1e-5)
        if prune == "skip" and not (tree_root == "paper" and i == 1):
            assert u.cum_logp >= policy.log_tau  # pruned children are never created
    if tree_root == "paper":
        assert n >= 2 and children[0] == [1]  # u0, the draft's top-1 token, is the only first-level node
    budget_hit = n - 1 == policy.n_max
    for i, u in enumerate(nodes):
        lp = torch.log_softmax(table[u.token, u.depth].float(), -1)
        top_lp, top_tok = lp.topk(min(policy.max_breadth, vocab))
        cum = torch.tensor([u.cum_logp], dtype=torch.float32)  # float32 as stored: the same arithmetic
        could_expand = i == 0 or (
            u.depth < depth_cap and u.cum_logp >= policy.log_tau and bool(policy.expandable(u.depth - r, cum))
        )
        kids = children[i]
        if not could_expand:
            assert kids == []  # a leaf: pruned (below tau), gated, or at the depth cap
            continue
        if i == 0 and tree_root == "paper":
            assert [nodes[c].token for c in kids] == [int(top_tok[0])]
            continue
        b = int(policy.breadth(top_lp[:1].exp())[0])
        want = [int(t) for t, c in zip(top_tok[:b], (cum + top_lp)[:b]) if prune == "leaf" or c >= policy.log_tau]
        got = [nodes[c].token for c in kids]
        assert got == want[: len(got)]  # the top-B(u) (unpruned, for skip) tokens, in probability order
        if len(got) < len(want):
            assert budget_hit  # only the budget can cut a node's children short
    # one draft forward per level (root included) vs one per expanded node
    assert lvl_forwards <= tree.max_depth + 1
    assert node_forwards >= lvl_forwards


class ScriptedSession:
    """A draft whose next-token distribution is a function of the drafted path (tokens after the pending one)."""

    def __init__(self, dist, vocab: int):
        self.dist, self.vocab, self.device, self.forwards = dist, vocab, torch.device("cpu"), 0

    def logits(self, path):
        return torch.tensor(self.dist(tuple(path)), dtype=torch.float32).log()

    def start(self, root):
        self.forwards += 1
        return self.logits(()).unsqueeze(0)

    def feed(self, tree, nodes, depth):
        self.forwards += 1
        rows = []
        for u in nodes:
            path = []
            while u:
                path.append(int(tree.tokens[u]))
                u = int(tree.parents[u])
            rows.append(self.logits(path[::-1]))
        return torch.stack(rows), torch.tensor(nodes)


def algorithm1(dist, *, tau, n_max, d0, d_max, rho_stop, rho_deep, breadth):
    """DRAFTTREE of the paper's Algorithm 1 (lines 10-30), transcribed literally: a FIFO frontier, the checks
    in the paper's order at pop time, children added until N_max. Depth d(u) counts from u0 (depth 0).
    Comparisons in log space, as the implementation stores log-probabilities (float32).

    Returns:
        [(token, parent index or -1 for u0, depth)] in insertion (BFS) order.
    """

    def lp(path):
        return torch.tensor(dist(tuple(path)), dtype=torch.float32).log()

    def path_of(i):
        out = []
        while i >= 0:
            out.append(nodes[i][0])
            i = nodes[i][1]
        return out[::-1]

    log_tau = math.log(tau) if tau > 0 else -math.inf
    first = lp(())
    u0 = int(first.argmax())
    nodes = [(u0, -1, 0)]  # line 10
    cum = [first[u0]]
    frontier = [0]  # line 11
    while frontier and len(nodes) < n_max:  # line 12
        u = frontier.pop(0)  # line 13
        tok, _, d = nodes[u]
        if cum[u] < log_tau:  # lines 14-16
            continue
        if d >= d_max:  # lines 17-19
            continue
        if cum[u] < math.log(rho_stop):  # lines 20-22
            continue
        if d >= d0 and cum[u] < math.log(rho_deep):  # lines 23-25
            continue
        q = lp(path_of(u))  # line 26
        b = breadth(float(q.exp().max()))  # line 27
        top = q.topk(min(b, q.numel()))  # a vocabulary smaller than B(u) gives every token
        for logp, v in zip(top.values, top.indices):  # line 28
            if len(nodes) >= n_max:
                break
            nodes.append((int(v), u, d + 1))
            cum.append(cum[u] + logp)
            frontier.append(len(nodes) - 1)
    return nodes


def as_paper_nodes(tree):
    """The drafted nodes of a tree_root=paper tree as [(token, parent, depth)] counted from u0 (paper numbering)."""
    return [(u.token, u.parent - 1, u.depth - 1) for u in tree.nodes()[1:]]


def draft(policy, dist, vocab, strategy, tree_root="paper", prune="leaf", depth_cap=None):
    l_max = depth_cap or policy.depth_limit + T.root_offset(tree_root)
    tree = T.TokenTree(99, policy.n_max, T.tree_capacity(policy.max_breadth, l_max, policy.n_max), "cpu")
    T.draft_tree(ScriptedSession(dist, vocab), tree, 99, policy, l_max, strategy, tree_root=tree_root, prune=prune)
    return tree


HAND = {  # draft distributions over a 5-token vocabulary, keyed by the drafted path
    (): [0.6, 0.3, 0.05, 0.03, 0.02],
    (0,): [0.05, 0.5, 0.3, 0.1, 0.05],
    (0, 1): [0.04, 0.03, 0.2, 0.7, 0.03],
    (0, 2): [0.35, 0.1, 0.05, 0.05, 0.45],
    (1,): [0.5, 0.1, 0.1, 0.2, 0.1],
}


def hand_dist(path):
    return HAND.get(path, [0.2] * 5)


@pytest.mark.parametrize("strategy", ["per_level", "per_node"])
def test_paper_tree_on_a_scripted_draft_by_hand(strategy):
    """Fixed tree D=2, B=2, tau=0.1, worked by hand through Algorithm 1: u0 = 0 (p .6) at depth 0; its
    children 1 (p .3) and 2 (p .18) at depth 1; their children at depth 2 are not expanded (d >= D):
    under 1: 3 (p .21) and 2 (p .06 < tau: a verified leaf); under 2: 4 (p .081) and 0 (p .063), both leaves."""
    policy = FixedPolicy(2, 2, 0.1, 50)
    tree = draft(policy, hand_dist, 5, strategy)
    assert tree.tokens[0] == 99  # the pending token, internal node 0, never drafted or counted
    assert as_paper_nodes(tree) == [
        (0, -1, 0),
        (1, 0, 1),
        (2, 0, 1),
        (3, 1, 2),
        (2, 1, 2),
        (4, 2, 2),
        (0, 2, 2),
    ]
    assert tree.n_drafted == 7 and tree.max_depth == 3  # Step.depth: 3 drafted tokens on the longest path
    # prune=skip drops the three children below tau instead of verifying them
    skip = draft(policy, hand_dist, 5, strategy, prune="skip")
    assert as_paper_nodes(skip) == [(0, -1, 0), (1, 0, 1), (2, 0, 1), (3, 1, 2)]
    # tree_root=pending: the pending token gets B=2 children, depth counts drafted tokens (D=2: two levels)
    pend = draft(policy, hand_dist, 5, strategy, tree_root="pending", prune="skip")
    assert [(u.token, u.parent, u.depth) for u in pend.nodes()[1:]] == [
        (0, 0, 1),
        (1, 0, 1),
        (1, 1, 2),
        (2, 1, 2),
        (0, 2, 2),
    ]
    # the node budget N_max counts u0 and cuts the breadth-first order
    small = draft(FixedPolicy(2, 2, 0.1, 4), hand_dist, 5, strategy)
    assert as_paper_nodes(small) == [(0, -1, 0), (1, 0, 1), (2, 0, 1), (3, 1, 2)]


@settings(max_examples=examples(80), deadline=None)
@given(st.data())
def test_paper_tree_equals_algorithm_1(data):
    """tree_root=paper, prune=leaf builds exactly Algorithm 1's DRAFTTREE (node set, depths, BFS order) for
    random scripted draft distributions, with the fixed tree's and DynaTree's rules (history off: the
    policy's state is constant within one tree)."""
    vocab = data.draw(st.integers(2, 6), label="vocab")
    seed = data.draw(st.integers(0, 10_000), label="seed")
    temperature = data.draw(st.sampled_from([0.5, 1.5, 4.0]), label="temperature")

    def dist(path):
        g = torch.Generator().manual_seed(hash((seed,) + path) % 2**31)
        return torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * temperature, 0).tolist()

    if data.draw(st.booleans(), label="fixed"):
        d, b = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 3))
        policy = FixedPolicy(d, b, data.draw(st.sampled_from([0.0, 0.01, 0.1, 0.3])), data.draw(st.integers(1, 40)))
        rules = dict(d0=d, d_max=d, rho_stop=1e-30, rho_deep=1e-30, breadth=lambda c: b)
    else:
        p = random_dynatree_params(data).model_copy(
            update=dict(history_adaptation=False, dynamic_depth=True, dynamic_breadth=True)
        )
        policy = DynamicPolicy(p)
        rules = dict(
            d0=p.d0,
            d_max=p.d_max,
            rho_stop=p.rho_stop,
            rho_deep=p.rho_deep,
            breadth=lambda c: p.b_min if c >= p.tau_h else p.b_mid if c >= p.tau_l else p.b_max,
        )
    want = algorithm1(dist, tau=policy.tau, n_max=policy.n_max, **rules)
    for strategy in ("per_level", "per_node"):
        assert as_paper_nodes(draft(policy, dist, vocab, strategy)) == want, strategy


# ---------------------------------------------------------------------------------------------- params


def test_params_validation():
    DynaTreeParams()
    FixedTreeParams()
    bad = [
        dict(tau_l=0.9, tau_h=0.4),
        dict(b_min=3, b_mid=2),
        dict(b_mid=4, b_max=3),
        dict(d0=8, d_max=8),
        dict(rho_stop=0.5, rho_deep=0.5),
        dict(tau=1.0),
        dict(n_max=0),
        dict(cache_strategy="x"),
        dict(draft_strategy="x"),
        dict(unknown=1),
    ]
    for kwargs in bad:
        with pytest.raises(ValidationError):
            DynaTreeParams(**kwargs)
    for kwargs in (dict(depth=0), dict(branching=0), dict(tau=-0.1), dict(d0=3)):
        with pytest.raises(ValidationError):
            FixedTreeParams(**kwargs)
    with pytest.raises(ValidationError):
        FixedTreeParams().depth = 3  # frozen


def test_random_params_strategy_is_valid():
    rnd = random.Random(0)
    for _ in range(50):
        b = sorted(rnd.randint(1, 4) for _ in range(3))
        DynaTreeParams(b_min=b[0], b_mid=b[1], b_max=b[2])
