"""Lossless speculative sampling, checked as distributions (issue 13).

On tiny float64 models with a 6-token vocabulary, the exact distribution of the first m = 3 generated tokens under
the target (temperature, top-k, top-p applied in transformers' order) is computed by enumeration; each decoder is
run many times with independent seeded generators and the empirical distribution is compared with the exact one
by a chi-square test (bins with expected count < 5 merged). Each test fails with probability ALPHA = 1e-4 when the
decoder is exact, so the suite's false-failure rate stays well below 1e-3. A deliberately wrong acceptance rule
must fail the same test (a test of the test).
"""

from __future__ import annotations

import itertools
from functools import cache

import pytest
import torch
from scipy import stats

from dtbench.decoders import chain
from dtbench.decoders.ar import ARParams, Autoregressive
from dtbench.decoders.linear import LinearParams, LinearSpeculative
from dtbench.decoders.sampling import SamplingSettings
from dtbench.decoders.streaming import StreamingSpecParams, StreamingSpeculative
from dtbench.testing.common import scratch_root
from dtbench.testing.sampling import ROWS, draw, tiny

TIER = "full"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, M, RUNS, ALPHA = 6, 3, 1500, 1e-4
PROMPT = [1, 4, 2, 5]


@cache
def models():
    import copy

    target = tiny(0)
    perturbed = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    # "deep": a 7-layer target, the fewest an EAGLE-3 head reads (layers 2, L//2, L-3)
    return {"self": target, "perturbed": perturbed, "unrelated": tiny(11, sharpness=4.0), "deep": tiny(5, layers=7)}


@torch.inference_mode()
def exact(settings: SamplingSettings, target_name: str = "self") -> dict[tuple[int, ...], float]:
    """P(x1..xM | PROMPT) under the target's processed distribution, by enumeration."""
    target = models()[target_name]
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=M):
        ids = torch.tensor([PROMPT + list(seq[:-1])])
        probs = settings.probs(target(input_ids=ids).logits[0, len(PROMPT) - 1 :])
        out[seq] = float(torch.prod(torch.stack([probs[i, t] for i, t in enumerate(seq)])))
    return out


def empirical(decoder, settings: SamplingSettings, length: int = M) -> dict[tuple[int, ...], int]:
    """Counts of the first M tokens over RUNS seeded generations of ``length`` >= M tokens (a longer generation
    lets tree decoders draft deeper trees in the first iterations; the first M tokens' law must still be exact),
    drawn by the kit's :func:`~dtbench.testing.sampling.draw`: as the rows of RUNS / ROWS batched generations when
    the decoder declares ``batch_sampling`` (issue 68 item 7; its B = 1 law is the kit's sampling check's), else one
    generation per run."""
    cls = type(decoder)
    return draw(decoder, settings, RUNS, length, ROWS if cls.batching and cls.batch_sampling else 1, PROMPT)


def p_value(decoder, settings: SamplingSettings, length: int = M, target_name: str = "self") -> float:
    """Chi-square p-value of the decoder's empirical distribution against the exact one (of target ``target_name``)."""
    probs = exact(settings, target_name)
    counts = empirical(decoder, settings, length)
    assert set(counts) <= {k for k, v in probs.items() if v > 0}, "a sequence the target cannot produce"
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for key, p in probs.items():
        e = p * RUNS
        if e >= 5:
            observed.append(counts.get(key, 0))
            expected.append(e)
        else:
            rest_o += counts.get(key, 0)
            rest_e += e
    if rest_e > 0:
        observed.append(rest_o)
        expected.append(rest_e)
    scale = sum(observed) / sum(expected)
    return float(stats.chisquare(observed, [e * scale for e in expected]).pvalue)


SETTINGS = {
    "t1": SamplingSettings(temperature=1.0),
    "t0.7-topk4": SamplingSettings(temperature=0.7, top_k=4),
    "topp0.8": SamplingSettings(temperature=1.0, top_p=0.8),
}


def linear(draft: str, k: int = 2):
    return LinearSpeculative(models()["self"], models()[draft], LinearParams(k=k))


def test_ar_samples_the_target_distribution():
    assert p_value(Autoregressive(models()["self"], None, ARParams()), SETTINGS["topp0.8"]) > ALPHA


