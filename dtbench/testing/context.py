"""The context a decoder draws its check settings from (:meth:`~dtbench.decoders.base.Decoder.check_settings`): the
tiny target and helpers writing the files params name (heads, datastores) into this process's scratch root."""

from __future__ import annotations

import multiprocessing.util
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dtbench.testing.fixtures import write_eagle, write_medusa

_SCRATCH: list[str] = []  # this process's scratch root: made on first use (or set by a check child), one at most


def scratch_root(root: str | None = None) -> str:
    """The folder this process's :class:`CheckContext` folders are made in; ``root`` sets it (a check child's: its
    parent removes it, even after killing the child). Made on first use otherwise, and removed when the process
    exits (a ``multiprocessing`` exit finalizer: it runs in a main process and in a multiprocessing child alike)."""
    if root is not None:
        _SCRATCH[:] = [root]
    elif not _SCRATCH:
        made = tempfile.mkdtemp(prefix="dtbench-check-")
        multiprocessing.util.Finalize(None, shutil.rmtree, args=(made,), kwargs={"ignore_errors": True}, exitpriority=0)
        _SCRATCH.append(made)
    return _SCRATCH[0]


class CheckContext:
    """What :meth:`~dtbench.decoders.base.Decoder.check_settings` receives: the tiny target the settings are for and
    helpers writing the files params name, into a scratch folder of this process.

    Attributes:
        target: the seeded target (a transformers causal LM; ``target.config`` gives ``hidden_size``, ``vocab_size``).
        folder: a scratch folder, under :func:`scratch_root` (removed when the process ends).
        prompt: token ids a datastore may be built around (ids 3..19).
    """

    prompt = tuple(range(3, 20))

    def __init__(self, target: Any, folder: Path | None = None):
        self.target: Any = target  # a transformers PreTrainedModel (``config``, ``device``)
        self.folder = folder or Path(tempfile.mkdtemp(prefix="context-", dir=scratch_root()))

    def medusa_head(self, heads: int = 4) -> str:
        """A Medusa-1 head folder in the published layout (random weights) sized for :attr:`target`; its path."""
        cfg = self.target.config
        return str(
            write_medusa(self.folder / f"medusa-{heads}", hidden=cfg.hidden_size, vocab=cfg.vocab_size, heads=heads)
        )

    def eagle_head(self, version: int = 1) -> str:
        """An EAGLE-1/2 (``version=1``) or EAGLE-3 head folder (random weights) sized for :attr:`target`; its path."""
        cfg = self.target.config
        folder = self.folder / f"eagle-{version}"
        return str(write_eagle(folder, hidden=cfg.hidden_size, vocab=cfg.vocab_size, version=version))

    def token_file(self, tokens: list[int] | None = None) -> str:
        """A token datastore file (``.npy``, -1 separating documents): ``tokens``, or :attr:`prompt` followed by
        other ids of the target's vocabulary; its path."""
        import numpy as np

        vocab = int(self.target.config.vocab_size)
        ids = tokens if tokens is not None else [*self.prompt, 30 % vocab, 31 % vocab, -1, *range(vocab - 6, 3, -1)]
        path = self.folder / "tokens.npy"
        np.save(path, np.array(ids))
        return str(path)
