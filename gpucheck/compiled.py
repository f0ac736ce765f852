"""Step e, **compiled** (issue 37): eager beside compiled execution at the paper's shapes (:func:`step_compiled`;
the package docstring)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from dtbench.gpucheck.common import build
from dtbench.gpucheck.overhead import REPEATS, differential, medians

COMPILED_DECODERS: tuple[tuple[str, dict[str, Any]], ...] = (("linear", {"k": 8}), ("dynatree", {}))
# linear's K = 8 draft forwards as one compiled region (issue 46 item 2), compiled only (it has no eager form): its
# overhead row beside the per-forward one above
FUSED_DRAFT: tuple[str, dict[str, Any]] = ("linear", {"k": 8, "fused_draft": True})


def _mode(ex, compiled: bool):
    """The context of one mode: ``ex``'s compiled execution (:func:`dtbench.decoders.static_kv.compiled`) or
    eager."""
    from contextlib import nullcontext

    from dtbench.decoders import static_kv

    return static_kv.compiled(ex) if compiled else nullcontext()


def _forward_s(ex, target, prompt: list[int], device, compiled: bool, n: int) -> float:
    """Median seconds of one target forward of ``n`` new tokens after the prompt's cache, in one mode (one session
    of the forward timer, :meth:`~dtbench.harness.measurement.forwards.ForwardTimer.session`: one untimed forward warms the
    shape, then :data:`REPEATS` timed ones, the cache cropped back after each)."""
    import torch

    from dtbench.decoders import kv
    from dtbench.harness.measurement.forwards import ForwardTimer, StopRule

    ids = torch.tensor([prompt], device=device)
    new = torch.randint(3, target.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    with torch.inference_mode(), _mode(ex, compiled):
        ex.begin_sample()
        cache, _ = kv.prefill(target, ids)
        return (
            ForwardTimer(device)
            .session(
                lambda: kv.forward(target, new, cache),
                StopRule(min_repeats=REPEATS),
                reset=lambda: kv.crop(cache, len(prompt)),
                warmup=1,
            )
            .median
        )


def _profile(ex, target, prompt: list[int], device, compiled: bool) -> dict:
    """A ``torch.profiler`` summary of one target forward of one new token after the prompt's cache, in one mode
    (issue 46 item 3: where a compiled forward's time goes; :func:`~dtbench.harness.measurement.kernel_profile.profile_call`)."""
    import torch

    from dtbench.decoders import kv
    from dtbench.harness.measurement.kernel_profile import profile_call

    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode(), _mode(ex, compiled):
        ex.begin_sample()
        cache, _ = kv.prefill(target, ids)

        def one() -> None:
            kv.crop(cache, len(prompt))
            kv.forward(target, [5], cache)

        return profile_call(one, device)


def _overhead_row(ex, name: str, params: dict, run: Callable[[int], Any], T0: int, T: int, compiled: bool) -> dict:
    """One decoder's loop overhead per iteration in one mode (:func:`~dtbench.gpucheck.overhead.differential` of
    ``run(T0)`` and ``run(T0 + T)``, :data:`REPEATS` each, after a warmup that compiles its other shapes)."""
    row: dict[str, Any] = {"decoder": name, "params": params, "mode": "compiled" if compiled else "eager"}
    try:
        with _mode(ex, compiled):
            run(T0 + T)  # warmup: compiles the shapes this decoder uses that were not compiled before
            short, long = medians(lambda: run(T0)), medians(lambda: run(T0 + T))
        (w0, f0, _, _), (w1, f1, _, _) = short, long
        iters, loop = differential(short, long)
        row.update(
            iterations=iters,
            overhead_s_per_iter=loop / iters if iters else None,
            forward_s_per_iter=(f1 - f0) / iters if iters else None,
            overhead_share=loop / max(w1 - w0, 1e-12),
            ok=iters > 0,
        )
    except Exception as exc:
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
    return row


def step_compiled(device, target, draft, small: bool, workdir: Path, log) -> dict:
    """Eager vs compiled execution at the paper's shapes (the package docstring, step e). Medians of
    :data:`REPEATS`.

    Returns:
        {"ok", "compile_s", "graphs", "bandwidth", "forwards": [{n, eager_s, compiled_s, limit_s, eager_roofline,
        compiled_roofline}], "profile_n1": {mode: the kernel_profile summary of one n = 1 forward}, "ar": {mode:
        {tokens_per_s, roofline}}, "overhead": [{decoder, mode,
        overhead_s_per_iter, forward_s_per_iter, overhead_share}]}.
    """
    import torch

    from dtbench.decoders import static_kv
    from dtbench.harness.calibration import roofline
    from dtbench.harness.measurement.measure import measure

    vocab = target.config.vocab_size
    L, T0, T = (24, 2, 16) if small else (800, 8, 64)
    ns = (1, 9, 16) if small else (1, 9, 64, 190)
    prompt = torch.randint(3, vocab, (L,), generator=torch.Generator().manual_seed(2)).tolist()
    bandwidth = roofline.measure_bandwidth(device)
    bw = bandwidth["bytes_per_s"]
    sizes = roofline.model_bytes(target)
    ex = static_kv.Execution(-(-(L + T0 + T + 2 * 256) // 64) * 64)
    # the forwards below and ar's; the decoders' other sizes compile in their untimed warmup run (a whole precompile
    # would pass the budget)
    compiles = [ex.precompile([target], 0, sizes=ns), ex.precompile([draft], 0, sizes=(1, 2))]
    compile_s, graphs = sum(c[0] for c in compiles), sum(c[1] for c in compiles)
    log(f"compiled: {graphs} graphs in {compile_s:.1f} s")

    forwards = []
    for n in ns:
        eager, compiled = (_forward_s(ex, target, prompt, device, c, n) for c in (False, True))
        limit = roofline.limit_seconds([[n, L, 0]], sizes, bw) if sizes and bw else None
        forwards.append(
            {
                "n": n,
                "eager_s": eager,
                "compiled_s": compiled,
                "limit_s": limit,
                "eager_roofline": limit / eager if limit else None,
                "compiled_roofline": limit / compiled if limit else None,
            }
        )

    profiles = {}
    for compiled in (False, True):
        try:
            profiles["compiled" if compiled else "eager"] = _profile(ex, target, prompt, device, compiled)
        except Exception as exc:  # a diagnostic: its failure is recorded, never fails the step
            profiles["compiled" if compiled else "eager"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}

    def run(name: str, params: dict, length: int):  # one sample from a fresh static cache
        ex.begin_sample()
        return measure(build(name, params, target, draft, workdir), prompt, length, device)

    ar: dict[str, Any] = {}
    for compiled in (False, True):
        with _mode(ex, compiled):
            run("ar", {}, T0)  # warmup
            m = run("ar", {}, T)
        total = m.step_times[-1]
        ar["compiled" if compiled else "eager"] = {
            "tokens_per_s": T / total,
            "roofline": roofline.sample_fraction(m.records, total, sizes, None, bw),
        }
    overhead = []
    for name, params in (*COMPILED_DECODERS, FUSED_DRAFT):
        for compiled in (True,) if params.get("fused_draft") else (False, True):
            row = _overhead_row(ex, name, params, partial(run, name, params), T0, T, compiled)
            overhead.append(row)
            log(
                f"compiled {row['mode']} {name} {params}: overhead {row.get('overhead_s_per_iter')} s/iter {row.get('error', '')}"
            )
    return {
        "ok": all(r["ok"] for r in overhead),
        "compile_s": compile_s,
        "graphs": graphs,
        "bandwidth": bandwidth,
        "prompt_tokens": L,
        "T": T,
        "forwards": forwards,
        "profile_n1": profiles,
        "ar": ar,
        "overhead": overhead,
    }