@pytest.mark.parametrize(
    "draft, setting",
    [
        # ("perturbed", "t1") is the kit's: dtbench check's sampling check (tests/test_conformance_sampling.py)
        ("self", "t1"),
        ("unrelated", "t1"),
        ("perturbed", "t0.7-topk4"),
        ("unrelated", "topp0.8"),
    ],
)
def test_linear_speculative_sampling_is_exact(draft, setting):
    assert p_value(linear(draft), SETTINGS[setting]) > ALPHA


def test_streaming_spec_sampling_is_exact():
    decoder = StreamingSpeculative(
        models()["self"], models()["perturbed"], StreamingSpecParams(sinks=2, window=32, k=2)
    )
    assert p_value(decoder, SETTINGS["t1"]) > ALPHA


def test_a_wrong_acceptance_rule_fails_the_test(monkeypatch):
    """Accepting a draft whenever q(x) >= p(x)... or simply always: the output follows the draft, and the test
    must catch it."""

    def accept_all(drafts, draft_probs, target_probs, generator):
        from dtbench.decoders.sampling import sample

        return len(drafts), (*drafts, sample(target_probs[len(drafts)], generator))

    monkeypatch.setattr(chain, "verify_chain_sampled", accept_all)
    assert p_value(linear("unrelated"), SETTINGS["t1"]) < ALPHA


def test_seeded_sampling_is_reproducible_and_greedy_untouched():
    settings = SETTINGS["t1"]

    def run(seed):
        d = linear("perturbed")
        d.sampling, d.generator = settings, torch.Generator().manual_seed(seed)
        return [t for s in d.generate(torch.tensor([PROMPT]), 12) for t in s.tokens][:12]

    assert run(5) == run(5)
    assert len({tuple(run(s)) for s in range(6)}) > 1
    greedy = [t for s in linear("perturbed").generate(torch.tensor([PROMPT]), 12) for t in s.tokens][:12]
    ar = [
        t
        for s in Autoregressive(models()["self"], None, ARParams()).generate(torch.tensor([PROMPT]), 12)
        for t in s.tokens
    ]
    assert greedy == ar


@pytest.mark.fast  # the module is full tier; these keep its subject in the fast tier
def test_processing_matches_transformers_warpers():
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for t, k, p in ((0.7, 10, 0.9), (1.3, 0, 0.5), (1.0, 3, 1.0)):
        warpers = (
            [TemperatureLogitsWarper(t)]
            + ([TopKLogitsWarper(k)] if k else [])
            + ([TopPLogitsWarper(p)] if p < 1 else [])
        )
        expected = torch.softmax(LogitsProcessorList(warpers)(None, logits.clone()), dim=-1)
        assert torch.allclose(SamplingSettings(t, k, p).probs(logits), expected, atol=1e-12)


def test_suite_sampling_through_the_runner(tmp_path, data_dir):
    """`sampling:` in a suite: stored on each cell, same seed -> same outputs in two runs, report verdict
    'sampled', greedy override per decoder, and decoders without sampling refused before any model loads."""
    from kit import invoke, one_line_error, suite_dict, tiny_pair, write_suite
    from sqlalchemy import select

    from dtbench.harness.store import db

    pair = tiny_pair(tmp_path / "models")
    decoders = [
        {"name": "ar"},
        {"name": "linear", "params": {"k": 2}},
        {"name": "linear", "label": "greedy", "params": {"k": 2}, "sampling": "greedy"},
    ]
    suite = suite_dict(*pair, decoders, sampling={"temperature": 0.8, "top_k": 20})
    outputs = []
    for name in ("a.db", "b.db"):
        result = invoke(
            "run",
            write_suite(tmp_path, suite),
            "--db",
            str(tmp_path / name),
            "--data-dir",
            str(data_dir),
            "--no-progress",
        )
        assert result.exit_code == 0, result.output
        with db.connect(str(tmp_path / name))() as s:
            rows = s.execute(
                select(
                    db.Cell.label, db.Cell.sampling, db.Sample.prompt_index, db.Sample.output_tokens, db.Sample.lossless
                ).join(db.Sample)
            ).all()
        outputs.append(sorted((r[0], r[2], tuple(r[3])) for r in rows))
        sampling = {r[0]: r[1] for r in rows}
        assert sampling["linear"] == {"temperature": 0.8, "top_k": 20, "top_p": 1.0, "seed": None}
        assert sampling["greedy"] is None and sampling["ar (greedy)"] is None  # its own greedy reference
        assert all(r[4] is None for r in rows if r[1])  # a sampled output is never checked against one draw
        assert all(r[4] is True for r in rows if r[0] == "greedy")
    assert outputs[0] == outputs[1]
    assert "sampled (exact by construction, distribution-tested)" in result.stdout
    bad = suite_dict(
        *pair,
        [{"name": "hf_generate"}, {"name": "fixed_tree", "params": {"prune": "skip"}}],
        sampling={"temperature": 0.8},
    )
    one_line_error(
        invoke("validate", write_suite(tmp_path, bad, "bad.yaml")),
        "decoders.1",
        "decoder 'fixed_tree': prune: skip drops drafted children",
    )


