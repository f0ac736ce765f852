"""Random-weight models named by shape (issue 38 item 4: the GPU smoke suite, no download), split from
:mod:`dtbench.harness.models.loading`, which loads them: ``random:<shape>[:<seed>]`` names (:func:`random_spec`), the shapes
(:data:`RANDOM_SHAPES`), the seeded GPT-NeoX model (:func:`random_neox`) and its tokenizer of ids
(:class:`IdTokenizer`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dtbench.harness.errors import DtbenchError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

RANDOM = "random:"
# GPT-NeoX shapes (EleutherAI/pythia-2.8b and pythia-70m config.json: the paper's target and draft), and a tiny pair of
# the same architecture for CPU tests and the GPU check's dry run (a few MB).
RANDOM_SHAPES: dict[str, dict] = {
    "pythia-2.8b": dict(
        hidden_size=2560,
        num_hidden_layers=32,
        num_attention_heads=32,
        intermediate_size=10240,
        vocab_size=50304,
        rotary_pct=0.25,
        max_position_embeddings=2048,
    ),
    "pythia-70m": dict(
        hidden_size=512,
        num_hidden_layers=6,
        num_attention_heads=8,
        intermediate_size=2048,
        vocab_size=50304,
        rotary_pct=0.25,
        max_position_embeddings=2048,
    ),
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=512,
        vocab_size=512,
        rotary_pct=0.25,
        max_position_embeddings=2048,
    ),
    "tiny-draft": dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=512,
        rotary_pct=0.25,
        max_position_embeddings=2048,
    ),
}


def random_spec(name: str) -> tuple[str, int] | None:
    """(shape, seed) of a ``random:<shape>[:<seed>]`` model name (seed 0 by default), None for any other name.

    Raises:
        DtbenchError: an unknown shape (naming the known ones) or a seed that is not a non-negative integer.
    """
    if not name.startswith(RANDOM):
        return None
    shape, _, seed = name[len(RANDOM) :].partition(":")
    if shape not in RANDOM_SHAPES:
        raise DtbenchError(f"model '{name}': unknown random shape '{shape}' (known: {', '.join(RANDOM_SHAPES)})")
    if seed and not seed.isdigit():
        raise DtbenchError(f"model '{name}': the seed after the shape must be a non-negative integer")
    return shape, int(seed or 0)


def random_neox(shape: dict, dtype: torch.dtype, device, seed: int) -> PreTrainedModel:
    """A GPT-NeoX causal LM (Pythia's architecture: parallel residual, 25% rotary, untied output layer) of ``shape``
    (a :data:`RANDOM_SHAPES` entry) with weights seeded by ``seed`` (``torch.manual_seed``: the same on every run of
    one torch version and device type), built directly on ``device`` in ``dtype``, in eval mode."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(**shape, use_parallel_residual=True, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = GPTNeoXForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


class IdTokenizer:
    """The tokenizer of a random model: text is whitespace-separated token ids (what the ``random-tokens`` dataset
    writes), so prompts need no vocabulary. ``encode`` parses them, ``decode`` joins them; ``len()`` is the model's
    vocabulary size; no special tokens (EOS None: the workload is fixed-length).

    Raises:
        DtbenchError: (encode) a word that is not an id below the vocabulary size.
    """

    eos_token_id = None
    pad_token_id = 0
    bos_token_id = None
    chat_template = None

    def __init__(self, vocab: int, name: str):
        self.vocab, self.name_or_path = vocab, name

    def __len__(self) -> int:
        return self.vocab

    def get_vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(self.vocab)}

    def encode(self, text: str, **kwargs) -> list[int]:
        words = text.split()
        if not all(w.isdigit() and int(w) < self.vocab for w in words):
            raise DtbenchError(
                f"model '{self.name_or_path}' reads text as token ids below {self.vocab}: use the random-tokens "
                "dataset (with params: {vocab: ...} at most the model's vocabulary)"
            )
        return [int(w) for w in words]

    def decode(self, ids, **kwargs) -> str:
        return " ".join(str(int(i)) for i in ids)
