"""Build results databases directly with the SQLAlchemy models (no model runs), for report and compare tests.

Every sample gets consistent derived columns: total_s = T / throughput, TTFT and TPOT from it, step lists of
the right length, so reports computed from these rows can be checked against numbers computed here by hand.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml

from dtbench.harness import registry
from dtbench.harness.errors import DtbenchError
from dtbench.harness.store import db
from dtbench.harness.store.db import Cell, Run, Sample

ENV = {
    "dtbench": "0.1.0",
    "torch": "2.13.0+cpu",
    "transformers": "5.23.0",
    "device": "cpu",
    "device_name": "test cpu",
    "git_sha": "abc",
}
# environment["hardware"] as harness.measurement.machine.hardware_flags writes it (runs recorded before it existed lack it).
HARDWARE = {
    "cpu_flags": {
        "avx2": True,
        "avx512f": True,
        "avx512_bf16": True,
        "avx512_fp16": False,
        "amx_bf16": False,
        "amx_tile": False,
    },
    "torch_cpu_capability": "AVX512",
}


def suite_text(name: str, decoders: list[dict[str, Any]], datasets=("wikitext-2",), T=(64,), l_max=128) -> str:
    """A valid suite YAML (stored with the run; reports read its ``sweep:`` entries)."""
    return yaml.safe_dump(
        {
            "name": name,
            "datasets": [{"name": d, "prompts": 10, "warmup": 2, "L_max": l_max} for d in datasets],
            "generation_lengths": list(T),
            "decoders": decoders,
        },
        sort_keys=False,
    )


def add_run(session, name="t", env=None, text=None, status="completed") -> Run:
    run = Run(
        suite_name=name,
        suite_path=None,
        suite_text=text or suite_text(name, [{"name": "ar"}]),
        suite_hash=hashlib.sha256((text or name).encode()).hexdigest(),
        status=status,
        environment=dict(ENV if env is None else env),
    )
    session.add(run)
    session.flush()
    return run


def add_cell(
    session,
    run: Run,
    label: str,
    decoder: str | None = None,
    *,
    dataset="wikitext-2",
    l_max=128,
    T=64,
    params=None,
    version="1",
    status="done",
    error=None,
    target="smollm2 (float32)",
    draft=None,
    sweep_group: str | None = None,
    sampling: dict | None = None,
    family: str | None = None,
) -> Cell:
    """A cell as the runner stores it; ``family`` defaults to the one the installed decoder declares (None for an
    unknown decoder name, as an old database would hold), ``measurer`` to its decoder's (``served`` for ``server``,
    :func:`dtbench.harness.measurement.measurers.registered_measurer`)."""
    from dtbench.harness.measurement.measurers import registered_measurer

    decoder = decoder or label
    if family is None:
        try:
            family = registry.get(decoder).family
        except DtbenchError:
            family = None
    cell = Cell(
        run=run,
        dataset=dataset,
        l_max=l_max,
        gen_length=T,
        decoder=decoder,
        family=family,
        measurer=registered_measurer(decoder),
        label=label,
        decoder_version=version,
        decoder_distribution="dtbench",
        params=params or {},
        lossless_expected=True,
        reference_label=None if decoder == "ar" else "ar",
        target_model=target,
        draft_model=draft if draft is not None else (None if decoder == "ar" else "draft (bf16)"),
        status=status,
        error=error,
        sweep_group=sweep_group,
        sampling=sampling,
    )
    session.add(cell)
    session.flush()
    return cell


def add_served_pair(session, run: Run, spec_params: dict | None = None) -> tuple[Cell, Cell]:
    """A plain server ``plain`` (100 tokens/s) and a speculating one ``spec`` (40 tokens/s, its reference ``plain``),
    6 samples each with one warmup, beside ``ar`` (1 token/s): a served speedup of 0.4, never 40 against ar."""
    add_samples(session, add_cell(session, run, "ar"), [1.0] * 6, warmup=1)
    plain = add_cell(session, run, "plain", "server", params={"base_url": "http://x:1"})
    plain.reference_label = None
    spec = add_cell(session, run, "spec", "server", params=spec_params or {"base_url": "http://x:2"})
    spec.reference_label = "plain"
    add_samples(session, plain, [100.0] * 6, warmup=1)
    add_samples(session, spec, [40.0] * 6, warmup=1)
    return plain, spec


def add_samples(
    session,
    cell: Cell,
    throughputs: list[float],
    *,
    warmup: int = 0,
    ttft_s: float = 0.02,
    acceptance: float | None = None,
    path: float | None = None,
    iterations: int | None = None,
    rss_mib: float = 1000.0,
    allocated_mib: float | None = None,
    start: int = 0,
    diverge: dict[int, int] | None = None,
    bonus: float | None = None,
) -> list[Sample]:
    """One sample per throughput (tokens/s), prompts ``start..``; the first ``warmup`` are warmup samples.

    ``acceptance`` and ``path`` set the acceptance rate and ℓ (both conventions alike unless ``bonus`` gives the
    paper's acceptance incl. the bonus token); AR samples get None for all of them, as the runner stores.

    ``diverge`` maps a sample's position in ``throughputs`` to the token at which its output first differs from
    the reference (that sample is stored with lossless False); every other non-AR sample is lossless.
    """
    diverge = diverge or {}
    T = cell.gen_length
    out = []
    for i, thr in enumerate(throughputs):
        total = T / thr
        iters = iterations or (T if cell.decoder == "ar" else max(1, T // 4))
        s = Sample(
            cell_id=cell.id,
            prompt_index=start + i,
            document=f"doc {start + i}",
            warmup=i < warmup,
            prompt_tokens=cell.l_max,
            new_tokens=T,
            total_s=total,
            ttft_s=ttft_s,
            tpot_s=(total - ttft_s) / (T - 1),
            throughput=thr,
            iterations=iters,
            tokens_per_iteration=T / iters,
            drafted=0 if cell.decoder == "ar" else 4 * iters,
            accepted=0,
            draft_depth=0,
            acceptance_rate=acceptance,
            mean_path_length=path,
            target_forwards=iters,
            acceptance_incl_bonus=bonus if bonus is not None else acceptance,
            mean_path_length_all=path,
            step_tokens=[1] * iters,
            step_stats={"drafted": [], "accepted": [], "depth": []},
            step_times_s=[total],
            peak_rss_bytes=int(rss_mib * 2**20),
            peak_allocated_bytes=int(allocated_mib * 2**20) if allocated_mib is not None else None,
            peak_nvml_bytes=None,
            output_hash=hashlib.sha256(json.dumps([start + i]).encode()).hexdigest(),
            output_tokens=[0] * T,
            lossless=None if cell.decoder == "ar" else i not in diverge,
            first_divergence=diverge.get(i),
        )
        session.add(s)
        out.append(s)
    session.flush()
    return out


def connect(path) -> Any:
    return db.connect(f"sqlite:///{path}")


def runs_of(path, *makers) -> list[int]:
    """Write one run per maker (e.g. :func:`tricky_run`) into the SQLite database at ``path``; their ids."""
    with connect(path)() as session:
        return [make(session) for make in makers]


def _noisy(rng, mean: float, sd: float, n: int) -> list[float]:
    return [max(1.0, float(v)) for v in rng.normal(mean, sd, n)]


def paper_like(session, seed: int = 0) -> list[int]:
    """Three runs shaped like the paper's experiments (numbers near the paper's), for figures and tables.

    Run 1 (suite paper): AR, Linear Spec (K=8 wikitext / K=5 pg19), the ablation trees, DynaTree, the main fixed
    tree, a fixed-tree sweep (D x B x tau subset) and a DynaTree sensitivity sweep, T=1500. Run 2: length
    scaling (T list). Run 3: prompt length (cap list). Returns the run ids.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    fixed_sweep = {"depth": [3, 5, 8], "branching": [2, 3], "tau": [0.03, 0.1]}
    dyn_sweep = {"tau_h": [0.8, 0.9], "tau_l": [0.3, 0.4]}
    decs = [
        {"name": "ar", "label": "AR"},
        {"name": "linear", "label": "Linear Spec (K=8)", "params": {"k": 8}, "datasets": ["wikitext-2"]},
        {"name": "linear", "label": "Linear Spec (K=5)", "params": {"k": 5}, "datasets": ["pg19"]},
        {
            "name": "fixed_tree",
            "label": "Fixed Tree (D=5, B=2)",
            "params": {"depth": 5, "branching": 2},
            "datasets": ["wikitext-2"],
        },
        {
            "name": "dynatree",
            "label": "+ Dynamic Breadth & Depth",
            "params": {"history_adaptation": False},
            "datasets": ["wikitext-2"],
        },
        {"name": "dynatree", "label": "DynaTree"},
        {
            "name": "fixed_tree",
            "label": "Fixed Tree (D=8, B=3, tau=0.1)",
            "params": {"depth": 8, "branching": 3, "tau": 0.1},
        },
        {"name": "fixed_tree", "label": "FT", "sweep": fixed_sweep, "datasets": ["wikitext-2"]},
        {"name": "dynatree", "label": "DT", "sweep": dyn_sweep, "datasets": ["wikitext-2"]},
        {"name": "dynatree", "label": "DTB", "sweep": {"b_max": [2, 4]}, "datasets": ["wikitext-2"]},
        {"name": "dynatree", "label": "DTD", "sweep": {"d0": [4, 6]}, "datasets": ["wikitext-2"]},
    ]
    dyn = {"tau_h": 0.9, "tau_l": 0.4, "b_min": 1, "b_max": 3, "d0": 5, "d_max": 8}
    text = suite_text("paper", decs, datasets=("wikitext-2", "pg19"), T=(1500,), l_max=[800, 1000][0])
    r1 = add_run(session, "paper", text=text)
    l_maxes = {"wikitext-2": 800, "pg19": 1000}
    main = {
        "AR": ("ar", {}, 133.4, 0.5, 1.0, None, None),
        "Linear Spec (K=8)": ("linear", {"k": 8}, 196.1, 37.8, 6.82, 0.882, 7.05),
        "Linear Spec (K=5)": ("linear", {"k": 5}, 144.9, 28.6, 4.56, 0.925, 4.63),
        "Fixed Tree (D=5, B=2)": ("fixed_tree", {"depth": 5, "branching": 2}, 188.0, 16.5, 5.9, 0.7, 5.5),
        "+ Dynamic Breadth & Depth": ("dynatree", {"history_adaptation": False}, 213.2, 26.1, 6.9, 0.95, 7.0),
        "DynaTree": ("dynatree", dyn, 219.5, 22.2, 7.08, 1.022, 7.15),
        "Fixed Tree (D=8, B=3, tau=0.1)": (
            "fixed_tree",
            {"depth": 8, "branching": 3, "tau": 0.1},
            200.7,
            41.7,
            6.79,
            0.71,
            7.10,
        ),
    }
    for ds, l_max in l_maxes.items():
        scale = 1.0 if ds == "wikitext-2" else 0.86
        for label, (dec, params, thr, sd, L, acc, path) in main.items():
            if ds == "pg19" and label in ("Linear Spec (K=8)", "Fixed Tree (D=5, B=2)", "+ Dynamic Breadth & Depth"):
                continue
            if ds == "wikitext-2" and label == "Linear Spec (K=5)":
                continue
            c = add_cell(session, r1, label, dec, dataset=ds, l_max=l_max, T=1500, params=params)
            add_samples(
                session,
                c,
                _noisy(rng, thr * scale, sd * 0.5, 10),
                warmup=2,
                acceptance=acc,
                path=path,
                iterations=int(1500 / L),
                rss_mib=6100 + (0 if dec == "ar" else 200) + (50 if ds == "pg19" else 0),
                ttft_s=0.019 if dec == "ar" else 0.0145,
            )
    for D in fixed_sweep["depth"]:
        for B in fixed_sweep["branching"]:
            for tau in fixed_sweep["tau"]:
                thr = 150 + 8 * D + (6 if B == 3 else 0) - (40 * abs(tau - 0.05))
                c = add_cell(
                    session,
                    r1,
                    f"FT (depth={D}, branching={B}, tau={tau})",
                    "fixed_tree",
                    l_max=800,
                    T=1500,
                    params={"depth": D, "branching": B, "tau": tau},
                    sweep_group="FT",
                )
                add_samples(
                    session,
                    c,
                    _noisy(rng, thr, 10, 10),
                    warmup=2,
                    acceptance=0.6,
                    path=D * 0.7,
                    iterations=int(1500 / (D * 0.8)),
                )
    for th in dyn_sweep["tau_h"]:
        for tl in dyn_sweep["tau_l"]:
            c = add_cell(
                session,
                r1,
                f"DT (tau_h={th}, tau_l={tl})",
                "dynatree",
                l_max=800,
                T=1500,
                params={**dyn, "tau_h": th, "tau_l": tl},
                sweep_group="DT",
            )
            add_samples(
                session,
                c,
                _noisy(rng, 200 + 30 * th - 20 * tl, 15, 10),
                warmup=2,
                acceptance=0.9,
                path=6.5,
                iterations=220,
            )
    for label, key, values in (("DTB", "b_max", [2, 4]), ("DTD", "d0", [4, 6])):
        for v in values:
            c = add_cell(
                session,
                r1,
                f"{label} ({key}={v})",
                "dynatree",
                l_max=800,
                T=1500,
                params={**dyn, key: v},
                sweep_group=label,
            )
            add_samples(
                session, c, _noisy(rng, 205 + 3 * v, 15, 10), warmup=2, acceptance=0.9, path=6.5, iterations=220
            )
    r2 = add_run(
        session,
        "paper-length",
        text=suite_text("paper-length", decs[:2] + decs[5:7], T=(100, 500, 1000, 1500), l_max=800),
    )
    for T in (100, 500, 1000, 1500):
        for label in ("AR", "Linear Spec (K=8)", "DynaTree", "Fixed Tree (D=8, B=3, tau=0.1)"):
            dec, params, thr, sd, L, acc, path = main[label]
            c = add_cell(session, r2, label, dec, l_max=800, T=T, params=params)
            add_samples(
                session,
                c,
                _noisy(rng, thr * (0.9 + 0.1 * T / 1500), sd * 0.3, 6),
                warmup=1,
                acceptance=acc,
                path=path,
                iterations=int(T / L),
            )
    r3 = add_run(
        session,
        "paper-prompt",
        text=suite_text("paper-prompt", decs[:2] + decs[5:7], T=(1500,), l_max=[100, 200, 800, 1000][0]),
    )
    for l_max in (100, 200, 800, 1000):
        for label in ("AR", "Linear Spec (K=8)", "DynaTree", "Fixed Tree (D=8, B=3, tau=0.1)"):
            dec, params, thr, sd, L, acc, path = main[label]
            c = add_cell(session, r3, label, dec, l_max=l_max, T=1500, params=params)
            add_samples(
                session,
                c,
                _noisy(rng, thr * (1.05 - l_max / 4000), sd * 0.3, 6),
                warmup=1,
                acceptance=acc,
                path=path,
                iterations=int(1500 / L),
            )
    session.commit()
    return [r1.id, r2.id, r3.id]