@pytest.mark.parametrize("name", ["hf_generate", "hf_assisted"])
def test_transformers_decoders_sample_the_target_distribution(name):
    """hf_generate (transformers' generate(do_sample=True)) is the reference for ar's sampling; hf_assisted is
    transformers' own speculative sampling: both must match the enumerated distribution too."""
    from dtbench.decoders.hf_assisted import HFAssisted, HFAssistedParams, HFGenerate, HFGenerateParams

    if name == "hf_generate":
        decoder = HFGenerate(models()["self"], None, HFGenerateParams())
    else:
        decoder = HFAssisted(
            models()["self"],
            models()["perturbed"],
            HFAssistedParams(num_assistant_tokens=2, assistant_confidence_threshold=0.0),
        )
    assert p_value(decoder, SETTINGS["t0.7-topk4"]) > ALPHA


def test_speedups_pair_cells_that_decode_the_same_way(tmp_path):
    """A sampled decoder's speedup is against the AR cell sampled with the same settings, not the greedy one."""
    import reportdb

    from dtbench.harness.store import db
    from dtbench.reports.views.compare import speedup_table
    from dtbench.reports.views.summary import samples_frame, summarize

    sessions = db.connect(str(tmp_path / "r.db"))
    hot = {"temperature": 0.7, "top_k": 0, "top_p": 1.0, "seed": None}
    with sessions() as s:
        run = reportdb.add_run(s)
        for label, dec, sampling, thr in (
            ("AR", "ar", None, 10.0),
            ("AR hot", "ar", hot, 8.0),
            ("Lin", "linear", None, 15.0),
            ("Lin hot", "linear", hot, 10.0),
        ):
            reportdb.add_samples(s, reportdb.add_cell(s, run, label, dec, sampling=sampling), [thr] * 6, warmup=1)
        s.commit()
        frame = samples_frame(s, run.id)
    speedup = summarize(frame).set_index("label")["speedup"]
    assert speedup["Lin"] == pytest.approx(1.5) and speedup["Lin hot"] == pytest.approx(1.25)
    assert speedup["AR hot"] == pytest.approx(1.0)
    table = speedup_table(frame).set_index("label")
    assert table.loc["Lin hot", "speedup"] == pytest.approx(1.25) and "AR hot" not in table.index


# ----------------------------------------------------------------------------------------------------------
# Tree decoders: multi-draft speculative sampling (children drawn without replacement, recursive rejection)
# ----------------------------------------------------------------------------------------------------------

TREE_LENGTH = 7  # the first tree after the prefill may then hold paths of up to 5 drafted tokens


def fixed_tree(draft: str, **params):
    from dtbench.decoders.fixed_tree import FixedTree, FixedTreeParams

    return FixedTree(models()["self"], models()[draft], FixedTreeParams(**{"tau": 0.0, **params}))


def dynatree(draft: str, **params):
    from dtbench.decoders.dynatree import DynaTree, DynaTreeParams

    return DynaTree(models()["self"], models()[draft], DynaTreeParams(**params))


