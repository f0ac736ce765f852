"""Sampling settings and lossless speculative sampling, shared by every decoder that samples.

- :class:`SamplingSettings` turns target or draft logits into the distribution sampled from, in transformers'
  order (temperature, then top-k, then top-p; ``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
  ``TopPLogitsWarper`` semantics, ties at the top-k boundary kept), so ``generate(do_sample=True)`` with the same
  settings samples from exactly the same distribution as ``ar``.
- :func:`verify_chain_sampled`: speculative sampling of a draft chain (Leviathan et al. 2023, Algorithm 1; Chen
  et al. 2023): draft token x_i ~ q_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first
  rejection the token is resampled from norm(max(0, p_i - q_i)); if every draft is accepted the bonus token is
  sampled from p_{K}. The committed tokens then have exactly the target's distribution, whatever q is. A
  deterministic proposer (prompt lookup) is the case of a one-hot q.
- :func:`sample_without_replacement` and :func:`verify_tree_sampled`: multi-draft speculative sampling over a
  token tree (recursive rejection sampling: SpecInfer, Miao et al. 2024, Algorithm 2 / "multi-step speculative
  sampling"; Jeon et al. 2024 for drafts drawn without replacement). The children of a node are drawn from the
  draft's processed distribution q *without replacement* (Gumbel-top-k, Kool et al. 2019) and tried in the order
  drawn: child c_j is accepted with probability min(1, p_j(c_j) / q_j(c_j)); on rejection the target side
  becomes p_{j+1} = norm(max(0, p_j - q_j)) and the draft side q_{j+1} = q_j without c_j, renormalised (the
  distribution the next child was drawn from). When every child is rejected (or a node has none) the token is
  drawn from the current p. Why without replacement: i.i.d. children (SpecInfer's default) repeat the draft's
  most likely token, so a budget of B children often holds fewer than B distinct tokens; without replacement
  every child is a new candidate, and a rejected token's residual mass is never offered again.
  Exactness, by induction over the children: given the history, P(commit x) = min(p_j, q_j)(x) + (1 - sum
  min(p_j, q_j)) p_{j+1}(x) = p_j(x), whatever q_{j+1} is (it only has to be the distribution the next child
  was actually drawn from), and p_{j+1} depends on the history before c_j only.

All randomness comes from one ``torch.Generator`` per sample (seeded by the runner from the run's seed and the
prompt index), never from global RNG state, so a seeded run is identical run to run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingSettings:
    """How logits become the distribution a token is sampled from.

    Attributes:
        temperature: logits are divided by it (> 0).
        top_k: keep the k most likely tokens (ties at the boundary kept); 0 keeps all.
        top_p: keep the smallest most-likely set whose probability reaches top_p (at least one token); 1 keeps all.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Processed probabilities, float64, same shape as ``logits`` (..., vocab).

        Computed in float64 so that acceptance ratios of nearly equal distributions are not rounding noise.
        """
        scores = logits.to(torch.float64) / self.temperature
        if self.top_k and self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
            cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
            remove = cumulative <= (1 - self.top_p)
            remove[..., -1:] = False
            scores = scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
        return torch.softmax(scores, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id drawn from ``probs`` (shape (vocab,), summing to 1) with ``generator``."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample_without_replacement(
    probs: torch.Tensor, k: int, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """k ordered draws without replacement from each row of ``probs`` (Gumbel-top-k, Kool et al. 2019).

    Sorting log q + Gumbel noise and taking the first k is distributed exactly as drawing k times one after the
    other, each time from q restricted to the tokens not drawn yet and renormalised; the order is the draw order.

    Args:
        probs: (E, vocab) float64 distributions (rows sum to 1; zeros allowed).
        k: draws per row (<= vocab).
        generator: the sample's random generator (on ``probs``' device).

    Returns:
        (tokens, valid): (E, k) int64 token ids in draw order, and (E, k) bool, False where a row has fewer than
        k tokens of non-zero probability (those columns are not draws).
    """
    u = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(u.clamp_min(torch.finfo(torch.float64).tiny)))
    keys, tokens = (torch.log(probs.to(torch.float64)) + gumbel).topk(k, dim=-1)
    return tokens, keys > -torch.inf


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    return float(torch.rand((), generator=generator, device=device, dtype=torch.float64).item())


def accept(p_x: float, q_x: float, generator: torch.Generator | None, device: torch.device) -> bool:
    """The speculative-sampling coin: True with probability min(1, p(x) / q(x)) (0 when q(x) = 0).

    Args:
        p_x, q_x: target and draft probabilities of the drafted token x (processed by the same settings).
    """
    ratio = p_x / q_x if q_x > 0 else 0.0
    return _uniform(generator, device) < min(1.0, ratio)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)), the distribution a rejected position is resampled from; p itself if p <= q everywhere
    (it cannot be rejected then, so this only guards rounding)."""
    r = torch.clamp(p - q, min=0)
    total = r.sum()
    return r / total if total > 0 else p