# --- cells whose numbers are easy to misread (issue 8, "metrics that mean what they say") -----------------------

AR_THR = [50.0, 10.0, 11.0, 9.0, 10.5, 10.2]  # first is warmup: 5 prompts after it
DIVERGES_THR = [80.0, 16.0, 18.5, 17.0, 15.5, 16.4]  # lossless after warmup; the warmup sample diverges at token 17
PARTIAL_THR = [90.0, 21.0, 22.0]  # failed at the fourth prompt: 2 prompts after warmup
WARMUP_ONLY_THR = [70.0, 60.0]  # both warmup
PARTIAL_ERROR = "RuntimeError: CUDA out of memory"


def tricky_run(session, hardware: bool = True) -> int:
    """One run (wikitext-2, L_max 128, T=64): ``AR``; ``Diverges`` (linear: its warmup sample diverges at token
    17, the 5 others match); ``Partial`` (dynatree: failed after 3 prompts, 1 of them warmup); ``Warmup only``
    (fixed_tree: 2 samples, both warmup); ``Broken`` (fixed_tree: failed before any sample). The environment has
    ``hardware`` flags unless ``hardware=False`` (a run recorded before they existed). Returns the run id."""
    env = {**ENV, "hardware": HARDWARE} if hardware else ENV
    decs = [
        {"name": "ar", "label": "AR"},
        {"name": "linear", "label": "Diverges"},
        {"name": "dynatree", "label": "Partial"},
        {"name": "fixed_tree", "label": "Warmup only"},
        {"name": "fixed_tree", "label": "Broken"},
    ]
    run = add_run(session, "tricky", env=env, text=suite_text("tricky", decs), status="failed")
    add_samples(session, add_cell(session, run, "AR", "ar"), AR_THR, warmup=1)
    add_samples(
        session,
        add_cell(session, run, "Diverges", "linear"),
        DIVERGES_THR,
        warmup=1,
        diverge={0: 17},
        acceptance=0.8,
        path=3.0,
    )
    add_samples(
        session,
        add_cell(session, run, "Partial", "dynatree", status="failed", error=PARTIAL_ERROR),
        PARTIAL_THR,
        warmup=1,
        acceptance=0.9,
        path=4.0,
    )
    add_samples(
        session,
        add_cell(session, run, "Warmup only", "fixed_tree"),
        WARMUP_ONLY_THR,
        warmup=2,
        acceptance=0.7,
        path=2.0,
    )
    add_cell(session, run, "Broken", "fixed_tree", status="failed", error="ValueError: bad tree")
    session.commit()
    return run.id


def few_prompts_run(session, ratio: float = 0.77, after_warmup: int = 2) -> int:
    """The issue's case: AR and Linear on ``after_warmup`` prompts after one warmup, Linear consistently
    ``ratio`` times AR's throughput (tight per-prompt ratios, so a bootstrap would call it "slower"). Returns the id."""
    run = add_run(
        session, "few", text=suite_text("few", [{"name": "ar", "label": "AR"}, {"name": "linear", "label": "Linear"}])
    )
    ar = [50.0] + [10.0 + 0.7 * i for i in range(after_warmup)]
    add_samples(session, add_cell(session, run, "AR", "ar"), ar, warmup=1)
    lin = [40.0] + [v * ratio * (1 + 0.01 * (-1) ** i) for i, v in enumerate(ar[1:])]
    add_samples(session, add_cell(session, run, "Linear", "linear"), lin, warmup=1)
    session.commit()
    return run.id
