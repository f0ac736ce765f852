"""Batch sizes (issue 29): B prompts decoded together in the one chain loop and the one tree loop.

Property tests on float64 tiny Llama and GPT-NeoX models: for random B in 1..6 and ragged prompt lengths, every
batching decoder's per-row output equals batch-1 greedy ``ar`` on that row (drafts fully accepted, partly accepted
and rejected in different rows of one batch), also when stopping at EOS; rows that finished leave the batch. They are
parametrized over the device (issue 38 item 3, ``models.DEVICES``): on CUDA (skipped without one) the same seeded
pairs in float32 token for token and in float16 under the tie-aware rule (the batched shape counted). Then the
plan (groups in order, the same for every decoder, the remainder marked; refusals in one line), a run through the CLI
(cells per B, per-row samples, reports at B), and the per-row lossless check (a batched numeric tie is a tie, a
decoder that corrupts one row is an error in that row).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kit import install_plugin, invoke, one_line_error, suite_dict, tiny_pair, write_suite
from models import DEVICES, assert_lossless, device_zoo, examples, model_zoo
from sqlalchemy import select

from dtbench.decoders import kv
from dtbench.decoders.ar import ARParams, Autoregressive
from dtbench.decoders.chain import Proposer, speculate_chain_batch
from dtbench.harness.measurement import measure
from dtbench.harness.models import loading as harness_models
from dtbench.harness.store import db
from dtbench.harness.suites.grouping import CellKey, batch_groups
from dtbench.harness.suites.plan import plan_suite
from dtbench.harness.suites.suitefile import parse_suite
from dtbench.testing.fixtures import SHARP, VOCAB

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")


def alone(target, prompt: list[int], T: int, eos: int | None = None) -> list[int]:
    """Batch-1 greedy ``ar`` on one prompt (cut after the first EOS when ``eos`` is given)."""
    dec = Autoregressive(target, None, ARParams())
    dec.eos_token_id = eos
    out: list[int] = []
    for step in dec.generate(torch.tensor([prompt], device=target.device), T):
        out.extend(step.tokens)
        if len(out) >= T:
            break
    return out[:T]


def batched(decoder, prompts: list[list[int]], T: int, eos: int | None = None):
    """Each row's tokens (first T, cut after EOS as the runner cuts them) and Steps from ``generate_batch``."""
    decoder.eos_token_id = eos
    tokens = {r: [] for r in range(len(prompts))}
    steps = {r: [] for r in range(len(prompts))}
    done = set()
    for out in decoder.generate_batch([torch.tensor([p], device=decoder.target.device) for p in prompts], T):
        for r, step in out.items():
            if r in done:
                continue
            steps[r].append(step)
            tokens[r].extend(step.tokens)
            if (eos is not None and eos in step.tokens) or len(tokens[r]) >= T:
                done.add(r)
    cut = []
    for r in range(len(prompts)):
        row = tokens[r]
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        cut.append(row[:T])
    return cut, steps


def assert_rows_lossless(target, prompts, out, reference, rule):
    """Every row against its batch-1 reference under ``rule`` (``tie_aware``: the other rows as companions)."""
    if rule == "exact":
        assert out == reference
        return
    for r, prompt in enumerate(prompts):
        assert_lossless(target, prompt, out[r], reference[r], rule, companions=prompts[:r] + prompts[r + 1 :])


class Oracle(Proposer):
    """Drafts from the target's own batch-1 greedy continuation, with ``wrong`` from draft position ``wrong_at`` on:
    full acceptance (never wrong), partial acceptance, or rejection (wrong from the first draft)."""

    def __init__(self, truth: list[int], wrong_at: int | None):
        self.truth, self.wrong_at = truth, wrong_at

    def begin(self, prompt, pending):
        self.done = 1  # committed tokens so far (the pending one included)

    def propose(self, max_tokens):
        drafts = list(self.truth[self.done : self.done + max_tokens])
        if self.wrong_at is not None:
            drafts = [t if i < self.wrong_at else (t + 1) % VOCAB for i, t in enumerate(drafts)]
        return drafts

    def accept(self, drafts, accepted, committed):
        self.done += len(committed)


