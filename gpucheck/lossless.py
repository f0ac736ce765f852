"""Step a, **lossless**: every built-in lossless decoder against ``ar`` on tiny Llama and GPT-NeoX pairs
(:func:`step_lossless`; the package docstring)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from dtbench.gpucheck.common import build, crash_if_asked, lossless_decoders


def step_lossless(device, small: bool, workdir: Path, log, skip: frozenset = frozenset(), emit=None) -> dict:
    """Every built-in lossless decoder against ``ar`` on tiny Llama and GPT-NeoX pairs, float32 (exact rule) and
    float16 (tie-aware rule; bfloat16 on a CPU). Returns ``{"ok", "rows": [...]}``, one row per (arch, dtype,
    decoder): tokens, first divergence from ``ar``, the check's ties/errors/largest tie margin/noise, ok."""
    import torch

    from dtbench.harness.measurement.lossless import check_output
    from dtbench.harness.measurement.measure import measure
    from dtbench.harness.values import first_divergence
    from dtbench.testing.fixtures import SHARP, perturbed, tiny_model

    T = 16 if small else 48
    prompt = list(range(3, 20))
    half = torch.float16 if device.type == "cuda" else torch.bfloat16
    rows = []
    archs = ("llama",) if small else ("llama", "neox")
    for arch in archs:
        base = tiny_model(arch, 0, sharpness=SHARP)
        base_draft = perturbed(base, 0.005, seed=1)
        for dtype in (torch.float32, half):
            target = copy.deepcopy(base).to(device=device, dtype=dtype)
            draft = copy.deepcopy(base_draft).to(device=device, dtype=dtype)
            ref = measure(build("ar", {}, target, None, workdir), prompt, T, device).tokens
            rule = "exact" if dtype == torch.float32 else "tie_aware"
            for i, (name, params) in enumerate(lossless_decoders()):
                rid = f"{arch}/{str(dtype).removeprefix('torch.')}/{i}"
                if rid in skip:
                    continue
                crash_if_asked(name)
                row: dict[str, Any] = {
                    "id": rid,
                    "arch": arch,
                    "dtype": str(dtype).removeprefix("torch."),
                    "decoder": name,
                    "params": {k: v for k, v in params.items() if not str(v).startswith("<")},
                    "rule": rule,
                }
                try:
                    m = measure(build(name, params, target, draft, workdir), prompt, T, device)
                    check = check_output(target, prompt, m.tokens, ref, device)
                    div = first_divergence(m.tokens, ref)
                    ok = (div is None) if rule == "exact" else check.errors == 0
                    row.update(
                        tokens=len(m.tokens),
                        iterations=len(m.steps),
                        first_divergence=div,
                        ties=check.ties,
                        errors=check.errors,
                        max_tie_margin=check.max_tie_margin,
                        noise=check.max_noise,
                        ok=ok,
                    )
                except Exception as exc:  # a crashing decoder is a failed row, the check goes on
                    row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
                rows.append(row)
                if emit:
                    emit(row)
                log(
                    f"lossless {arch} {row['dtype']} {name} {row['params']}: "
                    f"{'ok' if row['ok'] else 'FAIL'} {row.get('error', '')}"
                )
    return {"ok": all(r["ok"] for r in rows), "T": T, "prompt_tokens": len(prompt), "rows": rows}