TREES = {
    # paper-rooted (u0 one draw), B = 2 children drawn without replacement per node, depth 3
    "fixed-paper-B2": lambda d: fixed_tree(d, depth=3, branching=2),
    # pending-rooted, B = 3, budget N_max = 4 cuts the second level short (a parent keeps a prefix of its draws)
    "fixed-pending-B3-budget4": lambda d: fixed_tree(d, depth=3, branching=3, tree_root="pending", n_max=4),
    # the paper's per-node drafting, leaf pruning at tau = 0.3 (low-probability children stay verified leaves)
    "fixed-per-node-tau0.3": lambda d: fixed_tree(d, depth=3, branching=2, draft_strategy="per_node", tau=0.3),
    # rebuild cache strategy (two target forwards per iteration)
    "fixed-rebuild": lambda d: fixed_tree(d, depth=2, branching=2, cache_strategy="rebuild"),
    # DynaTree with its confidence-driven breadth (B_max 3) and depth gating, history adaptation on
    "dynatree": lambda d: dynatree(d, b_max=3, n_max=12),
}


@pytest.mark.parametrize(
    "tree, draft, setting",
    [
        # the perturbed draft at t = 1 of fixed_tree (paper root, rebuild cache) and dynatree is the kit's sampling
        # check over their declared settings (tests/test_conformance_sampling.py); here the shapes it does not draw
        ("fixed-paper-B2", "self", "t1"),
        ("fixed-paper-B2", "unrelated", "t1"),
        ("fixed-pending-B3-budget4", "perturbed", "t0.7-topk4"),
        ("fixed-per-node-tau0.3", "unrelated", "topp0.8"),
        ("dynatree", "unrelated", "t0.7-topk4"),
        ("dynatree", "self", "topp0.8"),
    ],
)
def test_tree_speculative_sampling_is_exact(tree, draft, setting):
    decoder = TREES[tree](draft)
    assert p_value(decoder, SETTINGS[setting], TREE_LENGTH) > ALPHA


def test_tree_sampling_drafts_real_trees():
    """The distribution tests above are not vacuous: the sampled trees hold several children per node and
    several levels, and drafts are accepted (with the perturbed draft) as well as rejected."""
    decoder = TREES["fixed-paper-B2"]("perturbed")
    decoder.sampling, decoder.generator = SETTINGS["t1"], torch.Generator().manual_seed(0)
    steps = [s for _ in range(20) for s in list(decoder.generate(torch.tensor([PROMPT]), TREE_LENGTH))[1:]]
    assert max(s.drafted for s in steps) >= 5 and max(s.depth for s in steps) >= 3
    accepted = [s.accepted for s in steps]
    assert max(accepted) >= 2 and min(accepted) == 0


def test_tree_sampling_loses_nothing_when_the_draft_is_the_target():
    """q = p: every drawn child passes min(1, p/q) = 1, so each iteration accepts a whole root-to-deepest path (an
    efficiency check the distribution tests cannot make: a rule that rejected too often would still be exact)."""
    decoder = fixed_tree("self", depth=3, branching=2)
    decoder.sampling, decoder.generator = SETTINGS["t1"], torch.Generator().manual_seed(0)
    steps = list(decoder.generate(torch.tensor([PROMPT]), 30))[1:]
    assert len(steps) >= 5 and all(s.accepted == s.depth >= 1 for s in steps)


@pytest.mark.parametrize("wrong, draft", [("swapped-ratio", "unrelated"), ("no-residual", "perturbed")])
def test_a_wrong_tree_acceptance_rule_fails_the_test(monkeypatch, wrong, draft):
    """Two classic mistakes must fail the distribution test: accepting with min(1, q/p) instead of min(1, p/q),
    and resampling a rejected position from p instead of the residual norm(max(0, p - q)). (The residual bug
    distorts p by min(p, q) - sum(min(p, q)) p: small for the unrelated draft, whose mass sits on tokens the
    target rarely picks (p = 0.02 there), large for the perturbed one (p < 1e-30).)"""
    from dtbench.decoders import sampling

    if wrong == "no-residual":
        monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    else:
        real = sampling.accept
        monkeypatch.setattr(sampling, "accept", lambda p_x, q_x, g, d: real(q_x, p_x, g, d))
    assert p_value(TREES["fixed-paper-B2"](draft), SETTINGS["t1"], TREE_LENGTH) < ALPHA


