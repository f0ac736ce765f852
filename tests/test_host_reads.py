"""The loop, not the harness (issue 46): device-to-host reads per iteration and graph breaks in compiled regions.

Device-to-host reads per iteration (item 1): on a GPU each read (``.item()``, ``.tolist()``, ``bool(t)``,
``.cpu()``, ...) waits for every queued kernel, so a loop that reads more than once per iteration serializes the host
with the device. Counted on the CPU with a ``TorchFunctionMode`` that sees every such Tensor method call, the models'
own forwards included.

- ``ar``, ``linear`` (device-resident drafts: the chain's K draft tokens are fed forward as tensors, never read one
  by one), ``ngram`` and ``suffix``: at most ONE read per iteration, the prefill's iteration included (the prompt's
  ids and the first token come back in one read), eager and compiled.
- ``fixed_tree``, ``dynatree`` with ``resident: full`` (decoders/tree/resident.py: drafting decided on the device
  over static padded levels, the capacity-padded tree verified): at most ONE read per iteration, eager and
  compiled; ``resident: draft`` at most two (the tree's size before verification, the path after).
- The same with ``resident: off`` (the default: the host decides each level, exact shapes): the loop reads each
  drafted level's decisions and once more to select the path, at most 1 + its drafted levels; the test holds that
  bound so it cannot grow unnoticed.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import cache

import pytest
import torch
from models import COMPILED_MAX_LEN, model_zoo

from dtbench.decoders import static_kv
from dtbench.harness import registry
from dtbench.harness.measurement import host_reads

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = list(range(3, 30))
T = 40
EXECUTION = static_kv.Execution(max_len=COMPILED_MAX_LEN)


def reads_per_iteration(decoder, compiled: bool, counted: bool = False) -> tuple[list[int], list]:
    """(host reads during each iteration, the Steps), through the harness's counter (harness/measurement/host_reads.py);
    ``counted``: with the measurement's forward counter and timer installed."""
    ex = EXECUTION if compiled else None
    counts = host_reads.reads_per_iteration(decoder, PROMPT, T, torch.device("cpu"), ex, counted=counted)
    steps = []
    gen = decoder.generate(torch.tensor([PROMPT]), T)  # the Steps again (deterministic), for their fields
    with static_kv.compiled(EXECUTION) if compiled else nullcontext():
        if compiled:
            EXECUTION.begin_sample()
        for step in gen:
            steps.append(step)
            if sum(len(s.tokens) for s in steps) >= T:
                break
    gen.close()
    assert counts["cuda_syncs"] == [0] * len(steps)  # off CUDA nothing is reported
    return counts["host_reads"], steps


@cache
def _pair(compiled: bool):
    target, draft = model_zoo()["perturbed"]
    if compiled:
        EXECUTION.precompile([target, draft], 16)
    return target, draft


def build(name: str, params: dict, compiled: bool):
    target, draft = _pair(compiled)
    cls = registry.get(name)
    return cls(target, draft if cls.needs_draft else None, cls.Params(**params))


ONE_READ = [("ar", {}), ("linear", {"k": 4}), ("ngram", {"k": 3}), ("suffix", {"k": 6})]


@pytest.mark.parametrize("compiled", [True], ids=["compiled"])  # eager: the kit's host_reads check (issue 56)
@pytest.mark.parametrize(("name", "params"), ONE_READ, ids=[n for n, _ in ONE_READ])
def test_at_most_one_host_read_per_iteration(name, params, compiled):
    if compiled and not registry.get(name).compiles:
        pytest.skip(f"{name} has no compiled execution")
    per, steps = reads_per_iteration(build(name, params, compiled), compiled)
    assert len(steps) > 3
    assert max(per) <= 1, per
    if name == "linear":  # the drafts really were proposed and verified (not a degenerate AR run)
        assert [s.drafted for s in steps[1:4]] == [4, 4, 4]


MEASURED = [*ONE_READ, ("hf_generate", {})]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(("name", "params"), MEASURED, ids=[n for n, _ in MEASURED])
def test_the_measurements_hooks_add_no_host_read(name, params, compiled):
    """As a cell measures (the forward counter's hooks around every forward), each iteration reads exactly as often
    as the bare loop: the hooks learn a forward's KV positions without reading the device (a static cache's length
    is a device tensor; reading it in every forward's hook synchronized a GPU with the host once per forward)."""
    if compiled and not registry.get(name).compiles:
        pytest.skip(f"{name} has no compiled execution")
    decoder = build(name, params, compiled)
    reads_per_iteration(decoder, compiled)  # once first: transformers' prefill reads less on a fresh static cache
    bare, steps = reads_per_iteration(decoder, compiled)
    measured, _ = reads_per_iteration(decoder, compiled, counted=True)
    assert len(steps) > 3
    assert measured == bare