def verify_chain_sampled(
    drafts: list[int],
    draft_probs: list[torch.Tensor] | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, tuple[int, ...]]:
    """Speculative sampling of a draft chain (Leviathan et al. 2023, Algorithm 1).

    Args:
        drafts: K drafted token ids.
        draft_probs: q_i, the distribution each draft was sampled from, shape (vocab,) each; None for a
            deterministic proposer (q_i one-hot on the draft).
        target_probs: p over [pending, *drafts] processed by the same settings, shape (K + 1, vocab); row i is the
            distribution of the token after input i.
        generator: the sample's random generator.

    Returns:
        (accepted, committed): drafts accepted, and the committed tokens = those drafts plus one token drawn from
        the residual at the first rejection, or from p_K when all were accepted.
    """
    device = target_probs.device
    for i, x in enumerate(drafts):
        p = target_probs[i]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[x] = 1.0
        else:
            q = draft_probs[i].to(p.dtype)
        if accept(p[x].item(), q[x].item(), generator, device):
            continue
        return i, (*drafts[:i], sample(residual(p, q), generator))
    return len(drafts), (*drafts, sample(target_probs[len(drafts)], generator))


def verify_tree_sampled(
    tokens: list[int],
    parents: list[int],
    target_probs: Callable[[int], torch.Tensor],
    draft_probs: dict[int, torch.Tensor],
    generator: torch.Generator | None,
) -> tuple[list[int], list[int]]:
    """Multi-draft speculative sampling down a token tree (recursive rejection sampling; module docstring).

    Starting at the root, the children of the current node are tried in index order (the order they were drawn
    without replacement from ``draft_probs[node]``); an accepted child becomes the current node; when every child
    is rejected, or the node has none, one token is drawn from the current target distribution (the residual after
    the rejections) and the iteration ends.

    Args:
        tokens: (n,) token ids of a BFS-ordered tree, node 0 the root (the pending token).
        parents: (n,) parent indices (``parents[0]`` ignored); a node's children appear in draw order.
        target_probs: callable u -> (vocab,) float64, the target's processed distribution of the token after the
            path to u (computed lazily, only for nodes the walk reaches).
        draft_probs: node -> (vocab,) float64, the processed draft distribution its children were drawn from
            (without replacement). A node with children and no entry has *deterministic* children (a tree that is a
            function of the context, such as EAGLE-2's top-k tree): each child x in turn has q one-hot on x, so it
            is accepted with probability p(x) and a rejection zeroes p(x) and renormalises. That is SafeAILab/EAGLE's
            ``evaluate_posterior`` with a logits processor (``eagle/model/utils.py`` at cb7e084: ``qx = 1.0``,
            ``gtp[xi] = 0; gtp = gtp / gtp.sum()``), exact for deterministic siblings (a sibling repeating a
            rejected token has p(x) = 0 and is rejected).
        generator: the sample's random generator.

    Returns:
        (path, committed) as :func:`~dtbench.decoders.tree.structure.select_path`: accepted node indices root
        first, and the accepted tokens followed by the drawn (bonus or residual) token.
    """
    children: list[list[int]] = [[] for _ in tokens]
    for v in range(1, len(tokens)):
        children[parents[v]].append(v)
    u, path, committed = 0, [0], []
    while True:
        p = target_probs(u)
        given = draft_probs.get(u) if children[u] else None
        q = given.to(p.dtype).clone() if given is not None else None
        for c in children[u]:
            x = tokens[c]
            if q is None:  # deterministic children: q one-hot on x
                if accept(p[x].item(), 1.0, generator, p.device):
                    break
                p = p.clone()
                p[x] = 0.0
                total = p.sum()
                p = p / total if total > 0 else p
                continue
            if accept(p[x].item(), q[x].item(), generator, p.device):
                break
            p = residual(p, q)
            q[x] = 0.0
            total = q.sum()
            q = q / total if total > 0 else q
        else:
            committed.append(sample(p, generator))
            return path, committed
        path.append(c)
        committed.append(x)
        u = c
