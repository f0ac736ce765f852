"""How a server cell's requests arrive and fill its concurrency (issue 39): arrival processes, the load profile
(ramp-up, steady part, drain), the steady throughput, and the blocks of C prompts a cell's speedup pairs.

Arrival processes are a small registry (:data:`ARRIVALS`, name -> the gap to the next request): ``poisson``
(``request_rate`` at ``burstiness`` 1) and ``gamma`` (other burstiness), as ``vllm bench serve`` draws them; without a
``request_rate`` every request is ready at once (:func:`arrival_process`).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

ArrivalGap = Callable[[random.Random, float, float], float]  # (seeded rng, rate 1/s, burstiness) -> seconds


def poisson_gap(rng: random.Random, rate: float, burstiness: float) -> float:
    """An exponential gap of mean 1/``rate`` seconds (a Poisson process; ``burstiness`` is 1)."""
    return rng.expovariate(rate)


def gamma_gap(rng: random.Random, rate: float, burstiness: float) -> float:
    """A gamma-distributed gap of shape ``burstiness`` and mean 1/``rate`` seconds (scale 1 / (rate * burstiness)):
    below 1 burstier than Poisson, above 1 more regular (the coefficient of variation is 1 / sqrt(burstiness))."""
    return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


ARRIVALS: dict[str, ArrivalGap] = {"poisson": poisson_gap, "gamma": gamma_gap}


def arrival_process(rate: float | None, burstiness: float = 1.0) -> str | None:
    """The name of the arrival process (:data:`ARRIVALS`) of a cell's ``request_rate`` and ``burstiness``: None
    without a rate (every request ready at once), ``poisson`` at burstiness 1, else ``gamma``."""
    if rate is None:
        return None
    return "poisson" if burstiness == 1.0 else "gamma"


def arrival_delays(n: int, rate: float | None, seed: int, burstiness: float = 1.0) -> list[float]:
    """Send offsets (s) of ``n`` requests from the cell's start: all 0 without a rate, else seeded arrivals whose
    gaps are gamma-distributed with shape ``burstiness`` and mean 1/``rate`` (scale 1 / (rate * burstiness)), the
    first request at 0, as ``vllm bench serve``'s ``get_request`` draws them (vLLM benchmarks/benchmark_serving.py:
    burstiness 1 is a Poisson process, below 1 burstier, above 1 more regular; the gaps' coefficient of variation is
    1 / sqrt(burstiness)). At burstiness 1 the gaps are drawn by ``random.expovariate`` (the same offsets as before
    issue 39 for the same seed); the process is :func:`arrival_process`'s."""
    process = arrival_process(rate, burstiness)
    if process is None or rate is None:
        return [0.0] * n
    gap = ARRIVALS[process]
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += gap(rng, rate, burstiness)
    return out


@dataclass(frozen=True)
class Schedule:
    """When a unit's requests may start and how many may be in flight: ``delays`` per request its arrival offset in
    seconds from the unit's start (:func:`arrival_delays`), ``concurrency`` the cap C (the cell's load level)."""

    delays: list[float]
    concurrency: int


def schedule(n: int, concurrency: int, rate: float | None, seed: int, burstiness: float = 1.0) -> Schedule:
    """The :class:`Schedule` of ``n`` requests at load level ``concurrency`` (>= 1), arriving at ``rate`` per second
    (None: all at once) with gaps of shape ``burstiness``, seeded by ``seed``."""
    return Schedule(arrival_delays(n, rate, seed, burstiness), concurrency)