TREES = [
    ("fixed_tree", {"depth": 3, "branching": 2, "tau": 0.0}),
    ("dynatree", {"n_max": 16, "tau": 0.0, "d0": 3, "d_max": 4, "rho_stop": 1e-4, "rho_deep": 1e-3}),
]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(("name", "params"), TREES, ids=[n for n, _ in TREES])
def test_resident_tree_loops_read_once_per_iteration(name, params, compiled):
    full, steps = reads_per_iteration(build(name, {**params, "resident": "full"}, compiled), compiled)
    assert len(steps) > 3 and max(full) <= 1, full
    assert any(s.depth >= 2 for s in steps)  # trees of several drafted levels, each decided without a read
    draft, _ = reads_per_iteration(build(name, {**params, "resident": "draft"}, compiled), compiled)
    assert max(draft) <= 2, draft


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(("name", "params"), TREES, ids=[n for n, _ in TREES])
def test_host_tree_loops_read_once_per_drafted_level_and_once_to_select(name, params, compiled):
    per, steps = reads_per_iteration(build(name, params, compiled), compiled)
    assert per[0] <= 1  # the prefill: prompt and first token in one read
    for reads, step in zip(per[1:], steps[1:], strict=True):
        assert reads <= 1 + max(step.depth, 1), (per, [s.depth for s in steps])
    assert max(per) > 2  # the bound is reached: this is what resident drafting removes


COMPILED = [
    ("ar", {}),
    ("linear", {"k": 4}),
    ("dynatree", {"n_max": 16}),
    ("dynatree", {"n_max": 16, "tau": 0.0, "d_max": 4, "d0": 3, "resident": "full"}),
    ("ngram", {"k": 3}),
    ("hf_generate", {}),
]


@pytest.mark.parametrize(
    ("name", "params"), COMPILED, ids=[n + ("-resident" if "resident" in p else "") for n, p in COMPILED]
)
@pytest.mark.full  # compiles every region
def test_no_graph_break_in_any_compiled_region(name, params):
    """Measured as a cell measures (the runner's forward counter and timer installed by ``measure``), no compiled
    region breaks its graph: the harness's hooks run outside it (issue 46 item 3; transformers' compiled decoding
    used to trace them and break at ``Tensor.item()`` and ``time.perf_counter`` at every step)."""
    import torch._dynamo.utils as dynamo_utils

    from dtbench.harness.measurement.measure import measure

    decoder = build(name, params, compiled=True)
    dynamo_utils.counters["graph_break"].clear()  # only these: the run summary counts inductor's graphs (conftest)
    with static_kv.compiled(EXECUTION):
        EXECUTION.begin_sample()
        m = measure(decoder, PROMPT, 24, torch.device("cpu"))
    assert len(m.tokens) == 24 and m.records[-1].target_forwards >= 1
    assert dict(dynamo_utils.counters["graph_break"]) == {}
    if name == "hf_generate":  # transformers' decoding steps ran through the compiled forward (hooks outside it)
        from dtbench.decoders.static_kv import COMPILED_FORWARDS

        assert decoder.target in COMPILED_FORWARDS


@pytest.mark.full  # compiles (issue 57)
@pytest.mark.parametrize("name", ["ar", "hf_generate"])
def test_compiled_forwards_are_counted_at_their_kv_positions(name):
    """The hooks' KV positions (read without the device, harness/measurement/forwards.past_length) are the positions each forward
    really attended: compiled, every forward's (new tokens, past) equals eager's (one token per forward here, so
    no bucket padding differs)."""
    from dtbench.harness.measurement.measure import measure

    def fed(compiled: bool) -> list:
        decoder = build(name, {}, compiled)
        with static_kv.compiled(EXECUTION) if compiled else nullcontext():
            if compiled:
                EXECUTION.begin_sample()
            m = measure(decoder, PROMPT, 12, torch.device("cpu"))
        return [tuple(e[:2]) for r in m.records for e in r.target_fed]

    eager = fed(False)
    assert eager[:2] == [(len(PROMPT), 0), (1, len(PROMPT))]
    assert fed(True) == eager
