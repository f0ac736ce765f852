"""The forward-latency curves of a calibration as a cost function (the cost model's price list, issue 12).

Read from the ``calibrations`` table; made by :mod:`dtbench.harness.calibration.calibrate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    import numpy as np

    Curve: TypeAlias = tuple[np.ndarray, np.ndarray]  # (calibrated n, increasing; median seconds at each)

FED_MASK, FED_LAST = 1, 2  # flags of a counted forward (measure.ForwardCounter): a 4D mask; last logits only
DEFAULT_FACTOR = 2.0  # n_max: auto's default n_max_factor: a tree verification may cost 2 AR steps


# --- reading: the curves as a cost function ------------------------------------------------------------------------


@dataclass
class Curves:
    """Calibrated forward costs: ``cost(role, n, past, flags)`` in seconds (the cost model's price list).

    A forward with ``past == 0`` is a prefill (its n on the prefill curve); any other is priced on the curve of its
    kind (flags: ``FED_MASK`` -> tree, ``FED_LAST`` -> last, else causal; a kind not calibrated falls back to causal,
    then to any), linearly interpolated in n between calibrated points (outside them: extended along the nearest
    end segment) and in the cache length between calibrated cache lengths
    (clamped outside them; ``past`` None: the shortest).
    """

    rows: list = field(default_factory=list)  # objects with role, cache_len, n, tree_mask, last_only, median_s
    batch: str | None = None
    run_id: int | None = None

    def __post_init__(self) -> None:
        import numpy as np

        table: dict[tuple[str, str], dict[int, list[tuple[int, float]]]] = {}
        for r in self.rows:
            b = int(getattr(r, "rows", None) or 1)
            kind = (
                (f"prefill:{b}" if r.cache_len == 0 else f"batched:{b}")
                if b > 1
                else "prefill"
                if r.cache_len == 0
                else "tree"
                if r.tree_mask
                else "last"
                if r.last_only
                else "causal"
            )
            table.setdefault((r.role, kind), {}).setdefault(int(r.cache_len), []).append((int(r.n), float(r.median_s)))

        def curve(pts: list[tuple[int, float]]) -> Curve:  # the same n measured twice (it should not be): their mean
            by_n: dict[int, list[float]] = {}
            for n, sec in pts:
                by_n.setdefault(n, []).append(sec)
            ns = sorted(by_n)
            return np.array(ns, dtype=float), np.array([sum(by_n[n]) / len(by_n[n]) for n in ns], dtype=float)

        self._table: dict[tuple[str, str], dict[int, Curve]] = {
            k: {c: curve(v) for c, v in per.items()} for k, per in table.items()
        }

    def roles(self) -> set[str]:
        return {role for role, _ in self._table}

    def has(self, role: str, kind: str) -> bool:
        return (role, kind) in self._table

    def points(self, role: str, kind: str, cache_len: int | None = None):
        """(n, median s) of one curve; ``cache_len`` None: the shortest cache length calibrated."""
        per = self._table[(role, kind)]
        c = min(per) if cache_len is None else cache_len
        return per[c]

    @staticmethod
    def _interp(ns: np.ndarray, secs: np.ndarray, n: float) -> float:
        import numpy as np

        if len(ns) == 1:
            return float(secs[0] * n / ns[0])
        if ns[0] <= n <= ns[-1]:
            return float(np.interp(n, ns, secs))
        i = 0 if n < ns[0] else len(ns) - 2  # outside: along the nearest end segment (never below 0)
        slope = (secs[i + 1] - secs[i]) / (ns[i + 1] - ns[i])
        return max(0.0, float(secs[i] + slope * (n - ns[i])))

    def kind_of(self, role: str, past: int | None, flags: int) -> str:
        if past == 0 and self.has(role, "prefill"):
            return "prefill"
        want = "tree" if flags & FED_MASK else "last" if flags & FED_LAST else "causal"
        for kind in (want, "causal", "tree", "last"):
            if self.has(role, kind):
                return kind
        raise KeyError(f"no calibration for the {role}")

    def batch_sizes(self, role: str = "target") -> list[int]:
        """The batch sizes B > 1 with a batched curve of ``role`` (issue 29)."""
        return sorted(int(k.split(":")[1]) for r, k in self._table if r == role and k.startswith("batched:"))

    def batched_cost(self, n: int, past: int | None, rows: int, role: str = "target") -> float:
        """Seconds of one batched verification forward of ``role``: ``rows`` sequences, n new tokens each, after
        ``past`` cached positions per row. B = 1 is the plain curve (:meth:`cost`, tree mask); a B between two
        calibrated batch sizes is interpolated linearly in B (beyond the largest: along the last two, never below
        the largest's cost).

        Raises:
            KeyError: no batched curve of ``role`` (the suite had no batch size > 1 when it calibrated).
        """
        if rows <= 1:
            return self.cost(role, n, past, FED_MASK)
        sizes = self.batch_sizes(role)
        if not sizes:
            raise KeyError(f"no batched calibration for the {role}")

        def at(b: int) -> float:
            return (
                self.cost(role, n, past, FED_MASK)
                if b == 1
                else self._per_cache(self._table[(role, f"batched:{b}")], n, past)
            )

        grid = [1, *sizes]
        if rows in grid:
            return at(rows)
        lo = max((b for b in grid if b < rows), default=1)
        hi = min((b for b in grid if b > rows), default=None)
        if hi is None:  # beyond the largest calibrated B: the last two points' slope
            lo, hi = grid[-2], grid[-1]
            y0, y1 = at(lo), at(hi)
            return max(y1, y0 + (y1 - y0) * (rows - lo) / (hi - lo))
        y0, y1 = at(lo), at(hi)
        return y0 + (y1 - y0) * (rows - lo) / (hi - lo)

    def target_cost(self, n: int, past: int | None, batch: int = 1, flags: int = 0) -> float:
        """Seconds of one target forward of ``n`` new tokens per row at batch size ``batch``: :func:`target_cost`."""
        return target_cost(self, n, past, batch, flags)

    def verify_sizes(self, past: int | None, batch: int = 1) -> list[int]:
        """The calibrated verification sizes (tokens per row, root included) of the target at batch size ``batch``,
        on the calibrated cache length nearest ``past`` (None: the shortest): B = 1 the tree-masked curve's (the
        causal one's without it), B > 1 every batched curve's (the calibration visits one n grid at every B); the
        candidates of :func:`tree_budget`. [] without such a curve."""
        kinds = ["tree" if self.has("target", "tree") else "causal"] if batch <= 1 else []
        kinds += [f"batched:{b}" for b in self.batch_sizes()] if batch > 1 else []
        sizes: set[int] = set()
        for kind in kinds:
            if not self.has("target", kind):
                continue
            per = self._table[("target", kind)]
            near = min(per) if past is None else min(per, key=lambda c: abs(c - past))
            sizes.update(int(n) for n in per[near][0])
        return sorted(sizes)

    def batched_prefill(self, n: int, rows: int, role: str = "target") -> float | None:
        """Seconds of one prefill forward of ``rows`` prompts of ``n`` tokens each (right-padded, one forward:
        :meth:`~dtbench.decoders.kv.RaggedBatch.prefill`); B = 1 is the plain prefill curve; between calibrated
        batch sizes linear in B (beyond the largest: along the last two). None where the calibration has no batched
        prefill (made before issue 39 measured it) or no prefill at all."""
        if rows <= 1:
            return self.cost(role, n, 0) if self.has(role, "prefill") else None
        sizes = sorted(int(k.split(":")[1]) for r, k in self._table if r == role and k.startswith("prefill:"))
        if not sizes or not self.has(role, "prefill"):
            return None

        def at(b: int) -> float:
            return self.cost(role, n, 0) if b == 1 else self._interp(*self._table[(role, f"prefill:{b}")][0], n)

        grid = [1, *sizes]
        lo = max((b for b in grid if b <= rows), default=1)
        hi = min((b for b in grid if b > rows), default=None)
        if lo == rows:
            return at(rows)
        if hi is None:
            lo, hi = grid[-2], grid[-1]
        y0, y1 = at(lo), at(hi)
        return max(0.0, y0 + (y1 - y0) * (rows - lo) / (hi - lo))

    def _per_cache(self, per: dict[int, Curve], n: float, past: int | None) -> float:
        lens = sorted(per)
        if past is None or len(lens) == 1 or past <= lens[0]:
            return self._interp(*per[lens[0]], n)
        if past >= lens[-1]:
            return self._interp(*per[lens[-1]], n)
        hi = next(i for i, c in enumerate(lens) if c >= past)
        c0, c1 = lens[hi - 1], lens[hi]
        y0, y1 = self._interp(*per[c0], n), self._interp(*per[c1], n)
        return y0 + (y1 - y0) * (past - c0) / (c1 - c0)

    def cost(self, role: str, n: int, past: int | None, flags: int = 0) -> float:
        """Seconds of one forward of ``role`` over ``n`` new tokens after ``past`` cached positions.

        Raises:
            KeyError: the role has no calibration at all.
        """
        if (role, "prefill") not in self._table and not any(r == role for r, _ in self._table):
            raise KeyError(f"no calibration for the {role}")
        kind = self.kind_of(role, past, flags)
        per = self._table[(role, kind)]
        lens = sorted(per)
        if kind == "prefill" or past is None or len(lens) == 1 or past <= lens[0]:
            return self._interp(*per[lens[0]], n)
        if past >= lens[-1]:
            return self._interp(*per[lens[-1]], n)
        hi = next(i for i, c in enumerate(lens) if c >= past)
        c0, c1 = lens[hi - 1], lens[hi]
        y0, y1 = self._interp(*per[c0], n), self._interp(*per[c1], n)
        return y0 + (y1 - y0) * (past - c0) / (c1 - c0)


def target_cost(curves, n: float, past: int | None, batch: int = 1, flags: int = 0) -> float:
    """Seconds of one target forward of ``n`` new tokens per row at batch size ``batch`` after ``past`` cached
    positions on ``curves`` (:class:`Curves`, or any object with its ``cost`` and ``batched_cost``): B = 1 the curve
    of ``flags`` (:meth:`Curves.cost`: 0 causal, ``FED_MASK`` tree), B > 1 the batched verification curves
    (:meth:`Curves.batched_cost`, tree mask; ``flags`` does not apply). The one ``batched_cost if batch > 1 else
    cost`` of every prediction (issue 58 item 1).

    Raises:
        KeyError: no calibration of the target, or B > 1 without a batched curve.
    """
    if batch > 1:
        return curves.batched_cost(n, past, batch)
    return curves.cost("target", n, past, flags)


def load_curves(session, run) -> Curves | None:
    """The calibration of ``run``: its own (newest batch linked to it), else the newest standalone calibration of
    the same target (model, dtype), device and device name (and draft, where both have one); None without any."""
    from sqlalchemy import select

    from dtbench.harness.store.db import Calibration

    rows = session.scalars(
        select(Calibration).where(Calibration.run_id == run.id).order_by(Calibration.id.desc())
    ).all()
    if rows:
        batch = rows[0].batch
        return Curves([r for r in rows if r.batch == batch], batch=batch, run_id=run.id)
    env = run.environment or {}
    tgt, dft = env.get("target") or {}, env.get("draft") or {}
    cands = session.scalars(
        select(Calibration)
        .where(
            Calibration.run_id.is_(None),
            Calibration.role == "target",
            Calibration.model == tgt.get("model"),
            Calibration.dtype == tgt.get("dtype"),
            Calibration.device == env.get("device"),
            Calibration.device_name == env.get("device_name"),
        )
        .order_by(Calibration.id.desc())
    ).all()
    for cand in cands:
        batch_rows = session.scalars(select(Calibration).where(Calibration.batch == cand.batch)).all()
        drafts = [r for r in batch_rows if r.role == "draft"]
        if dft and drafts and (drafts[0].model, drafts[0].dtype) != (dft.get("model"), dft.get("dtype")):
            continue
        return Curves(batch_rows, batch=cand.batch, run_id=None)
    return None


def tree_budget(
    curves: Curves, past: int, batch: int = 1, factor: float = DEFAULT_FACTOR, ceiling: int | None = None
) -> int:
    """The node budget (drafted nodes) a tree decoder can afford at batch size ``batch``: the largest n whose
    verification — one target forward over the root and n nodes per row (B = 1: the tree mask) — costs at most
    ``factor`` x one AR step at the same B (B = 1: one causal target forward over 1 token), on a cache of ``past``
    positions; at least 1, at most ``ceiling`` (None: :data:`dtbench.decoders.tree.N_MAX_AUTO_CEILING`). The one
    budget rule of ``n_max: auto`` (:func:`auto_budget`), the cost model's N_max and the batch table's N_max per B
    (issue 58 item 1).

    Candidates: the calibrated verification sizes only (:meth:`Curves.verify_sizes`). Between them the cost is
    interpolated and beyond the largest extrapolated along the end segment, so a budget from every n up to the
    ceiling would rest on costs nobody measured (a flat or falling end segment extrapolates to ever larger budgets);
    a calibrated size was measured. The curve need not be monotonic (on CPUs n = 2..3 can cost more than n = 4..8),
    so the largest n within the factor is taken, not the first n beyond it.

    Raises:
        KeyError: no calibration of the target (B > 1: no batched curve).
    """
    from dtbench.decoders.tree import N_MAX_AUTO_CEILING

    top = N_MAX_AUTO_CEILING if ceiling is None else ceiling
    one = curves.target_cost(1, past, batch, 0)
    best = 1
    for size in curves.verify_sizes(past, batch):
        n = size - 1
        if 1 <= n <= top and curves.target_cost(size, past, batch, FED_MASK) <= factor * one:
            best = max(best, n)
    return best


def auto_budget(curves: Curves, cache_len: int, factor: float) -> int:
    """``n_max: auto``: :func:`tree_budget` at B = 1 on a cache of ``cache_len`` positions (the largest calibrated
    n of drafted nodes whose tree verification costs at most ``factor`` x one AR step; at least 1, at most
    :data:`dtbench.decoders.tree.N_MAX_AUTO_CEILING`)."""
    return tree_budget(curves, cache_len, 1, factor)
