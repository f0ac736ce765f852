"""Decoders declare what they are (issue 18, item 3): family, verify sizes, reference — and the harness and the reports
read those, never decoder names. Two third-party decoders installed into a temporary folder (a chain decoder whose
chain length is called ``span``, a tree decoder whose bounds are ``width``/``levels``: none of the built-ins' param
names) are calibrated to their own sizes, get a predicted best configuration from the cost model, and land in the
tables where their family belongs.
"""

from __future__ import annotations

import json

import pytest
from kit import fast_calibration_settings, install_plugin, invoke, one_line_error, suite_dict, tiny_pair, write_suite

from dtbench.decoders.base import FAMILIES, Decoder
from dtbench.harness import registry
from dtbench.harness.calibration import calibrate as cal
from dtbench.harness.calibration import calibrate_run

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")

PLUGINS = """
from pydantic import Field

from dtbench.decoders.base import Decoder, DecoderParams
from dtbench.decoders.chain import DraftModelProposer, KVTarget, speculate_chain
from dtbench.decoders.fixed_tree import FixedPolicy
from dtbench.decoders.tree import TreeDecoder, TreeParams


class SpanParams(DecoderParams):
    span: int = Field(3, ge=1, le=16)


class SpanChain(Decoder):
    Params = SpanParams
    needs_draft = True
    family = "chain"

    @classmethod
    def verify_sizes(cls, params):
        return params.span + 1, 0

    def generate(self, input_ids, max_new_tokens):
        yield from speculate_chain(KVTarget(self.target), DraftModelProposer(self.draft), input_ids, max_new_tokens,
                                   self.params.span)


class GridParams(TreeParams):
    width: int = Field(2, ge=1, le=8)
    levels: int = Field(2, ge=1, le=8)


class GridTree(TreeDecoder):
    Params = GridParams

    @classmethod
    def tree_bounds(cls, params):
        return params.width, params.levels

    def make_policy(self):
        p = self.params
        return FixedPolicy(p.levels, p.width, p.tau, p.n_max)


class Nameless(Decoder):
    family = "speculative"

    def generate(self, input_ids, max_new_tokens):
        yield from ()
"""


@pytest.fixture()
def plugins(tmp_path, monkeypatch):
    install_plugin(
        monkeypatch,
        tmp_path / "site",
        "cap-plugins",
        {
            "span_chain": "cap_plugins:SpanChain",
            "grid_tree": "cap_plugins:GridTree",
            "nameless": "cap_plugins:Nameless",
        },
        PLUGINS,
    )


def test_every_builtin_declares_a_family_and_sizes_from_params_alone():
    for name in registry.discover():
        cls = registry.get(name)
        assert cls.family in FAMILIES, name
        try:
            params = registry.validate_params(name, {})
        except Exception:  # params without defaults (medusa's head): sizes need a configuration
            continue
        causal, masked = cls.verify_sizes(params)
        assert causal >= 0 and masked >= 0 and causal + masked >= 1, name
        ref = cls.reference(params)  # a classmethod: no models, no half-made instance
        assert ref is None or (isinstance(ref[0], str) and isinstance(ref[1], dict)), name
    assert registry.get("ar").reference(registry.validate_params("ar", {})) is None
    assert Decoder.family == "external"  # a plugin that declares nothing is assumed nothing about


def test_plugin_sizes_drive_calibration(plugins):
    from dtbench.harness.suites.plan import plan_suite
    from dtbench.harness.suites.suitefile import parse_suite

    suite = parse_suite(
        json.dumps(
            {
                "name": "caps",
                "device": "cpu",
                "target": {"model": "t"},
                "draft": {"model": "d"},
                "datasets": [{"name": "wikitext-2", "prompts": 2, "warmup": 1, "L_max": 16}],
                "generation_lengths": [6],
                "decoders": [
                    {"name": "ar"},
                    {"name": "span_chain", "params": {"span": 7}},
                    {"name": "grid_tree", "params": {"width": 3, "levels": 2, "n_max": 100}},
                ],
            }
        )
    )
    plan = plan_suite(suite)
    # span + pending; root + u0 + 3 + 3^2 nodes (a paper-rooted tree: u0 alone at depth 0, then levels 1 and 2)
    assert cal.decoder_sizes(plan) == (8, 1 + 1 + 3 + 9)
    curves = {(c.role, c.kind): max(c.ns) for c in cal.curves_for(plan, suite, uses_draft=True)}
    assert curves[("target", "causal")] >= 8 and curves[("target", "tree")] >= 14
    assert {cp.spec.name: cp.cls.family for cp in plan.decoders} == {
        "ar": "ar",
        "span_chain": "chain",
        "grid_tree": "tree",
    }