@pytest.mark.parametrize("on", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "neox"])
@settings(max_examples=examples(10), deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=20), min_size=3, max_size=6),
    T=st.integers(8, 30),
    k=st.integers(1, 6),
)
def test_full_partial_and_rejected_rows_in_one_batch_and_finished_rows_leave(on, arch, prompts, T, k):
    """Row 0's drafts are always right, row 1's always wrong, row 2's right up to the middle, the rest cycle: each row
    keeps its own acceptance (ragged), equals batch-1 ar, and the batch shrinks as rows finish. (Under the tie-aware
    rule only losslessness and the narrowing batch are asserted: where the batched shape breaks a batch-1 tie
    differently, the oracle's batch-1 truth is no longer the row's own continuation.)"""
    device, dtype, rule = on
    target, _ = device_zoo(device, dtype, arch=arch, sharpness=SHARP)["self"]
    truth = [alone(target, p, T + k + 1) for p in prompts]
    wrong = [None, 0, max(1, k // 2)]
    proposers = [Oracle(truth[r], wrong[r % 3]) for r in range(len(prompts))]
    widths: list[int] = []
    handle = target.register_forward_pre_hook(
        lambda m, a, kw: widths.append(int(kw["input_ids"].shape[0])), with_kwargs=True
    )
    try:
        with torch.inference_mode():
            out = {r: [] for r in range(len(prompts))}
            acc = {r: [] for r in range(len(prompts))}
            its = {r: 0 for r in range(len(prompts))}
            rows = [torch.tensor([p], device=target.device) for p in prompts]
            for steps in speculate_chain_batch(target, proposers, rows, T, k):
                for r, s in steps.items():
                    out[r].extend(s.tokens)
                    its[r] += 1
                    if s.drafted:
                        acc[r].append((s.accepted, s.drafted))
    finally:
        handle.remove()
    assert_rows_lossless(target, prompts, [out[r][:T] for r in out], [t[:T] for t in truth], rule)
    assert widths[0] == len(prompts) and widths == sorted(widths, reverse=True)  # the batch never gets wider
    if rule != "exact":
        return
    assert all(a == d for a, d in acc[0])  # full acceptance
    assert all(a == 0 for a, _ in acc[1])  # every draft rejected
    assert all(a == min(d, max(1, k // 2)) for a, d in acc[2])  # partial
    # Row 0 commits k + 1 per iteration and finishes first: the batch gets narrower.
    assert len(acc[0]) < len(acc[1])
    assert widths.count(len(prompts)) == its[0]  # the prefill and row 0's iterations: then row 0 is gone


def test_ragged_cache_keeps_each_rows_own_prefix():
    """After a verification each row holds exactly its prefix plus its kept tokens; the padding is cropped."""
    target, _ = model_zoo(arch="llama", sharpness=SHARP)["self"]
    with torch.inference_mode():
        batch = kv.RaggedBatch(target)
        batch.prefill([[5, 6, 7], [8, 9, 10, 11, 12], [13]])
        assert batch.lengths == [3, 5, 1] and kv.cache_len(batch.cache) == 5
        batch.forward([[20, 21, 22], [23], [24, 25]])
        batch.keep([[0, 1], [0], []])
        assert batch.lengths == [5, 6, 1] and kv.cache_len(batch.cache) == 6
        batch.retain([0, 2])
        assert batch.lengths == [5, 1] and kv.cache_len(batch.cache) == 5
        # the kept entries are the sequential ones: one more row-0 token gives batch-1 AR's logits
        logits = batch.forward([[30], [31]])
        cache = kv.new_cache()
        kv.forward(target, [5, 6, 7, 20, 21], cache)
        expected = kv.forward(target, [30], cache)[-1]
    assert torch.allclose(logits[0, 0], expected, atol=1e-10)


# --- the plan ---------------------------------------------------------------------------------------------------


def test_batch_groups_in_order_warmup_apart_remainder_last():
    assert batch_groups(10, 1, 4) == [(0,), (1, 2, 3, 4), (5, 6, 7, 8), (9,)]
    assert batch_groups(9, 0, 3) == [(0, 1, 2), (3, 4, 5), (6, 7, 8)]
    assert batch_groups(5, 3, 2) == [(0, 1), (2,), (3, 4)]
    assert batch_groups(4, 1, 1) == [(0,), (1,), (2,), (3,)]


SUITE = """
name: b
target: {model: smollm2-135m, dtype: float32}
draft: {model: smollm2-135m, dtype: bfloat16}
datasets: [{name: wikitext-2, prompts: 7, warmup: 1, L_max: 32}]
generation_lengths: [8]
batch_sizes: [1, 4]
decoders:
"""


def test_plan_groups_are_the_same_for_every_decoder_and_b1_is_unchanged():
    plan = plan_suite(parse_suite(SUITE + "  - {name: linear}\n  - {name: ngram, batch_sizes: [4]}\n"))
    by = {c.label: c for c in plan.decoders}
    assert by["ngram"].points == {CellKey("wikitext-2", 32, 8, 4)}
    assert by["ar"].points == by["linear"].points == {CellKey("wikitext-2", 32, 8, 1), CellKey("wikitext-2", 32, 8, 4)}
    groups = plan.groups()
    b1 = [g for g in groups if g.batch_size == 1]
    assert [(g.prompt_index, g.rows, g.warmup) for g in b1] == [(i, (), i == 0) for i in range(7)]
    b4 = [g for g in groups if g.batch_size == 4]
    assert [(g.prompt_indices, g.warmup, g.remainder) for g in b4] == [
        ((0,), True, False),
        ((1, 2, 3, 4), False, False),
        ((5, 6), False, True),
    ]
    assert all([c.label for c in g.decoders] == ["ar", "linear", "ngram"] for g in b4)
    assert plan.n_samples == 7 * 2 + 7 * 3


@pytest.mark.parametrize(
    "entry, needle",
    [
        ("{name: streaming_ar}", "decoder 'streaming_ar' cannot decode batches (its class does not declare batching)"),
        ("{name: hf_generate, params: {prompt_lookup_num_tokens: 4}}", "decodes batch size 1 only"),
        (
            "{name: dynatree, sampling: {temperature: 0.7}}",
            "decode greedily only (its class does not declare batch_sampling)",
        ),
        ("{name: ar, batch_sizes: [2]}", "batch_sizes [2] are not in the suite's batch_sizes"),
    ],
)
def test_validate_refuses_what_cannot_batch_in_one_line(tmp_path, entry, needle):
    (tmp_path / "s.yaml").write_text(SUITE + f"  - {entry}\n")
    one_line_error(invoke("validate", str(tmp_path / "s.yaml")), "s.yaml:", "decoders.0:", needle)


def test_a_restricted_decoder_is_not_refused(tmp_path):
    """Nor a sampled decoder declaring ``batch_sampling`` at B > 1 (issue 68: ar and the chain decoders)."""
    (tmp_path / "s.yaml").write_text(
        SUITE
        + "  - {name: streaming_ar, batch_sizes: [1]}\n  - {name: linear}\n"
        + "  - {name: ngram, sampling: {temperature: 0.7}}\n"
    )
    result = invoke("validate", str(tmp_path / "s.yaml"))
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("bad", ["[0]", "[2, 2]", "[]"])
def test_batch_sizes_must_be_positive_and_distinct(tmp_path, bad):
    (tmp_path / "s.yaml").write_text(SUITE.replace("batch_sizes: [1, 4]", f"batch_sizes: {bad}") + "  - {name: ar}\n")
    result = invoke("validate", str(tmp_path / "s.yaml"))
    assert result.exit_code == 2 and "batch_sizes" in result.output and "Traceback" not in result.output


# --- a run ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("models"))


def run_cli(tmp_path, data_dir, suite, name="r.db"):
    dbfile = tmp_path / name
    result = invoke(
        "run", write_suite(tmp_path, suite), "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress"
    )
    return result, dbfile


def cells_of(dbfile) -> dict[tuple[str, int], list[db.Sample]]:
    out = {}
    with db.connect(str(dbfile))() as s:
        for cell in s.scalars(select(db.Cell)):
            out[(cell.label, cell.batch_size)] = sorted(cell.samples, key=lambda x: x.prompt_index)
            for x in out[(cell.label, cell.batch_size)]:
                s.expunge(x)
    return out


def test_a_sampled_run_at_b_above_one(pair, tmp_path, data_dir):
    """A sampled suite at B = 2 for the decoders declaring ``batch_sampling`` (issue 68): every row sampled (its
    tokens are not the greedy ones everywhere), the sampling stored on the cell, the same seed giving the same rows in
    a second run, and no row checked against one greedy draw."""
    decoders = [{"name": "ar"}, {"name": "linear", "params": {"k": 3}}, {"name": "ngram"}, {"name": "suffix"}]
    suite = suite_dict(*pair, decoders, batch_sizes=[2], sampling={"temperature": 1.5}, generation_lengths=[12])
    suite["datasets"][0].update(prompts=5, warmup=1)
    runs = []
    for name in ("a.db", "b.db"):
        result, dbfile = run_cli(tmp_path, data_dir, suite, name)
        assert result.exit_code == 0, result.output
        runs.append(cells_of(dbfile))
    assert runs[0].keys() == {(d["name"], 2) for d in decoders}
    for key, samples in runs[0].items():
        assert [x.output_tokens for x in samples] == [x.output_tokens for x in runs[1][key]], key
        assert all(len(x.output_tokens) == 12 and x.lossless is None for x in samples), key
        assert [(x.batch_group, x.batch_rows) for x in samples][1:] == [(1, 2), (1, 2), (3, 2), (3, 2)], key
    with db.connect(str(tmp_path / "a.db"))() as s:
        assert {c.sampling["temperature"] for c in s.scalars(select(db.Cell))} == {1.5}
    # hot sampling on a confident tiny model: the rows are not all greedy AR's tokens
    greedy, _ = run_cli(tmp_path, data_dir, {**suite, "sampling": None, "decoders": [{"name": "ar"}]}, "g.db")
    assert greedy.exit_code == 0, greedy.output
    ar_greedy = [x.output_tokens for x in cells_of(tmp_path / "g.db")[("ar", 2)]]
    assert [x.output_tokens for x in runs[0][("linear", 2)]] != ar_greedy


def test_a_run_at_several_batch_sizes(pair, tmp_path, data_dir):
    decoders = [
        {"name": "ar"},
        {"name": "linear", "params": {"k": 3}},
        {"name": "dynatree", "params": {"n_max": 16}},
        {"name": "ngram"},
        {"name": "suffix"},
        {"name": "hf_generate"},
    ]
    suite = suite_dict(*pair, decoders, batch_sizes=[1, 3])
    suite["datasets"][0].update(prompts=6, warmup=1)
    result, dbfile = run_cli(tmp_path, data_dir, suite)
    assert result.exit_code == 0, result.output
    cells = cells_of(dbfile)
    assert set(cells) == {(d["name"], b) for d in decoders for b in (1, 3)}
    ar1 = {x.prompt_index: x.output_tokens for x in cells[("ar", 1)]}
    for (label, b), samples in cells.items():
        assert [x.prompt_index for x in samples] == list(range(6))
        assert all(x.lossless is not False and x.lossless_errors == 0 for x in samples), label
        if b == 1:
            assert all(x.batch_group is None and x.batch_rows is None for x in samples)
            continue
        # groups (0) warmup, (1, 2, 3), (4, 5) remainder: every row its own sample, its group recorded
        assert [(x.batch_group, x.batch_rows, x.warmup) for x in samples] == [
            (0, 1, True),
            (1, 3, False),
            (1, 3, False),
            (1, 3, False),
            (4, 2, False),
            (4, 2, False),
        ]
        for x in samples:
            assert x.output_tokens == ar1[x.prompt_index] and x.new_tokens == 6
            assert x.total_s <= x.batch_total_s and x.ttft_s <= x.total_s
        group = [x for x in samples if x.batch_group == 1]
        assert max(x.total_s for x in group) == pytest.approx(group[0].batch_total_s)
        assert len({x.ttft_s for x in group}) == 1  # one batched prefill: the same TTFT for the group's rows
    shown = invoke("report", "--db", str(dbfile), "--format", "markdown")
    assert shown.exit_code == 0, shown.output
    assert "wikitext-2 · L_max=16 · T=6 · B=3" in shown.stdout and "wikitext-2 · L_max=16 · T=6\n" in shown.stdout
    assert "remainder: 2 prompts decoded as a smaller batch, left out" in shown.stdout
    report = json.loads(invoke("report", "--db", str(dbfile), "--format", "json").stdout)
    at3 = {c["label"]: c for c in report["cells"] if c["batch_size"] == 3}
    assert at3["ar"]["n"] == 1 and at3["ar"]["remainder_n"] == 2 and at3["ar"]["lossless_n"] == "6/6"
    # total throughput at B: the group's tokens over its wall time, paired with ar's group
    group = [x for x in cells[("linear", 3)] if x.batch_group == 1]
    assert at3["linear"]["throughput_mean"] == pytest.approx(18 / group[0].batch_total_s)
    ar_group = [x for x in cells[("ar", 3)] if x.batch_group == 1]
    assert at3["linear"]["speedup"] == pytest.approx(ar_group[0].batch_total_s / group[0].batch_total_s)
    compare = json.loads(invoke("report", "--db", str(dbfile), "--compare", "--format", "json").stdout)
    rows = {(c["label"], c["batch_size"]): c for c in compare["cells"]}
    assert rows[("linear", 3)]["n"] == 1 and rows[("linear", 1)]["n"] == 5
    assert rows[("linear", 3)]["verdict"] == "n too small"


# --- lossless per row -------------------------------------------------------------------------------------------

TIE_POSITION, TIE_A, TIE_B = 17, 5, 6


class BatchTie:
    """Hooks on a target: at absolute position ``TIE_POSITION`` tokens A and B tie one above the top, and one ulp more
    goes to B in a forward over several rows (the batched shape) and to A at batch 1 (every batch-1 shape): batched
    decoding emits B there, batch-1 decoding A, as batched reductions round differently."""

    def __init__(self, model):
        self.positions: list[list[int]] = []
        model.register_forward_pre_hook(self.pre, with_kwargs=True)
        model.register_forward_hook(self.post, with_kwargs=True)

    def pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        cache = measure.cache_argument(kwargs)
        past = cache.get_seq_length() if cache is not None else 0
        pos = kwargs.get("position_ids")
        b, n = ids.shape
        self.positions = pos.tolist() if pos is not None else [list(range(past, past + n))] * b

    def post(self, module, args, kwargs, output):
        logits = output.logits
        b = logits.shape[0]
        for r in range(b):
            for j, p in enumerate(self.positions[r][-logits.shape[1] :]):
                if p == TIE_POSITION:
                    row = logits[r, j]
                    top = row.max() + 1
                    row[TIE_A] = row[TIE_B] = top
                    row[TIE_B if b > 1 else TIE_A] = torch.nextafter(top, top + 1)
        return output


@pytest.fixture
def tied_target(monkeypatch, pair):
    real = harness_models.load_model

    def load(spec, device):
        loaded = real(spec, device)
        if spec.model == str(pair[0]):
            BatchTie(loaded.model)
        return loaded

    monkeypatch.setattr(harness_models, "load_model", load)
    return pair


def test_a_batched_numeric_difference_is_a_tie_in_its_row(tied_target, tmp_path, data_dir):
    suite = suite_dict(*tied_target, [{"name": "ar"}, {"name": "linear", "params": {"k": 3}}], batch_sizes=[2])
    suite["datasets"][0].update(prompts=2, warmup=0)
    result, dbfile = run_cli(tmp_path, data_dir, suite)
    assert result.exit_code == 0, result.output
    cells = cells_of(dbfile)
    for label in ("ar", "linear"):
        for x in cells[(label, 2)]:
            assert x.prompt_tokens == 16 and x.output_tokens[2] == TIE_B  # the batched shape's pick
            assert x.lossless is True and x.lossless_errors == 0 and x.lossless_ties == 1
            (d,) = x.lossless_diagnoses
            assert d["position"] == 2 and d["kind"] == "tie" and d["noise"] < 1e-12


FLIP_ROW = '''
from dtbench.decoders.ar import Autoregressive
from dtbench.decoders.base import DecoderParams, Step


class FlipRowParams(DecoderParams):
    row: int = 1
    at: int = 2


class FlipRow(Autoregressive):
    """Batched greedy AR that replaces row ``row``'s token at output position ``at`` by another token (and goes on
    from the correct prefix): one corrupted row in a batch, claimed lossless."""

    Params = FlipRowParams
    supports_sampling = False

    @classmethod
    def reference(cls, params):
        return ("ar", {})

    def generate_batch(self, prompts, max_new_tokens):
        produced = {}
        for out in super().generate_batch(prompts, max_new_tokens):
            fixed = {}
            for r, step in out.items():
                at = produced.get(r, 0)
                tokens = list(step.tokens)
                if r == self.params.row and at <= self.params.at < at + len(tokens):
                    tokens[self.params.at - at] = (tokens[self.params.at - at] + 1) % 100
                produced[r] = at + len(tokens)
                fixed[r] = Step(tuple(tokens), step.drafted, step.accepted, step.depth)
            yield fixed
'''


def test_a_decoder_corrupting_one_row_is_an_error_in_that_row(monkeypatch, pair, tmp_path, data_dir):
    install_plugin(monkeypatch, tmp_path / "site", "dtbench-fliprow", {"fliprow": "dtbench_fliprow:FlipRow"}, FLIP_ROW)
    suite = suite_dict(*pair, [{"name": "ar"}, {"name": "fliprow"}], batch_sizes=[3])
    suite["datasets"][0].update(prompts=3, warmup=0)
    result, dbfile = run_cli(tmp_path, data_dir, suite)
    assert result.exit_code == 3, result.output
    samples = cells_of(dbfile)[("fliprow", 3)]
    assert [x.lossless for x in samples] == [True, False, True]
    bad = samples[1]
    # the first error at the corrupted position (the next token may be one too: it was computed from the true prefix)
    assert bad.lossless_errors >= 1 and (bad.lossless_first_error, bad.first_divergence) == (2, 2)
    assert all(x.lossless_errors == 0 for x in cells_of(dbfile)[("ar", 3)])


# --- the cost model over batch and the figure (items 5, 6) ------------------------------------------------------


class _Row:
    def __init__(self, role, n, median_s, rows=1, cache_len=64, tree_mask=False, last_only=False):
        self.role, self.n, self.median_s, self.rows = role, n, median_s, rows
        self.cache_len, self.tree_mask, self.last_only = cache_len, tree_mask, last_only


def synthetic_curves():
    """Forward costs of a compute-bound target: c_B(n) = 1 ms x max(1, B x n / 8) (flat until 8 tokens in the
    forward, then linear); a draft token costs 0.1 ms."""
    from dtbench.harness.calibration.curves import Curves

    rows = []
    for b in (1, 2, 4, 8, 16):
        for n in (1, 2, 4, 8, 16, 32):
            cost = 1e-3 * max(1.0, b * n / 8)
            if b == 1:
                rows += [_Row("target", n, cost), _Row("target", n, cost, tree_mask=True)]
            else:
                rows.append(_Row("target", n, cost, rows=b, tree_mask=True))
    rows += [_Row("draft", n, 1e-4, last_only=True) for n in (1, 2)] + [_Row("draft", n, 1e-4) for n in (1, 2)]
    return Curves(rows)


def test_batched_curves_interpolate_in_b_and_the_prediction_crosses_one():
    from dtbench.reports.pricing.costmodel_batch import B1Params, best_k_at, budget_at, predicted_batch_speedup

    curves = synthetic_curves()
    assert curves.batch_sizes() == [2, 4, 8, 16]
    assert curves.batched_cost(4, 64, 4) == pytest.approx(2e-3)
    assert curves.batched_cost(4, 64, 6) == pytest.approx(3e-3)  # between B=4 and B=8, linear in B
    assert curves.batched_cost(4, 64, 1) == pytest.approx(1e-3)  # B = 1: the plain curve
    # a chain decoder committing 3 tokens per iteration, verifying 5, drafting 4 tokens per row (0.4 ms)
    chain = B1Params(L=3.0, n=5.0, d=4e-4)
    s = {b: predicted_batch_speedup(curves, chain, b, 64) for b in (1, 2, 4, 8, 16)}
    assert s[1] == pytest.approx(3 * 1e-3 / (1e-3 + 4e-4))  # memory-bound: verifying is nearly free
    assert s[1] > s[2] > s[4] > s[8] >= s[16] and s[16] < 1 < s[1]  # compute-bound at large B: B* exists
    ar = B1Params(L=1.0, n=1.0, d=0.0, family="ar")
    assert all(predicted_batch_speedup(curves, ar, b, 64) == pytest.approx(1.0) for b in (1, 4, 16))
    # the best K shrinks as B grows (drafts stop being free), the node budget too
    p = [0.8] * 8
    ks = {b: best_k_at(curves, p, 1e-4, b, 64)[0] for b in (1, 16)}
    assert ks[16] < ks[1]
    assert budget_at(curves, 16, 64, ceiling=64) < budget_at(curves, 1, 64, ceiling=64)


def test_a_batch_pays_for_its_widest_row():
    """Issue 39 item 5: ragged drafts are padded to the widest row, so a copy method that drafts 10 tokens in one
    iteration of five verifies 11 per row at B = 16 in nearly every iteration; the mean width (3) undercounts it."""
    from dtbench.reports.pricing.costmodel_batch import B1Params, predicted_batch_speedup, widest_of, width_distribution

    widths = width_distribution([1, 1, 1, 1, 11])
    assert widths == {1: 0.8, 11: pytest.approx(0.2)}
    assert widest_of(widths, 1) == pytest.approx(widths)
    at16 = widest_of(widths, 16)
    assert at16[1] == pytest.approx(0.8**16) and at16[11] == pytest.approx(1 - 0.8**16)
    assert sum(widest_of({1: 0.5, 3: 0.25, 9: 0.25}, 4).values()) == pytest.approx(1.0)
    curves = synthetic_curves()
    mean = B1Params(L=1.2, n=3.0, d=0.0, family="chain")
    padded = replace(mean, widths=widths)
    # B = 16: c_16(11) = 22 ms in 97% of iterations vs c_16(3) = 6 ms at the mean width
    assert predicted_batch_speedup(curves, padded, 16, 64) < 0.5 * predicted_batch_speedup(curves, mean, 16, 64)
    expected = 1.2 * 2e-3 / (0.8**16 * 2e-3 + (1 - 0.8**16) * 22e-3)
    assert predicted_batch_speedup(curves, padded, 16, 64) == pytest.approx(expected)


def test_the_whole_cell_prediction_pays_the_prefill_of_b_prompts():
    """Measured speedups are whole-cell ratios: with the prefill of B prompts calibrated, ar and the decoder both pay
    it (and a draft model one draft prefill per row), so a slow decoder's speedup is pulled toward 1."""
    from dtbench.harness.calibration.curves import Curves
    from dtbench.reports.pricing.costmodel_batch import B1Params, predicted_batch_speedup

    rows = list(synthetic_curves().rows)
    rows += [_Row("target", 16, 4e-3, cache_len=0)] + [
        _Row("target", 16, 4e-3 * b, rows=b, cache_len=0) for b in (2, 4)
    ]
    rows += [_Row("draft", 16, 1e-3, cache_len=0)]
    curves = Curves(rows)
    assert curves.batched_prefill(16, 1) == pytest.approx(4e-3)
    assert curves.batched_prefill(16, 3) == pytest.approx(12e-3)  # linear in B between calibrated sizes
    assert Curves(synthetic_curves().rows).batched_prefill(16, 4) is None  # a calibration from before issue 39
    ar = B1Params(L=1.0, L_dec=1.0, n=1.0, d=0.0, iters=32.0, samples=1.0, widths={1: 1.0}, family="ar")
    assert all(predicted_batch_speedup(curves, ar, b, 64, 32, 16) == pytest.approx(1.0) for b in (1, 2, 4))
    # 4 drafts per decode iteration at 0.1 ms each (draft_s 0.4 ms x 8 iterations + one 1 ms draft prefill)
    chain = B1Params(L=4.0, L_dec=31 / 7, n=5.0, d=(7 * 4e-4 + 1e-3) / 8, iters=8.0, samples=1.0)
    chain = replace(chain, widths={5: 1.0}, has_draft=True)
    at4 = predicted_batch_speedup(curves, chain, 4, 64, 32, 16)
    ar_time = 16e-3 + 31 * curves.batched_cost(1, 64, 4)
    spec_time = 16e-3 + 4 * 1e-3 + 7 * (curves.batched_cost(5, 64, 4) + 4 * 4e-4)
    assert at4 == pytest.approx(ar_time / spec_time)
    steady = predicted_batch_speedup(curves, chain, 4, 64)
    assert abs(at4 - 1) < abs(steady - 1)  # the shared prefill pulls the ratio toward 1


def test_a_batch_replays_its_rows_b1_iterations():
    """Issue 39 item 5: a group at B replays its rows' B = 1 iterations (greedy lossless rows commit the same tokens
    in the same iterations at any B): each iteration verifies the widest active row's width over the rows still
    decoding, every active row pays its own draft seconds, and the speedup is the ratio of mean group throughputs."""
    from dtbench.reports.pricing.batch_replay import RowTrace, replay_group, replay_speedup

    curves = synthetic_curves()  # c_B(n) = 1 ms x max(1, B x n / 8); no prefill calibrated: none is priced
    fast = RowTrace(widths=(5, 5), committed=(5, 2), seconds=1e-4, tokens=8, draft_prefill=0.0)
    slow = RowTrace(widths=(1,) * 7, committed=(1,) * 7, seconds=0.0, tokens=8, draft_prefill=0.0)
    # two iterations at B = 2, width 5 (fast pads slow): 1.25 ms + 0.1 ms each; then slow alone for 5: 1 ms each
    assert replay_group(curves, [fast, slow], 16, "chain") == pytest.approx(2 * (1.25e-3 + 1e-4) + 5 * 1e-3)
    assert replay_group(curves, [fast], 16, "chain") == pytest.approx(2 * 1.1e-3)
    ar = RowTrace(widths=(1,) * 7, committed=(1,) * 7, seconds=0.0, tokens=8, draft_prefill=0.0)
    assert replay_speedup(curves, [ar] * 4, 2, 16, 8, "ar") == pytest.approx(1.0)
    # B = 1: the mean of the prompts' throughputs over ar's (fast: 8 tokens in 2.2 ms, slow as ar: 7 ms)
    assert replay_speedup(curves, [fast, slow], 1, 16, 8, "chain") == pytest.approx(
        (8 / 2.2e-3 + 8 / 7e-3) / 2 / (8 / 7e-3)
    )
    assert replay_speedup(curves, [fast, slow], 2, 16, 8, "chain") == pytest.approx(7e-3 / 7.7e-3)  # one group
    assert math.isnan(replay_speedup(curves, [fast], 2, 16, 8, "chain"))  # no whole group


def test_an_external_loop_gets_no_batch_prediction():
    """hf_generate and servers run their own loop: the steady-state model has nothing to price them with."""
    from dtbench.reports.pricing.costmodel_batch import B1Params, priced

    def of(family: str) -> B1Params:
        return B1Params(L=1.0, n=1.0, d=0.0, family=family)

    assert priced(of("chain")) and priced(of("tree")) and priced(of("ar"))
    assert not priced(of("external")) and not priced(None)


def test_calibration_visits_every_point_in_interleaved_passes(monkeypatch):
    """Issue 39 item 5: every point (batched and B = 1 curves alike) is timed in ``passes`` passes of random order,
    not curve after curve, so a slow spell of the machine does not skew one curve; a point's repeats are over all its
    visits; the B = 1 curves of one cache share it (cropped back after each forward)."""
    from dtbench.decoders import kv
    from dtbench.harness.calibration import calibrate

    fed: list[tuple[str, int, int]] = []  # (kind, rows, new tokens) of every forward, warmups included

    class Batch:
        def __init__(self, model):
            self.rows = 0

        def prefill(self, prompts):
            self.rows = len(prompts)

        def forward(self, rows):
            fed.append(("batched", len(rows), len(rows[0])))

        def keep(self, kept):
            assert len(kept) == self.rows

    caches: list[object] = []
    monkeypatch.setattr(kv, "RaggedBatch", Batch)
    monkeypatch.setattr(kv, "new_cache", lambda: caches.append(object()) or caches[-1])
    monkeypatch.setattr(kv, "crop", lambda cache, n: None)

    def forward(model, toks, cache, last_only=False, **kw):
        n = len(toks) if isinstance(toks, list) else int(toks.shape[-1])
        fed.append(("last" if last_only else "causal", 1, n))

    monkeypatch.setattr(kv, "forward", forward)
    model = type("M", (), {"device": torch.device("cpu")})()
    ticks = iter(range(10**6))
    batched = [calibrate.Curve("target", "batched", 8, 8, (1, 2, 3), rows=b) for b in (2, 4)]
    single = [calibrate.Curve("target", k, 8, 8, (1, 2, 3)) for k in ("causal", "last")]
    curves = batched + single
    settings = calibrate.Settings(min_repeats=6, max_time_s=30.0, warmup=1, passes=3)  # 2 forwards a visit
    out = calibrate.measure_interleaved(
        {"target": model}, curves, {8: list(range(8))}, torch.device("cpu"), settings, lambda: float(next(ticks))
    )
    assert {c: [m[0] for m in out[c]] for c in curves} == {c: [1, 2, 3] for c in curves}
    assert all(m[3] == 3 * 2 for c in curves for m in out[c])  # 2 timed forwards per visit, 3 visits
    assert len(caches) == 1  # the causal and last curves on 8 cached positions share one cache (built untimed)
    timed = fed[1:]  # after the one cache's fill
    first, later = timed[: 12 * 3], timed[12 * 3 :]  # first visits: 1 warmup + 2 timed forwards; later ones 2 timed
    visits = [first[i] for i in range(0, len(first), 3)] + [later[i] for i in range(0, len(later), 2)]
    assert all(first[i] == first[i + 1] == first[i + 2] for i in range(0, len(first), 3))
    assert all(later[i] == later[i + 1] for i in range(0, len(later), 2))
    points = sorted(
        {("batched", b, n) for b in (2, 4) for n in (1, 2, 3)}
        | {(k, 1, n) for k in ("causal", "last") for n in (1, 2, 3)}
    )
    assert len(visits) == 3 * 12 and sorted(set(visits)) == points
    first_pass = [v[:2] for v in visits[:12]]
    assert first_pass != sorted(first_pass) and first_pass != sorted(first_pass, reverse=True)  # the curves mixed
    assert sorted(visits[:12]) == points  # each pass visits every point once


def test_speedup_vs_batch_figure_bands_prediction_and_b_star():
    import pandas as pd

    from dtbench.reports.rendering.plotting import speedup_vs_batch

    measured = pd.DataFrame(
        [
            dict(dataset="w", l_max=64, gen_length=32, batch_size=b, label="linear", speedup=s, ci_low=lo, ci_high=hi)
            for b, s, lo, hi in ((1, 1.8, 1.6, 2.0), (4, 1.2, 1.0, 1.4), (16, 0.7, float("nan"), float("nan")))
        ]
    )
    predicted = measured.assign(predicted_speedup=[1.9, 1.1, 0.8])
    fig = speedup_vs_batch(measured, predicted)
    ax = fig.axes[0]
    lines = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(lines) == 1 and list(lines[0].get_ydata()) == [1.9, 1.1, 0.8]  # the prediction, dashed
    assert any(t.get_text() == "B*=16" for t in ax.texts)  # the first B below 1, marked
    assert len(ax.collections) == 1  # the CI band
    assert [int(t) for t in ax.get_xticks()] == [1, 4, 16]
    assert speedup_vs_batch(measured[measured["batch_size"] == 1]).startswith("speedup-vs-batch figure skipped")


def test_a_calibrated_run_reports_speedup_vs_b_with_prediction_and_figure(monkeypatch, pair, tmp_path, data_dir):
    """calibrate: true with batch sizes measures the target's batched curves; --cost-model prints the batch table
    (measured with CI, predicted), B* lines and the mean absolute error; --figures writes the figure."""
    from kit import fast_calibration_settings

    from dtbench.harness.calibration import calibrate_run

    monkeypatch.setattr(calibrate_run, "Settings", fast_calibration_settings())
    suite = suite_dict(
        *pair, [{"name": "ar"}, {"name": "linear", "params": {"k": 2}}], batch_sizes=[1, 2], calibrate=True
    )
    suite["datasets"][0].update(prompts=5, warmup=1)
    result, dbfile = run_cli(tmp_path, data_dir, suite)
    assert result.exit_code == 0, result.output
    with db.connect(str(dbfile))() as s:
        rows = {r.rows for r in s.scalars(select(db.Calibration))}
        batched = [r for r in s.scalars(select(db.Calibration)) if r.rows == 2]
    assert rows >= {None, 2} or rows >= {1, 2}
    assert batched and {r.n for r in batched} >= {1, 2, 3} and all(r.tree_mask for r in batched)
    out = invoke("report", "--db", str(dbfile), "--cost-model", "--format", "json")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert {r["batch_size"] for r in doc["batch_sizes"]["rows"]} == {1, 2}
    assert all(r["predicted_speedup"] > 0 for r in doc["batch_sizes"]["rows"])
    text = invoke("report", "--db", str(dbfile), "--cost-model", "--format", "markdown").stdout
    assert "speedup vs batch size, measured and predicted" in text
    assert "linear (wikitext-2, L_max=16, T=6): measured" in text and "; predicted" in text
    assert "best K per B: B=1: K=" in text and "mean absolute error of predicted vs measured speedup" in text
    figs = tmp_path / "figs"
    shown = invoke("report", "--db", str(dbfile), "--figures", str(figs))
    assert shown.exit_code == 0, shown.output
    assert (figs / "speedup_vs_batch.png").exists() and (figs / "speedup_vs_batch.svg").exists()


FLAKY = '''
import os
from dtbench.decoders.ar import Autoregressive


class Flaky(Autoregressive):
    """Batched AR whose second batch (while the file named by DTBENCH_FLAKY exists) is a Ctrl-C."""

    supports_sampling = False

    @classmethod
    def reference(cls, params):
        return ("ar", {})

    def generate_batch(self, prompts, max_new_tokens):
        path = os.environ["DTBENCH_FLAKY"]
        if os.path.exists(path):
            calls = int(open(path).read() or 0)
            open(path, "w").write(str(calls + 1))
            if calls == 1:
                raise KeyboardInterrupt
        yield from super().generate_batch(prompts, max_new_tokens)
'''


def test_an_interrupted_batched_run_resumes_group_by_group(monkeypatch, pair, tmp_path, data_dir):
    install_plugin(monkeypatch, tmp_path / "site", "dtbench-flaky", {"flaky": "dtbench_flaky:Flaky"}, FLAKY)
    marker = tmp_path / "fail"
    marker.write_text("")
    monkeypatch.setenv("DTBENCH_FLAKY", str(marker))
    suite = suite_dict(*pair, [{"name": "ar"}, {"name": "flaky"}], batch_sizes=[2])
    suite["datasets"][0].update(prompts=4, warmup=0)
    result, dbfile = run_cli(tmp_path, data_dir, suite)
    assert "interrupted" in result.output, result.output
    before = {x.prompt_index: (x.id, x.output_hash) for x in cells_of(dbfile)[("ar", 2)]}
    kept = {x.prompt_index: x.id for x in cells_of(dbfile)[("flaky", 2)]}
    assert len(before) == 4 and set(kept) == {0, 1}  # the first group stored whole, the second not at all
    marker.unlink()
    again = invoke(
        "run",
        str(tmp_path / "suite.yaml"),
        "--db",
        str(dbfile),
        "--data-dir",
        str(data_dir),
        "--no-progress",
        "--resume-run",
        "1",
    )
    assert again.exit_code == 0, again.output
    after = cells_of(dbfile)
    assert {x.prompt_index: (x.id, x.output_hash) for x in after[("ar", 2)]} == before  # not measured again
    assert [(x.prompt_index, x.batch_group) for x in after[("flaky", 2)]] == [(0, 0), (1, 0), (2, 2), (3, 2)]
    assert {x.prompt_index: x.id for x in after[("flaky", 2)] if x.prompt_index < 2} == kept
    assert all(x.lossless for x in after[("flaky", 2)])