def test_tree_sampling_is_reproducible_and_greedy_untouched():
    """Same seed -> same tokens; different seeds differ; greedy trees still equal greedy AR."""

    def run(seed):
        d = TREES["dynatree"]("perturbed")
        d.sampling, d.generator = SETTINGS["t1"], torch.Generator().manual_seed(seed)
        return [t for s in d.generate(torch.tensor([PROMPT]), 12) for t in s.tokens][:12]

    assert run(7) == run(7)
    assert len({tuple(run(s)) for s in range(6)}) > 1
    ar = [
        t
        for s in Autoregressive(models()["self"], None, ARParams()).generate(torch.tensor([PROMPT]), 12)
        for t in s.tokens
    ]
    for name in TREES:
        assert [t for s in TREES[name]("perturbed").generate(torch.tensor([PROMPT]), 12) for t in s.tokens][:12] == ar


@pytest.mark.fast  # the module is full tier; these keep its subject in the fast tier
def test_prune_skip_refuses_sampling():
    from dtbench.decoders.fixed_tree import FixedTree, FixedTreeParams

    params = FixedTreeParams(prune="skip")
    assert "prune: leaf" in FixedTree.sampling_error(params)
    assert FixedTree.sampling_error(FixedTreeParams()) is None
    decoder = fixed_tree("perturbed", prune="skip")
    decoder.sampling, decoder.generator = SETTINGS["t1"], torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="prune: skip"):
        list(decoder.generate(torch.tensor([PROMPT]), 4))


# ----------------------------------------------------------------------------------------------------------
# EAGLE-2 / EAGLE-3 (issue 34 item 2): a head's top-k tree, verified with deterministic children (q one-hot)
# ----------------------------------------------------------------------------------------------------------


@cache
def eagle_head(version: int) -> str:
    import tempfile
    from pathlib import Path

    from dtbench.testing.fixtures import write_eagle

    root = Path(tempfile.mkdtemp(prefix=f"eagle{version}-", dir=scratch_root()))
    hidden = models()[EAGLE_TARGET[version]].config.hidden_size
    extra = {"draft_vocab": 5} if version == 3 else {}
    return str(write_eagle(root / "head", hidden=hidden, vocab=VOCAB, version=version, seed=version, **extra))


EAGLE_TARGET = {1: "self", 3: "deep"}  # EAGLE-3 heads read three target layers: the 7-layer target


def eagle(version: int, **params):
    from dtbench.decoders.eagle import Eagle, EagleParams

    return Eagle(models()[EAGLE_TARGET[version]], None, EagleParams(head=eagle_head(version), **params))


# EAGLE-1 at t = 1 is the kit's sampling check (tests/test_conformance_sampling.py); EAGLE-3 and t = 0.6 are not
@pytest.mark.parametrize("version, temperature", [(1, 0.6), (3, 0.6), (3, 1.0)])
def test_eagle_speculative_sampling_is_exact(version, temperature):
    decoder = eagle(version, top_k=3, depth=3, total_token=8)
    assert p_value(decoder, SamplingSettings(temperature=temperature), TREE_LENGTH, EAGLE_TARGET[version]) > ALPHA


def test_eagle_sampling_drafts_real_trees_and_a_wrong_rule_fails(monkeypatch):
    """Not vacuous: the sampled EAGLE trees accept drafted tokens, and accepting every drafted child (a wrong rule)
    fails the same test."""
    decoder = eagle(1, top_k=3, depth=3, total_token=8)
    decoder.sampling, decoder.generator = SamplingSettings(temperature=1.0), torch.Generator().manual_seed(0)
    steps = list(decoder.generate(torch.tensor([PROMPT]), 30))
    assert sum(s.accepted for s in steps) > 0 and max(s.drafted for s in steps) == 7
    from dtbench.decoders import sampling

    monkeypatch.setattr(sampling, "accept", lambda p_x, q_x, generator, device: True)
    assert p_value(decoder, SamplingSettings(temperature=1.0), TREE_LENGTH) < ALPHA