def test_a_family_outside_the_four_is_a_one_line_error(plugins, tmp_path):
    suite = tmp_path / "s.yaml"
    suite.write_text(
        "name: s\ndatasets: [{name: wikitext-2, prompts: 2, warmup: 1}]\ngeneration_lengths: [4]\n"
        "decoders: [{name: ar}, {name: nameless}]\n"
    )
    one_line_error(invoke("validate", str(suite)), "decoder 'nameless' declares family 'speculative'")


def test_plugins_calibrated_priced_and_tabled_by_family(plugins, tmp_path, data_dir, monkeypatch):
    import dtbench.cli.main  # noqa: F401  (imported before Settings is patched: its options read the defaults)
    from dtbench.harness.store import db

    monkeypatch.setattr(calibrate_run, "Settings", fast_calibration_settings())
    target, draft = tiny_pair(tmp_path)
    suite = suite_dict(
        target,
        draft,
        [
            {"name": "ar"},
            {"name": "span_chain", "label": "Span chain", "params": {"span": 3}},
            {"name": "grid_tree", "label": "Grid 2x2", "params": {"width": 2, "levels": 2, "n_max": 16}},
            {"name": "grid_tree", "label": "Grid 3x2", "params": {"width": 3, "levels": 2, "n_max": 16}},
        ],
        calibrate=True,
    )
    dbfile = tmp_path / "r.db"
    result = invoke(
        "run",
        write_suite(tmp_path, suite),
        "--db",
        str(dbfile),
        "--data-dir",
        str(data_dir),
        "--no-progress",
        "--no-report",
    )
    assert result.exit_code == 0, result.output
    with db.connect(f"sqlite:///{dbfile}")() as s:
        assert {c.label: c.family for c in s.query(db.Cell)} == {
            "ar": "ar",
            "Span chain": "chain",
            "Grid 2x2": "tree",
            "Grid 3x2": "tree",
        }
        sizes = {(r.role, r.tree_mask): r.n for r in s.query(db.Calibration).filter_by(last_only=False)}
    assert sizes
    ns = {}  # calibrated: the target's stored curves reach the plugins' own verification sizes
    with db.connect(f"sqlite:///{dbfile}")() as s:
        for r in s.query(db.Calibration).filter_by(role="target", last_only=False):
            ns.setdefault(r.tree_mask, set()).add(r.n)
    assert max(ns[False]) >= 4 and max(ns[True]) >= 1 + 3 + 9

    result = invoke("report", "--db", str(dbfile), "--cost-model", "--format", "json")
    assert result.exit_code == 0, result.output
    cells = {c["label"]: c for c in json.loads(result.output)["cells"]}
    assert 1 <= cells["Span chain"]["predicted_best_k"] <= 3 and cells["Span chain"]["predicted_best_speedup"] > 0
    for label in ("Grid 2x2", "Grid 3x2"):  # a tree gets a predicted node budget, not a K
        assert cells[label]["predicted_best_k"] is None
        assert isinstance(cells[label]["predicted_best_n_max"], int) and cells[label]["predicted_best_n_max"] >= 1
    assert cells["ar"]["predicted_best_n_max"] is None and cells["ar"]["predicted_best_k"] is None

    result = invoke("report", "--db", str(dbfile), "--tables", "--format", "json")
    assert result.exit_code == 0, result.output
    tables = json.loads(result.output)
    main = [r["method"] for r in tables["table1_main"]["rows"]]
    assert {"ar", "Span chain", "Grid 2x2", "Grid 3x2"} <= set(main)
    ablation = [r["variant"] for r in tables["table4_ablation"]["rows"]]
    assert ablation == ["Grid 2x2", "Grid 3x2"]  # the tree family's rows; the chain and AR are not tree variants
