"""The CUDA paths, on a CUDA GPU (marker ``cuda``; ``make gpu-check`` / ``dtbench doctor`` runs them).

Collected everywhere and skipped with a reason without a GPU. On a GPU they check what no CPU test can:

- every built-in lossless decoder reproduces greedy AR on CUDA in float32 token for token (the embedded SmolLM2-135M,
  a real model, so near-ties are rare), and in float16 every emitted token passes a teacher-forced, tie-aware check:
  its logit is within :data:`FP16_TIE_LOGITS` of the best logit the target gives at that position over the same
  prefix (fp16 rounding differs between a chain/tree verification and one full forward);
- CUDA-event forward times (:class:`~dtbench.harness.measurement.measure.ForwardCounter`) agree with the wall clock around
  synchronized forwards within :data:`EVENT_REL_TOL` (relative) + :data:`EVENT_ABS_TOL_S`;
- NVML's per-process peak memory is at least the torch allocator's peak (NVML adds the CUDA context and the
  allocator's cache) and not more than :data:`NVML_OVER_ALLOCATOR` above it;
- the Ray executor runs a suite on CUDA with one actor per GPU (``num_gpus=1``).
"""

from __future__ import annotations

import copy
import io
import time

import pytest
import torch

from dtbench.harness import registry
from dtbench.harness.data.prompt import Prompt
from dtbench.harness.measurement.measure import ForwardCounter, MemoryTracker, measure
from dtbench.harness.measurement.observation import sample_row
from dtbench.harness.models import loading as models
from dtbench.harness.suites.suite import ModelSpec
from dtbench.testing.fixtures import HEAD, builtin_settings

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `make gpu-check` on a GPU node)"),
]

CUDA = torch.device("cuda", 0)
T = 32
FP16_TIE_LOGITS = 0.25  # fp16 logits of ~10-30 carry ~0.01-0.03 rounding per op; a gap below this is a near tie
EVENT_REL_TOL, EVENT_ABS_TOL_S = 0.10, 0.5e-3
NVML_OVER_ALLOCATOR = 4 * 2**30  # CUDA context (~0.3-1 GiB) + allocator cache stay well below this


def lossless_builtins() -> set[str]:
    """Every built-in decoder that promises losslessness and decodes in this process (a ``requests`` decoder,
    ``server``, is checked against its plain server by tests/test_server_engine.py)."""
    return {
        n
        for n, e in registry.discover().items()
        if e.distribution == "dtbench" and registry.get(n).lossless and not registry.get(n).requests
    }


# Every built-in lossless decoder with the small params test_measurement gives it (which must cover every built-in).
LOSSLESS = [(n, p) for n, p in builtin_settings() if registry.get(n).lossless]


@pytest.fixture(scope="module")
def embedded():
    """The embedded model as float32 and float16 targets on CUDA, and its tokenizer."""
    spec = ModelSpec(model="smollm2-135m", dtype="float32")
    fp32 = models.load_model(spec, CUDA).model
    return {"float32": fp32, "float16": copy.deepcopy(fp32).to(torch.float16)}, models.load_tokenizer(spec)


