"""Compiled execution (issue 37): static KV caches, bucketed torch.compile'd forwards, the `execution:` axis.

The property tests check every compiled in-process decoder against eager `ar` token for token (float64 tiny models:
no near ties), with a small example budget since every new bucket compiles a graph; they are parametrized over the
device (issue 38 item 3, ``models.DEVICES``): on CUDA (skipped without one; compiled with ``mode="reduce-overhead"``,
CUDA graphs) the same seeded pair in float32 token for token and in float16 under the tie-aware rule. The run test
checks the whole path: cells per execution, compile_s stored apart, no recompile inside a measured sample, a roofline
per sample.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from kit import invoke, one_line_error, suite_dict, tiny_pair, write_suite
from models import COMPILED_MAX_LEN, device_zoo, model_zoo, run_decoder
from sqlalchemy import select
from transformers import DynamicCache

from dtbench.decoders import kv, static_kv
from dtbench.decoders.ar import ARParams, Autoregressive
from dtbench.decoders.dynatree import DynaTree
from dtbench.decoders.fixed_tree import FixedTree
from dtbench.decoders.linear import LinearParams, LinearSpeculative
from dtbench.decoders.ngram import Ngram, NgramParams
from dtbench.harness.calibration import roofline
from dtbench.harness.store import db

TIER = "full"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")

EXECUTION = static_kv.Execution(max_len=COMPILED_MAX_LEN)  # shared: graphs compiled by one test are reused by the next


@pytest.fixture(scope="module")
def compiled_zoo():
    """The float64 perturbed pair, run under :data:`EXECUTION` by the tests below: each bucket they use compiles on
    first use. Nothing is precompiled: these tests use 2 of the 6 buckets up to 32 that a precompile compiled (96 s
    on the 2-core VM, issue 57), and none counts recompiles (the kit's compiled check does, tests/test_conformance_compiled.py)."""
    return device_zoo("cpu", torch.float64)["perturbed"]


def in_compiled(decoder, prompt, T):
    with static_kv.compiled(EXECUTION):
        EXECUTION.begin_sample()
        EXECUTION.used.clear()
        before = static_kv.compiled_graphs()
        tokens = run_decoder(decoder, prompt, T)
        return tokens, static_kv.compiled_graphs() - before


DECODERS = [
    (Autoregressive, ARParams()),
    (LinearSpeculative, LinearParams(k=4)),
    (Ngram, NgramParams(k=3)),
    (DynaTree, DynaTree.Params(n_max=16)),
    (FixedTree, FixedTree.Params(branching=2, depth=3)),
]


# Compiled equals eager (every compiled built-in, zero recompiles after the compile step, only the declared buckets)
# is the conformance kit's compiled_equals_eager check since issue 56: tests/test_conformance_compiled.py.


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_decoders_pass_the_tie_aware_check_at_reduced_precision(dtype):
    """At the precision people run (bf16 here; fp16 on the GPU node), compiled decoders are checked as every cell is:
    each emitted token is the target's greedy choice given the decoder's own prefix, numeric near ties allowed
    (harness/measurement/lossless.py), with zero errors; float32 token for token against eager ar."""
    import copy

    from dtbench.harness.measurement import lossless

    base, drafted = model_zoo()["perturbed"]  # shared by other tests: copied, never cast in place
    target, draft = copy.deepcopy(base).to(dtype), copy.deepcopy(drafted).to(dtype)
    execution = static_kv.Execution(max_len=160)
    execution.precompile([target, draft], 32)
    prompt = list(range(7, 31))
    ar = run_decoder(Autoregressive(target, None, ARParams()), prompt, 40)
    for cls, params in DECODERS:
        with static_kv.compiled(execution):
            execution.begin_sample()
            tokens = run_decoder(cls(target, draft, params), prompt, 40)
        check = lossless.check_output(target, prompt, tokens, ar, torch.device("cpu"))
        assert check.errors == 0, (cls.__name__, check)
        if dtype == torch.float32:
            assert tokens == ar, cls.__name__


def test_static_cache_rolls_back_by_length_and_compacts_by_index(compiled_zoo):
    """The same cache operations on a static and on a dynamic cache give the same logits: crop, then a tree-masked
    forward of siblings whose second is kept by index (compaction), then one more token."""
    from dtbench.decoders.tree.structure import attention_mask_kind, tree_attention_mask

    target, _ = compiled_zoo
    prompt = list(range(5, 17))
    P = len(prompt)
    siblings = torch.tensor([[True, False, False], [False, True, False], [False, True, True]])  # 30 | 24 <- 31

    def script(cache_of):
        cache, _ = kv.prefill(target, torch.tensor([prompt]))
        assert type(cache) is cache_of
        kv.forward(target, [20, 21, 22], cache)
        kv.crop(cache, P + 1)  # keep 20 only: a rollback
        after = kv.forward(target, [23], cache)[-1]
        mask = tree_attention_mask(siblings, P + 2, attention_mask_kind(target), target.dtype)
        kv.forward(target, [30, 24, 31], cache, position_ids=torch.tensor([[P + 2, P + 2, P + 3]]), attention_mask=mask)
        kv.keep_positions(cache, P + 2, [P + 3, P + 4])  # 24 then 31, moved to the slots after the prefix
        assert kv.cache_len(cache) == P + 4
        return after, kv.forward(target, [25], cache)[-1]

    with torch.inference_mode(), static_kv.compiled(EXECUTION):
        EXECUTION.begin_sample()
        static = script(static_kv.StaticKV)
    with torch.inference_mode():
        dynamic = script(DynamicCache)
    for a, b in zip(static, dynamic):
        assert torch.allclose(a, b, atol=1e-6)
    assert not torch.allclose(static[0], static[1])


def test_a_full_static_cache_is_a_clear_error(compiled_zoo):
    target, _ = compiled_zoo
    small = static_kv.Execution(max_len=16)
    with torch.inference_mode(), static_kv.compiled(small), pytest.raises(ValueError, match="static KV cache of 16"):
        kv.prefill(target, torch.tensor([list(range(3, 20))]))


@pytest.mark.fast  # the module is full tier; this keeps its subject in the fast tier
def test_roofline_counts_weights_and_attended_kv_once_per_forward():
    model, _ = model_zoo()["self"]
    sizes = roofline.model_bytes(model)
    params = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    assert sizes["weights"] == params * 8  # float64, the untied input embedding left out
    assert sizes["kv_per_position"] == 2 * 2 * 2 * 8 * 8  # K and V x 2 layers x 2 KV heads x head dim 8 x 8 bytes
    limit = roofline.limit_seconds([[1, 10, 0], [4, 11, 0]], sizes, 1e9)
    assert limit == pytest.approx((2 * sizes["weights"] + sizes["kv_per_position"] * (11 + 15)) / 1e9)
    # one forward at 10 ms against a 1 ms byte limit, flat in n: launch-bound; at 1.2 ms: bandwidth-bound
    assert roofline.forward_regime({1: 0.010, 64: 0.011}, {"weights": 10**6}, 1e9) == "launch-bound"
    assert roofline.forward_regime({1: 0.0012, 64: 0.0013}, {"weights": 10**6}, 1e9) == "bandwidth-bound"
    assert roofline.forward_regime({1: 0.010, 64: 0.030}, {"weights": 10**6}, 1e9) == "compute-bound"
    assert roofline.forward_regime({1: 0.010, 64: 0.011}, None, None) == "flat"
    assert roofline.forward_regime({64: 0.011}, None, None) is None


def test_the_copy_benchmark_measures_a_bandwidth():
    bw = roofline.measure_bandwidth(torch.device("cpu"), nbytes=16 * 2**20, repeats=2)
    assert 1e8 < bw["bytes_per_s"] < 1e13 and bw["vendor_bytes_per_s"] is None


# --- the execution axis through `dtbench run` ------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("models"))


def test_validate_refuses_what_cannot_run_compiled(pair, tmp_path, data_dir):
    cases = [
        ({"name": "hf_assisted"}, {}, "cannot run compiled (its class does not declare compiles)"),
        ({"name": "hf_generate", "params": {"prompt_lookup_num_tokens": 3}}, {}, "prompt lookup decoding"),
        ({"name": "linear", "execution": ["fast"]}, {}, "execution"),
        ({"name": "linear", "execution": ["compiled"]}, {"execution": "eager"}, "not in the suite's execution"),
        ({"name": "linear", "params": {"fused_draft": True}}, {}, "fused_draft fuses compiled draft forwards"),
    ]
    for decoder, extra, needle in cases:
        suite = suite_dict(*pair, [{"name": "ar"}, decoder], **{"execution": ["eager", "compiled"], **extra})
        suite["datasets"][0].update(prompts=3, warmup=1)  # a full batch of B = 2 after warmup
        result = invoke("validate", write_suite(tmp_path, suite), "--data-dir", str(data_dir))
        one_line_error(result, needle)


def test_a_run_eager_and_compiled(pair, tmp_path, data_dir):
    decoders = [
        {"name": "ar"},
        {"name": "linear", "params": {"k": 3}},
        {"name": "dynatree", "params": {"n_max": 8}},
        {"name": "ngram"},
        {"name": "suffix"},
        {"name": "hf_generate", "execution": ["compiled"]},
        {"name": "hf_assisted", "execution": ["eager"]},
        # the K draft forwards as one compiled region (issue 46 item 2): its compile step compiles the region too
        {"name": "linear", "label": "linear fused", "params": {"k": 3, "fused_draft": True}, "execution": ["compiled"]},
    ]
    suite = suite_dict(*pair, decoders, execution=["eager", "compiled"])
    dbfile = tmp_path / "c.db"
    result = invoke(
        "run", write_suite(tmp_path, suite), "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress"
    )
    assert result.exit_code == 0, result.output
    with db.connect(str(dbfile))() as s:
        cells = {c.label: c for c in s.scalars(select(db.Cell))}
        assert set(cells) == {
            "ar",
            "linear",
            "dynatree",
            "ngram",
            "suffix",
            "hf_assisted",
            "ar [compiled]",
            "linear [compiled]",
            "dynatree [compiled]",
            "ngram [compiled]",
            "suffix [compiled]",
            "hf_generate [compiled]",
            "linear fused [compiled]",
        }
        ar = {x.prompt_index: x.output_tokens for x in cells["ar"].samples}
        for label, cell in cells.items():
            compiled = label.endswith("[compiled]")
            assert cell.execution == ("compiled" if compiled else "eager") and cell.status == "done", label
            assert (cell.compile_s is not None and cell.compile_s > 0) == compiled, label
            # every compiled cell, ar included, is checked against eager ar (issue 46 item 6)
            assert cell.reference_label == (None if label == "ar" else "ar"), label
            for x in cell.samples:
                assert x.output_tokens == ar[x.prompt_index] and x.lossless is not False, label
                if label != "ar":
                    assert x.lossless is True, label
                assert x.roofline is not None and 0 < x.roofline < 1, label
                if compiled:
                    assert x.step_stats["compiled"]["recompiles"] == 0, label
        # transformers' own compiled decoding really compiled (its generate must see the compiled execution's
        # context: without it, it ran eager on a dynamic cache)
        assert cells["hf_generate [compiled]"].compile_graphs > 0
    report = json.loads(invoke("report", "--db", str(dbfile), "--format", "json").stdout)
    rows = {c["label"]: c for c in report["cells"]}
    assert rows["linear [compiled]"]["execution"] == "compiled" and rows["linear"]["execution"] == "eager"
    assert rows["linear [compiled]"]["compile_s"] > 0 and rows["linear"]["roofline"] > 0
    # speedups pair within one execution: compiled linear over compiled ar
    assert rows["ar [compiled]"]["speedup"] == pytest.approx(1.0)
    table = invoke("report", "--db", str(dbfile), "--format", "markdown").stdout
    assert "Execution" in table and "compiled (compile" in table and "Roofline" in table
    # compiled beside eager, per decoder that ran both ways (hf_generate and hf_assisted ran one way each)
    paired = json.loads(invoke("report", "--db", str(dbfile), "--execution", "--format", "json").stdout)
    by = {r["label"]: r for r in paired["rows"]}
    assert set(by) == {"ar", "linear", "dynatree", "ngram", "suffix"}
    for r in by.values():
        assert r["n"] == 1 and r["ratio"] == pytest.approx(r["compiled_throughput"] / r["eager_throughput"])
        assert r["compile_s"] > 0 and r["eager_lossless"] == r["compiled_lossless"] == "yes"
    shown = invoke("report", "--db", str(dbfile), "--execution", "--format", "markdown")
    assert shown.exit_code == 0 and "Compiled/eager" in shown.stdout
    assert (
        "one execution only (no pair): hf_assisted, hf_generate \\[compiled\\], linear fused" in shown.output
    )  # Markdown-escaped
    one_line_error(invoke("report", "--db", str(dbfile), "--execution", "--compare"), "a report of its own")


def test_compiled_batches_at_every_batch_size(pair, tmp_path, data_dir):
    """Compiled execution at B = 1 and B = 4 (issue 46 item 6): ar, linear, dynatree and ngram both ways at both
    sizes, every cell lossless against eager ar at its batch size, no recompile after the compile step (each batch
    size has its own step: its (B, bucket) graphs), and the batch columns stored for the compiled batches too."""
    decoders = [
        {"name": "ar"},
        {"name": "linear", "params": {"k": 3}},
        {"name": "dynatree", "params": {"n_max": 8}},
        {"name": "ngram"},
    ]
    suite = suite_dict(*pair, decoders, execution=["eager", "compiled"], batch_sizes=[1, 4])
    suite["datasets"][0].update(prompts=5, warmup=1)  # one full batch of B = 4 after warmup
    dbfile = tmp_path / "b.db"
    result = invoke(
        "run", write_suite(tmp_path, suite), "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress"
    )
    assert result.exit_code == 0, result.output
    with db.connect(str(dbfile))() as s:
        cells = {c.label: c for c in s.scalars(select(db.Cell))}
        assert {c.execution for c in cells.values()} == {"eager", "compiled"}
        ar = {(x.prompt_index, x.batch_rows or 1): x.output_tokens for x in cells["ar"].samples}
        batches = set()
        for label, cell in cells.items():
            assert cell.status == "done", label
            assert cell.reference_label == (None if label == "ar" else "ar"), label
            for x in cell.samples:
                batches.add((label, x.batch_rows or 1))
                assert x.output_tokens == ar[(x.prompt_index, x.batch_rows or 1)] and x.lossless is not False, label
                if label.endswith("[compiled]"):
                    assert x.step_stats["compiled"]["recompiles"] == 0, (label, x.batch_rows)
    for name in ("ar", "linear", "dynatree", "ngram"):
        for label in (name, f"{name} [compiled]"):
            assert {(label, 1), (label, 4)} <= batches, label


def test_an_eager_run_has_no_execution_report_and_its_table_no_execution_column(pair, tmp_path, data_dir):
    suite = suite_dict(*pair, [{"name": "ar"}, {"name": "linear", "params": {"k": 2}}])
    dbfile = tmp_path / "e.db"
    result = invoke(
        "run", write_suite(tmp_path, suite), "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress"
    )
    assert result.exit_code == 0, result.output
    table = invoke("report", "--db", str(dbfile), "--format", "markdown").stdout
    assert "Execution" not in table and "Roofline" in table  # every cell has a roofline; none ran compiled
    one_line_error(invoke("report", "--db", str(dbfile), "--execution"), "no compiled cell with an eager twin")


@pytest.mark.fast  # the module is full tier; this keeps its subject in the fast tier
def test_0013_an_old_database_reports_as_eager_with_no_roofline(tmp_path):
    """Migration 0013: every cell written before it ran eager and has no compile time, every sample no roofline; its
    table gains no Execution or Roofline column (the numbers are test_migrations' identical-report check)."""
    import shutil
    from pathlib import Path

    from sqlalchemy import create_engine, text

    old = Path(shutil.copy(Path(__file__).parent / "fixtures" / "results-0001.db", tmp_path / "old.db"))
    assert invoke("db", "upgrade", "--db", str(old)).exit_code == 0
    with create_engine(f"sqlite:///{old}").connect() as conn:
        assert set(conn.execute(text("SELECT DISTINCT execution FROM cells")).scalars()) == {"eager"}
        assert conn.execute(text("SELECT COUNT(*) FROM cells WHERE compile_s IS NOT NULL")).scalar() == 0
        assert conn.execute(text("SELECT COUNT(*) FROM samples WHERE roofline IS NOT NULL")).scalar() == 0
    table = invoke("report", "--db", str(old), "--run", "1", "--format", "markdown")
    assert table.exit_code == 0 and "| Decoder |" in table.stdout
    assert "Execution" not in table.stdout and "Roofline" not in table.stdout


def test_the_cost_model_names_each_models_regime_and_leaves_compiled_cells_unpriced(
    monkeypatch, pair, tmp_path, data_dir
):
    from kit import fast_calibration_settings

    from dtbench.harness.calibration import calibrate_run

    monkeypatch.setattr(calibrate_run, "Settings", fast_calibration_settings())
    decoders = [{"name": "ar"}, {"name": "linear", "params": {"k": 2}, "execution": ["eager"]}]
    suite = suite_dict(*pair, decoders, execution=["eager", "compiled"], calibrate=True)
    dbfile = tmp_path / "cm.db"
    result = invoke(
        "run", write_suite(tmp_path, suite), "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress"
    )
    assert result.exit_code == 0, result.output
    out = invoke("report", "--db", str(dbfile), "--cost-model", "--format", "json")
    assert out.exit_code == 0, out.output
    cells = {c["label"]: c for c in json.loads(out.stdout)["cells"]}
    assert set(cells) == {"ar", "linear"}  # "ar [compiled]" is not priced on eager curves
    regimes = {"launch-bound", "bandwidth-bound", "compute-bound"}
    assert cells["linear"]["forward_regime"].startswith("target ") and "draft " in cells["linear"]["forward_regime"]
    assert cells["ar"]["forward_regime"].split(" ", 1)[1] in regimes and "draft" not in cells["ar"]["forward_regime"]
    text = invoke("report", "--db", str(dbfile), "--cost-model", "--format", "markdown").output
    assert "target forwards: " in text and "not priced (compiled execution" in text and r"ar \[compiled\]" in text


def test_more_buckets_than_dynamos_default_limit_all_compile(monkeypatch):
    """Two models of one class with every bucket up to 16 (2 x 5 graphs of one compiled function) pass dynamo's
    default limit of 8 graphs per function: the execution raises the limit and every shape compiles (past the limit
    dynamo would silently run eager, and a "compiled" cell would measure eager code; hitting it is now an error).
    The limit is dynamo's, whatever backend compiles its graphs, so dynamo hands them to its ``eager`` backend here:
    10 graphs traced in seconds, where inductor took 99 s on the 2-core VM (issue 57). Inductor's own graphs are the
    kit's compiled check's (tests/test_conformance_compiled.py) and the tests above."""
    import copy
    import functools

    import torch._dynamo.config as dynamo

    monkeypatch.setattr(static_kv.torch, "compile", functools.partial(torch.compile, backend="eager"))

    target, other = model_zoo()["unrelated"]
    draft = copy.deepcopy(other).to(torch.float32)  # as the embedded pair: one class, two dtypes, so two graph sets
    execution = static_kv.Execution(max_len=112)  # a static length no other test uses: every graph here is new
    before = static_kv.compiled_graphs()
    execution.precompile([target, draft], 16)
    assert static_kv.compiled_graphs() - before == 2 * 5
    assert dynamo.recompile_limit >= static_kv.RECOMPILE_LIMIT and dynamo.fail_on_recompile_limit_hit


@pytest.mark.parametrize("executions", [["compiled"], ["eager", "compiled"]])
def test_compiled_ar_has_the_eager_ar_as_its_reference(pair, tmp_path, executions):
    """Compiled ar is checked against eager ar (issue 46 item 6): a compiled-only suite gets an implicit eager ar,
    and every compiled decoder's reference is the eager one."""
    from dtbench.harness.suites.plan import plan_suite
    from dtbench.harness.suites.suitefile import parse_suite

    suite = suite_dict(*pair, [{"name": "ar"}, {"name": "linear", "params": {"k": 3}}], execution=executions)
    plan = plan_suite(parse_suite(yaml.safe_dump(suite)))
    by_label = {p.label: p for p in plan.decoders}
    assert by_label["ar"].execution == "eager" and by_label["ar"].reference_label is None
    assert by_label["ar"].implicit == (executions == ["compiled"])
    assert by_label["ar [compiled]"].reference_label == "ar"
    assert by_label["linear [compiled]"].reference_label == "ar"
    assert [p.label for p in plan.decoders].index("ar") < [p.label for p in plan.decoders].index("ar [compiled]")
