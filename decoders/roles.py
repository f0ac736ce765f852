"""The role a model forward plays (issue 68 item 2): the runner's forward hooks (:class:`~dtbench.harness.measurement.forwards.
ForwardCounter`) count and time a forward as a draft forward inside :func:`drafting`, whatever model runs it."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_FORWARD_ROLE: contextvars.ContextVar[str] = contextvars.ContextVar("dtbench_forward_role", default="target")


@contextlib.contextmanager
def drafting() -> Iterator[None]:
    """Every model forward inside is a *draft* forward, whatever model runs it (issue 68 item 2): the runner's forward
    hooks (:class:`~dtbench.harness.measurement.forwards.ForwardCounter`) time a forward by its role, not by its model object, so
    a decoder that drafts with its own target (LayerSkip, Kangaroo, SWIFT-style early exit, a plugin's Proposer on
    ``self.target``) has its drafting's share and draft cost right. The chain loop calls every Proposer inside it
    (:mod:`dtbench.decoders.chain`) and the tree loop every drafting of a tree (:mod:`dtbench.decoders.tree.loop`); a
    decoder's own loop wraps its drafting forwards in it. Never held across a ``yield``."""
    token = _FORWARD_ROLE.set("draft")
    try:
        yield
    finally:
        _FORWARD_ROLE.reset(token)


def forward_role() -> str:
    """``"draft"`` inside :func:`drafting`, else ``"target"``: the role a forward of the target object is counted as."""
    return _FORWARD_ROLE.get()
