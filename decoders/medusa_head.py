"""The Medusa heads (Cai et al. 2024; reference: FasterDecoding/Medusa medusa/model/medusa_model.py): K residual
blocks over the target's last hidden state, each with its own LM head, read and checked against the target, loaded
once per (target, head)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from dtbench.decoders import modelinfo

if TYPE_CHECKING:
    pass
from dtbench.decoders.heads import (
    cached_head,
    check_fits,
    check_shapes,
    head_file,
    lazy_weights,
    positive_int,
    read_config,
    state_dict_of,
    target_sizes,
)


class ResBlock(nn.Module):
    """Medusa's residual block: ``x + SiLU(linear(x))`` (medusa_model.py ResBlock)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """Medusa-1 heads; ``heads`` loads the published ``medusa_lm_head.pt`` state dict as is.

    Attributes:
        heads: ModuleList of ``Sequential(ResBlock x num_layers, Linear(h, vocab, bias=False))``.
    """

    def __init__(self, num_heads: int, num_layers: int, hidden: int, vocab: int):
        super().__init__()
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)], nn.Linear(hidden, vocab, bias=False))
            for _ in range(num_heads)
        )

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """Head logits from target features.

        Args:
            inputs_embeds: (1, n, h) the target's final-normed hidden states (named ``inputs_embeds`` so the
                runner's forward counter counts n positions fed to the draft).

        Returns:
            (num_heads, n, vocab) logits; head i predicts the token i + 2 positions after its input's position.
        """
        return torch.stack([head(inputs_embeds[0]) for head in self.heads])


def _medusa_file(head: str) -> Path:
    return head_file(head, ("medusa_lm_head.pt", "medusa_lm_head.safetensors"))


def _medusa_layout(head: str, cfg: dict, shapes: dict[str, tuple[int, ...]]) -> tuple[int, int, int, int]:
    """(heads, layers per head, hidden size, vocabulary size) of a Medusa-1 head, its config.json and every weight's
    shape checked against the layout they make (built on the meta device: nothing allocated).

    Raises:
        ValueError: missing or non-positive-integer config fields, keys that are not Medusa-1's, or a tensor shaped
            unlike the layout (one line naming the head).
    """
    missing = [k for k in ("medusa_num_heads", "medusa_num_layers") if k not in cfg]
    if missing:
        raise ValueError(f"head {head}: config.json lacks {', '.join(missing)} (not a Medusa head)")
    positive_int(cfg, "medusa_num_heads", head)
    layers = positive_int(cfg, "medusa_num_layers", head)
    ids = sorted({int(k.split(".", 1)[0]) for k in shapes if k.split(".", 1)[0].isdigit()})
    lm = shapes.get(f"0.{layers}.weight")
    if not ids or ids != list(range(len(ids))) or lm is None or len(lm) != 2 or 0 in lm:
        raise ValueError(
            f"head {head}: medusa_lm_head keys are not Medusa-1's ({{i}}.{{j}}.linear.weight, "
            f"{{i}}.{layers}.weight with medusa_num_layers={layers})"
        )
    vocab, hidden = lm
    with torch.device("meta"):
        layout = MedusaHeads(len(ids), layers, hidden, vocab).heads
    expected = set(layout.state_dict())
    unknown, absent = sorted(shapes.keys() - expected), sorted(expected - shapes.keys())
    if unknown or absent:
        raise ValueError(
            f"head {head}: medusa_lm_head does not match Medusa-1's layout with medusa_num_layers="
            f"{layers} (unexpected {unknown[:4]}, missing {absent[:4]})"
        )
    check_shapes(head, layout, shapes)
    return len(ids), layers, int(hidden), int(vocab)


def check_medusa(head: str) -> None:
    """Check a Medusa-1 head's files (config.json, the weights' header) without allocating it.

    Raises:
        ValueError: as :func:`_medusa_layout`, or unreadable files.
    """
    shapes, _ = lazy_weights(_medusa_file(head))
    _medusa_layout(head, read_config(head), shapes)


def load_medusa(head: str, target: nn.Module) -> MedusaHeads:
    """Load Medusa-1 heads (folder or hub id) in the target's dtype and device (cached per target).

    Raises:
        ValueError: missing files or config fields, keys that are not Medusa-1's, or a hidden size or vocabulary
            that does not fit the target (one line, both sizes).
    """

    def build() -> MedusaHeads:
        cfg = read_config(head)
        sd = state_dict_of(_medusa_file(head))
        n, layers, hidden, vocab = _medusa_layout(head, cfg, {k: tuple(v.shape) for k, v in sd.items()})
        t_hidden, t_vocab = target_sizes(target)
        check_fits("hidden size", hidden, t_hidden, head)
        check_fits("vocabulary size", vocab, t_vocab, head)
        module = MedusaHeads(n, layers, t_hidden, t_vocab)
        try:
            module.heads.load_state_dict(sd, strict=True)
        except RuntimeError as exc:
            raise ValueError(f"head {head}: {str(exc).splitlines()[0]}") from None
        return module.to(dtype=modelinfo.dtype_of(target), device=modelinfo.device_of(target)).eval()

    return cached_head(target, ("medusa", str(head)), build)
