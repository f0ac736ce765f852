"""The one cut of a row's output (issue 68 item 5): its first T tokens, nothing after the first EOS. The runner
(:mod:`dtbench.harness.measurement.measure`), the conformance kit (:mod:`dtbench.testing.common`) and a Step's own cut
(:func:`dtbench.decoders.base.cut_at_eos`) all take it from here."""

from __future__ import annotations

from collections.abc import Sequence


def cut_tokens(tokens: Sequence[int], T: int, eos: frozenset[int]) -> list[int]:
    """A row's output as every reader takes it (issue 68 item 5: the one cut, the runner's and the kit's): its first
    ``T`` tokens, and nothing after the first EOS among them.

    Args:
        tokens: the committed token ids, in order (plain ints).
        T: the generation length (new tokens asked for).
        eos: the EOS ids (:func:`eos_ids`); empty: no EOS cut.
    """
    out = list(tokens[:T])
    end = eos_end(out, eos)
    return out if end is None else out[:end]


def eos_end(tokens: Sequence[int], eos: frozenset[int]) -> int | None:
    """The length of ``tokens`` kept by the EOS cut (the first EOS's index + 1), None when none is an EOS."""
    if eos:
        for i, token in enumerate(tokens):
            if token in eos:
                return i + 1
    return None