@pytest.fixture(scope="module")
def prompt(embedded, data_dir):
    text = (data_dir / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")[:2000]
    return embedded[1](text)["input_ids"][:64]


def build(name: str, params: dict, target, draft, tmp_path):
    cls = registry.get(name)
    if params.get("head") == HEAD:  # a random head in the published format, sized for the target
        from dtbench.testing.fixtures import write_eagle, write_medusa

        cfg = target.config
        write = write_medusa if name == "medusa" else write_eagle
        params = {**params, "head": str(write(tmp_path, hidden=cfg.hidden_size, vocab=cfg.vocab_size))}
    return cls(target, draft if cls.needs_draft else None, cls.Params(**params))


def teacher_forced_misses(target, prompt: list[int], tokens: list[int], tie: float) -> list[int]:
    """Positions whose emitted token is more than ``tie`` logits below the target's best, given the same prefix."""
    ids = torch.tensor([prompt + tokens], device=CUDA)
    with torch.no_grad():
        logits = target(ids).logits[0, len(prompt) - 1 : -1].float()  # [T, vocab]: the prediction of each emitted token
    emitted = logits.gather(1, torch.tensor(tokens, device=CUDA)[:, None])[:, 0]
    return [i for i, gap in enumerate((logits.max(dim=1).values - emitted).tolist()) if gap > tie]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name, params", LOSSLESS, ids=[f"{n}-{'-'.join(map(str, p.values()))}" for n, p in LOSSLESS])
def test_lossless_on_cuda(embedded, prompt, tmp_path, name, params, dtype):
    targets, _ = embedded
    target = targets[dtype]
    draft = copy.deepcopy(target).to(torch.bfloat16 if dtype == "float32" else torch.float16)
    ar = measure(build("ar", {}, target, None, tmp_path), prompt, T, CUDA)
    m = measure(build(name, params, target, draft, tmp_path), prompt, T, CUDA)
    row = sample_row(m, Prompt(0, "doc", tuple(prompt)), False, ar.tokens)
    assert row["new_tokens"] == T and row["peak_allocated_bytes"] > 0
    if dtype == "float32":
        assert m.tokens == ar.tokens, f"{name} diverged from ar at {row['first_divergence']}"
    else:  # fp16: a near tie may flip an argmax; every emitted token must still be the target's (tie-aware) choice
        assert teacher_forced_misses(target, prompt, m.tokens, FP16_TIE_LOGITS) == []


def test_cuda_event_forward_times_match_the_wall_clock(embedded):
    target = embedded[0]["float32"]
    ids = torch.randint(3, 1000, (1, 512), device=CUDA)
    with torch.no_grad():
        target(ids)  # warm up kernels
        for _ in range(5):
            with ForwardCounter(target, None) as counter:
                torch.cuda.synchronize()
                start = time.perf_counter()
                target(ids)
                torch.cuda.synchronize()
                wall = time.perf_counter() - start
            events = counter.forward_seconds()["target"]
            assert events <= wall + EVENT_ABS_TOL_S
            assert events >= wall * (1 - EVENT_REL_TOL) - EVENT_ABS_TOL_S, (events, wall)


def test_nvml_process_peak_against_the_allocator_peak():
    size = 512 * 2**20
    with MemoryTracker(CUDA) as mem:
        block = torch.empty(size, dtype=torch.uint8, device=CUDA)
        block.fill_(1)
        torch.cuda.synchronize()
        time.sleep(0.1)  # NVML is polled every 5 ms
        del block
    peak = mem.peak
    assert peak.allocated_bytes >= size
    assert peak.nvml_bytes is not None, "NVML gave no reading on this GPU"
    assert peak.nvml_bytes >= peak.allocated_bytes
    if peak.nvml_scope == "process":
        assert peak.nvml_bytes - peak.allocated_bytes < NVML_OVER_ALLOCATOR


def test_ray_executor_one_worker_per_gpu(tmp_path, data_dir):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'dtbench[ray]')")
    from kit import suite_dict, tiny_pair, write_suite
    from rich.console import Console
    from sqlalchemy import select

    from dtbench.harness.execution.executors import RayExecutor
    from dtbench.harness.execution.runner import run_suite
    from dtbench.harness.store import db
    from dtbench.harness.suites.suitefile import load_suite

    suite = suite_dict(*tiny_pair(tmp_path), [{"name": "ar"}, {"name": "linear", "params": {"k": 2}}], device="cuda")
    for role in ("target", "draft"):
        suite[role]["dtype"] = "float32"
    parsed, text = load_suite(write_suite(tmp_path, suite))
    executor = RayExecutor(workers=1)
    sessions = db.connect(str(tmp_path / "ray.db"))
    run_id = run_suite(
        parsed,
        text,
        sessions,
        data_dir=str(data_dir),
        executor=executor,
        console=Console(file=io.StringIO()),
        progress=False,
    )
    with sessions() as s:
        run = s.get(db.Run, run_id)
        samples = s.scalars(select(db.Sample)).all()
        assert run.status == "completed" and run.environment["executor"]["device"] == "cuda"
        assert samples and all(smp.device_name == torch.cuda.get_device_name(0) for smp in samples)
        assert all(smp.lossless for smp in samples if smp.lossless is not None)