# ----------------------------------------------------------------------------------------------------------
# Medusa's typical acceptance (issue 34 item 2): opt-in, lossy by design
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.fast  # the module is full tier; these keep its subject in the fast tier
def test_typical_acceptance_by_hand():
    """Root 0 with children 1 (token 2) and 2 (token 3); node 1 has child 3 (token 4). Row 0 puts p = 0.5 on token
    2 and 0.3 on token 3; row 1 puts 0.05 on token 4 (below the 0.09 cap and alpha * exp(-H)): the path is root ->
    node 1, and the last token is drawn from row 1 truncated to the tokens above its cutoff."""
    from dtbench.decoders.sampling import typical_threshold, verify_tree_typical

    probs = torch.tensor(
        [
            [0.05, 0.05, 0.5, 0.3, 0.05, 0.05],
            [0.02, 0.02, 0.02, 0.02, 0.05, 0.87],
            [1 / 6] * 6,
            [1 / 6] * 6,
        ],
        dtype=torch.float64,
    )
    cut = typical_threshold(probs, 0.09, 0.3)
    assert float(cut[1]) == pytest.approx(
        min(0.09, 0.3 * float(torch.exp((probs[1] * torch.log(probs[1] + 1e-5)).sum())))
    )
    draws = set()
    for seed in range(30):
        path, committed = verify_tree_typical(
            [0, 2, 3, 4], [0, 0, 0, 1], torch.log(probs), 1.0, 0.09, 0.3, torch.Generator().manual_seed(seed)
        )
        assert path == [0, 1] and committed[0] == 2
        draws.add(committed[1])
    assert draws == {5}  # row 1: only token 5 (0.87) is above the cutoff


def medusa_typical(**params):
    import tempfile
    from pathlib import Path

    from dtbench.decoders.medusa import Medusa, MedusaParams
    from dtbench.testing.fixtures import write_medusa

    hidden = models()["self"].config.hidden_size
    folder = write_medusa(
        Path(tempfile.mkdtemp(prefix="medusa-", dir=scratch_root())) / "head", hidden=hidden, vocab=VOCAB, heads=2
    )
    choices = [[0], [1], [0, 0], [1, 0]]
    return Medusa(models()["self"], None, MedusaParams(head=str(folder), choices=choices, **params))


def test_medusa_typical_is_opt_in_and_lossy():
    from dtbench.decoders.medusa import Medusa, MedusaParams

    typical = MedusaParams(head="h", acceptance="typical")
    assert Medusa.lossless_with(typical) is False and Medusa.lossless_with(MedusaParams(head="h")) is True
    assert Medusa.sampling_error(MedusaParams(head="h")) is not None and Medusa.sampling_error(typical) is None
    decoder = medusa_typical(acceptance="typical")
    decoder.sampling, decoder.generator = SamplingSettings(temperature=0.7), torch.Generator().manual_seed(0)
    steps = list(decoder.generate(torch.tensor([PROMPT]), 20))
    assert sum(len(s.tokens) for s in steps) >= 20 and max(s.drafted for s in steps) == 4
    decoder.sampling = None
    with pytest.raises(ValueError, match="typical needs a suite that samples"):
        list(decoder.generate(torch.tensor([PROMPT]), 5))


def test_lossy_sampled_cell_never_reads_yes(tmp_path):
    """A sampled cell whose decoder is lossy with its params reads "lossy by design" in every format."""
    import json

    from tests import reportdb
    from tests.kit import invoke

    path = tmp_path / "r.db"
    with reportdb.connect(path)() as session:
        run = reportdb.add_run(session)
        cell = reportdb.add_cell(
            session, run, "medusa (typical)", "medusa", sampling={"temperature": 0.7}, draft="medusa heads"
        )
        cell.lossless_expected = False
        for sample in reportdb.add_samples(session, cell, [100.0] * 6, warmup=1):
            sample.step_stats = {"accepted": [0, 2, 1], "depth": [0, 2, 2], "drafted": [0, 4, 4]}
            sample.accepted, sample.mean_path_length = 3, 1.5
        session.commit()
    rows = json.loads(invoke("report", "--db", str(path), "--format", "json").stdout)["cells"]
    assert [r["lossless"] for r in rows] == ["lossy by design"]
    table = invoke("report", "--db", str(path), "--format", "markdown").stdout
    assert "lossy by design" in table and "| yes" not in table
    invoke("report", "--db", str(path), "--profile", "--profile-json", str(tmp_path / "p.json"))
    assert json.loads((tmp_path / "p.json").read_text())["profiles"][0]["dtbench"]["lossless"] == "lossy by design"
