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

All randomness comes from one ``torch.Generator`` per sample (seeded by the runner from the run's seed and the
prompt index), never from global RNG state, so a seeded run is identical run to run.
"""

from __future__ import annotations

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


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    return float(torch.rand((), generator=generator, device=device, dtype=torch.float64).item())


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)), the distribution a rejected position is resampled from; p itself if p <= q everywhere
    (it cannot be rejected then, so this only guards rounding)."""
    r = torch.clamp(p - q, min=0)
    total = r.sum()
    return r / total if total > 0 else p


def verify_chain_sampled(drafts: list[int], draft_probs: list[torch.Tensor] | None, target_probs: torch.Tensor,
                         generator: torch.Generator | None) -> tuple[int, tuple[int, ...]]:
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
        ratio = (p[x] / q[x]).item() if q[x] > 0 else 0.0
        if _uniform(generator, device) < min(1.0, ratio):
            continue
        return i, (*drafts[:i], sample(residual(p, q), generator))
    return len(drafts), (*drafts, sample(target_probs[len(drafts)], generator))