async def dispatch(plan: Schedule, send: Callable[[int], Awaitable[None]]) -> None:
    """Run ``send(i)`` for every request i of ``plan``: each from its arrival offset on, at most ``concurrency`` at
    once (a new request starts when one finishes, or at its arrival when later: steady concurrency, vLLM
    ``bench serve --max-concurrency``). When one send raises, the others are cancelled and the error propagates."""
    gate = asyncio.Semaphore(plan.concurrency)

    async def one(i: int, delay: float) -> None:
        await asyncio.sleep(delay)
        async with gate:
            await send(i)

    tasks = [asyncio.create_task(one(i, d)) for i, d in enumerate(plan.delays)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def load_profile(spans: list[tuple[float, float]], concurrency: int, rate: float | None) -> dict[str, Any]:
    """How a cell's requests filled the concurrency (issue 39 item 1): ramp-up, steady part, drain.

    Args:
        spans: per request (send, last token) in seconds from the cell's start; concurrency: the cap C;
        rate: the arrival rate (None: every request is ready at the start).

    The *steady* window starts when the requests in flight first reach their cap min(C, N) (with a ``rate``: at the
    first request's completion, when arrivals and completions both run) and ends at the first completion
    after the last send (from then on fewer requests are in flight and none is left to start); before it is the
    *ramp-up*, after it the *drain*. Returns (seconds): ``wall_s`` (first send to last token), ``ramp_s``,
    ``steady_s``, ``drain_s``, ``steady_window_s`` ([start, end] or None when empty), ``mean_in_flight`` (the
    time-weighted mean of requests in flight over the wall time), ``mean_in_flight_steady`` (over the steady window,
    None without one) and per request ``steady`` (finished inside the steady window, its ends included). Without a
    window (the cap never reached, or no request finished after the last send) the whole wall time is ramp-up.
    """
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], -e[1]))
    start = events[0][0] if events else 0.0
    end = max((b for _, b in spans), default=start)
    cap = min(concurrency, len(spans))
    level, t_prev, area = 0, start, 0.0
    t_full: float | None = None
    for t, d in events:
        area += level * (t - t_prev)
        level, t_prev = level + d, t
        if t_full is None and level >= cap:
            t_full = t
    last_send = max((a for a, _ in spans), default=start)
    lo = min((b for _, b in spans), default=None) if rate is not None else t_full
    hi = min((b for _, b in spans if b > last_send), default=end)
    wall = end - start
    out: dict[str, Any] = {
        "wall_s": wall,
        "ramp_s": wall,
        "steady_s": 0.0,
        "drain_s": 0.0,
        "steady_window_s": None,
        "mean_in_flight": area / wall if wall > 0 else float(len(spans)),
        "mean_in_flight_steady": None,
        "steady": [False] * len(spans),
    }
    if lo is None or hi <= lo:
        return out
    steady_area = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in spans)
    out.update(
        ramp_s=lo - start,
        steady_s=hi - lo,
        drain_s=end - hi,
        steady_window_s=[lo, hi],
        mean_in_flight_steady=steady_area / (hi - lo),
        steady=[lo <= b <= hi for _, b in spans],
    )
    return out


def unit_load(
    requests: list[tuple[float, float, list[tuple[float, int]], int]], wall: float, concurrency: int, rate: float | None
) -> tuple[dict[str, Any], list[bool]]:
    """A unit's load profile (:func:`load_profile`, the same for every row of the unit, with its steady and whole
    throughput in tokens/s) and per request whether it finished in the steady window.

    Args:
        requests: per request (send, last token: seconds from the unit's start; its reads: [(seconds from the send,
            tokens the read brought)]; its tokens counted, T at most); wall: the unit's wall time in seconds.
    """
    profile = load_profile([(sent, done) for sent, done, _, _ in requests], concurrency, rate)
    cell_load = {k: v for k, v in profile.items() if k != "steady"}
    cell_load["steady_throughput"] = steady_throughput(
        [(sent, reads) for sent, _, reads, _ in requests], profile["steady_window_s"]
    )
    cell_load["throughput"] = sum(n for *_, n in requests) / wall if wall > 0 else None
    return cell_load, profile["steady"]


def steady_throughput(reads: list[tuple[float, list[tuple[float, int]]]], window: list[float] | None) -> float | None:
    """Tokens per second that arrived inside the steady window (``load_profile``'s ``steady_window_s``), over all of
    a cell's requests: ``reads`` per request (send offset, [(seconds from the send, tokens the read brought)]).
    None without a window."""
    if not window or window[1] <= window[0]:
        return None
    lo, hi = window
    tokens = sum(n for sent, rs in reads for t, n in rs if lo < sent + t <= hi)
    return tokens / (hi - lo)


def blocks_of(n: int, concurrency: int) -> list[tuple[int, ...]]:
    """Per row of a unit of ``n`` requests, the rows of its *block*: rows in order in blocks of C (the last possibly
    smaller). A block is the pairing key of a server cell's speedup (``batch_group``: its first prompt's index), the
    same prompts as a prompt group of dtbench's own decoders at B = C, though its requests overlap other blocks'."""
    out = []
    for i in range(0, n, concurrency):
        block = tuple(range(i, min(i + concurrency, n)))
        out.extend([block] * len(block))
    return out
