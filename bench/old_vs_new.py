"""Old code vs new code, side by side: the same suite run by two dtbench installs in turn (A B A B ...), then every
stored sample compared (same output tokens and the same non-timing columns) and each cell's throughput compared
(the ratio new / old of the per-round medians, and its median over rounds; and the median over every round and
prompt of the same prompt's ratio, *paired*). Rounds alternate the order (old, new; new, old; ...).

    python bench/old_vs_new.py --old /path/to/old/.venv/bin/dtbench --new .venv/bin/dtbench \\
        --suite bench/one-path.yaml --data-dir ../shared/data --rounds 3 --out /tmp/old-vs-new

Each round writes its own SQLite database per side (``OUT/old-R.db``, ``OUT/new-R.db``), read back with the
standard library's sqlite3 (no dtbench import: the two installs may have different schemas). Exit status 1 when a
sample differs; the throughput ratios are printed, never judged (quote the medians, with the machine's load).
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Columns that hold a measurement of time, memory, energy or the machine: they differ run to run and are not compared.
TIMED = {
    "id", "cell_id", "created_at", "total_s", "ttft_s", "tpot_s", "throughput", "step_times_s", "peak_rss_bytes",
    "peak_allocated_bytes", "peak_nvml_bytes", "energy_j", "energy_status", "energy_source", "lossless_check_s",
    "batch_total_s", "roofline", "worker_host", "device_name",
}  # fmt: skip
STEP_TIMED = {"forward_s"}  # step_stats keys that are seconds (the forwards' own time)


def _untimed(column: str, value):
    """A column's value with its timing parts left out (``step_stats`` without :data:`STEP_TIMED`)."""
    if column == "step_stats" and value:
        return {k: v for k, v in json.loads(value).items() if k not in STEP_TIMED}
    return value


def run(dtbench: str, suite: str, db: Path, data_dir: str | None) -> float:
    """One ``dtbench run`` of ``suite`` into ``db``; its wall seconds. Raises SystemExit when it fails."""
    cmd = [dtbench, "run", suite, "--db", f"sqlite:///{db}", "--no-progress", "--no-report"]
    if data_dir:
        cmd += ["--data-dir", data_dir]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return time.perf_counter() - start


def samples(db: Path) -> dict[tuple, dict]:
    """Every sample of the database's one run, keyed by (label, batch size, prompt index, repeat)."""
    con = sqlite3.connect(db)
    con.row_factory = sqlite3.Row
    rows = con.execute(
        "select c.label as label, coalesce(c.batch_size, 1) as b, s.* from samples s join cells c on c.id = s.cell_id"
    ).fetchall()
    con.close()
    return {(r["label"], r["b"], r["prompt_index"], r["repeat"] if "repeat" in r.keys() else 0): dict(r) for r in rows}


def _median(side: dict[tuple, dict], label_b: tuple) -> float:
    """The median throughput (tokens/s) of one cell's measured samples (warmup left out)."""
    return statistics.median(v["throughput"] for k, v in side.items() if (k[0], k[1]) == label_b and not v["warmup"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the old install's dtbench executable")
    ap.add_argument("--new", required=True, help="the new install's dtbench executable")
    ap.add_argument("--suite", default="bench/one-path.yaml")
    ap.add_argument("--data-dir", default=os.environ.get("DTBENCH_DATA_DIR"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="/tmp/old-vs-new")
    ap.add_argument("--reuse", action="store_true", help="compare the databases already in OUT, run nothing")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()[0]
    walls: dict[str, list[float]] = {"old": [], "new": []}
    dbs: dict[str, list[Path]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for side in ("old", "new") if r % 2 == 0 else ("new", "old"):  # A B B A ...: a drift cancels out
            db = out / f"{side}-{r}.db"
            dbs[side].append(db)
            if args.reuse:
                walls[side].append(float("nan"))
                continue
            db.unlink(missing_ok=True)
            walls[side].append(run(getattr(args, side), args.suite, db, args.data_dir))
            print(f"round {r} {side}: {walls[side][-1]:.1f} s (load {os.getloadavg()[0]:.2f})", flush=True)
    differ = 0
    ratios: dict[tuple, list[float]] = {}
    paired: dict[tuple, list[float]] = {}  # per prompt and round: new / old throughput of the same prompt
    for r in range(args.rounds):
        old, new = samples(dbs["old"][r]), samples(dbs["new"][r])
        if set(old) != set(new):
            print(f"round {r}: different samples: {sorted(set(old) ^ set(new))[:5]}")
            differ += 1
        for key in sorted(set(old) & set(new)):
            a, b = old[key], new[key]
            cols = (set(a) & set(b)) - TIMED
            bad = sorted(c for c in cols if _untimed(c, a[c]) != _untimed(c, b[c]))
            if bad:
                differ += 1
                print(f"round {r} {key}: differs in {bad[:6]}")
        for label_b in {(k[0], k[1]) for k in old}:
            ratios.setdefault(label_b, []).append(_median(new, label_b) / _median(old, label_b))
        for key in sorted(set(old) & set(new)):
            if not old[key]["warmup"] and old[key]["throughput"]:
                paired.setdefault((key[0], key[1]), []).append(new[key]["throughput"] / old[key]["throughput"])
    print(
        f"\nload at start {load0:.2f}, at end {os.getloadavg()[0]:.2f}; wall old {statistics.median(walls['old']):.1f} s, "
        f"new {statistics.median(walls['new']):.1f} s (medians of {args.rounds})"
    )
    print(f"{'cell':<28} {'B':>2}  new/old throughput per round            median  paired (n)")
    for (label, b), rs in sorted(ratios.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        pr = paired.get((label, b), [])
        both = f"{statistics.median(pr):.3f} ({len(pr)})" if pr else "-"
        print(f"{label:<28} {b:>2}  {' '.join(f'{x:.3f}' for x in rs):<40} {statistics.median(rs):.3f}   {both}")
    summary = {f"{label} B={b}": statistics.median(rs) for (label, b), rs in ratios.items()}
    pairs = {f"{label} B={b}": statistics.median(rs) for (label, b), rs in paired.items()}
    (out / "summary.json").write_text(
        json.dumps({"load0": load0, "ratios": summary, "paired": pairs, "differ": differ}, indent=1)
    )
    print(f"\n{'every sample identical (tokens and non-timing columns)' if not differ else f'{differ} differences'}")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
