"""What a decoder is handed and hands back (issues 33 and 42): speculative heads (config values and
weight shapes checked before anything is allocated, EAGLE-3 d2t ids inside the vocabulary), REST tokens files and
corpora (types, bounds, vocabulary, and never a prompt's own document in the datastore), and a plugin proposer that
returns more drafts than asked.

Split out of tests/test_hardening.py by subject (issue 57 item 3); each section names the issue item it tests.
Shared helpers: tests/hardening_kit.py.
"""

from __future__ import annotations

import json
import re

import pytest
from hardening_kit import npy_file, tiny_suite
from kit import invoke, one_line_error, write_suite

from dtbench.harness.errors import DtbenchError

TIER = "full"  # tests/conftest.py: the tier this module runs in (issue 57)


# --- issue 33 item 4: a REST corpus never holds a prompt's own document, whatever the seeds ------------------------


def _text_corpus(folder):
    """Twelve distinct documents of about 60 words each, one per file (a text-files corpus)."""
    import random as _random

    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "cloud", "north", "quiet", "amber", "field"]
    folder.mkdir()
    for i in range(12):
        rng = _random.Random(i)
        (folder / f"doc{i:02d}.txt").write_text(f"Document {i}. " + " ".join(rng.choice(words) for _ in range(60)))
    return folder


@pytest.mark.parametrize("seed", [0, 3, 5])
def test_rest_datastore_never_holds_a_prompt_document(tmp_path, monkeypatch, seed):
    """Issue 33 item 4: suite ``seed: 3``, 2 prompts, ``rest`` with ``corpus: {skip: 2}``: the datastore held both
    prompts verbatim (rest held its corpus out with its own ``seed`` param, 0 unless set by hand). The harness now
    injects the corpus, held out with the suite's seed: no prompt document reaches the datastore, whatever the seed."""
    import sqlite3

    from kit import suite_dict, tiny_pair
    from transformers import AutoTokenizer

    from dtbench.decoders import datastore

    corpus = _text_corpus(tmp_path / "corpus")
    target, draft = tiny_pair(tmp_path / "models")
    built: list[list[int]] = []
    real = datastore.Datastore.from_documents.__func__
    monkeypatch.setattr(
        datastore.Datastore,
        "from_documents",
        classmethod(lambda cls, docs: built.extend(map(list, docs)) or real(cls, docs)),
    )
    monkeypatch.setattr(datastore, "_STORES", {})
    suite = suite_dict(
        target,
        draft,
        [
            {"name": "ar"},
            {"name": "rest", "params": {"corpus": {"name": "text-files", "path": str(corpus), "skip": 2}}},
        ],
        seed=seed,
    )
    suite["datasets"] = [{"name": "text-files", "path": str(corpus), "prompts": 2, "warmup": 0, "L_max": 16}]
    suite["generation_lengths"] = [4]
    db = tmp_path / "r.db"
    result = invoke("run", write_suite(tmp_path, suite), "--db", str(db), "--no-progress")
    assert result.exit_code == 0, result.output
    with sqlite3.connect(db) as c:
        used = {row[0] for row in c.execute("select distinct document from samples")}
    assert len(used) == 2 and built  # two prompt documents; the datastore was built
    tok = AutoTokenizer.from_pretrained(str(target))
    in_store = {tuple(d) for d in built}
    for path in used:
        assert tuple(tok.encode(open(path).read())) not in in_store, f"prompt document {path} is in the datastore"
    assert len(in_store) >= 12 - 2 - 2  # the rest of the corpus is there (unusable documents before the 2nd aside)


def test_rest_own_seed_and_a_too_small_skip_are_refused(tmp_path):
    """A corpus is held out with the suite's seed only (rest's own ``seed:`` is refused), and a ``skip`` smaller than
    the suite's prompts of the same dataset is refused at validate (their documents would be in the datastore)."""
    from kit import suite_dict, tiny_pair

    corpus = _text_corpus(tmp_path / "corpus")
    target, draft = tiny_pair(tmp_path / "models")
    entry = {"name": "text-files", "path": str(corpus)}
    for params, needle in (
        ({"corpus": {**entry, "skip": 2}, "seed": 3}, "seed"),
        ({"corpus": {**entry, "skip": 1}}, "skip: 2 or more"),
    ):
        suite = suite_dict(target, draft, [{"name": "rest", "params": params}], seed=3)
        suite["datasets"] = [{**entry, "prompts": 2, "warmup": 0, "L_max": 16}]
        one_line_error(invoke("validate", write_suite(tmp_path, suite)), "rest", needle)


# --- issue 33 items 5, 6: head config and sizes, EAGLE-3 d2t outside the vocabulary --------------------------------


def _head(tmp_path, kind: str, config: dict | None = None, tensors=None) -> str:
    """A tiny head folder (heads_kit's published layouts, hidden 32, vocabulary 96), config.json updated with
    ``config`` (a non-dict replaces it), the weights changed by ``tensors``."""
    from dtbench.testing.fixtures import write_eagle, write_medusa

    folder = tmp_path / kind
    if kind == "medusa":
        write_medusa(folder, hidden=32, vocab=96)
    else:
        write_eagle(
            folder,
            hidden=32,
            vocab=96,
            version=3 if kind == "eagle3" else 1,
            draft_vocab=48 if kind == "eagle3" else None,
        )
    cfg = json.loads((folder / "config.json").read_text())
    if config is not None:
        (folder / "config.json").write_text(json.dumps({**cfg, **config} if isinstance(config, dict) else config))
    if tensors is not None:
        from safetensors.torch import load_file, save_file

        save_file(tensors(load_file(str(folder / "model.safetensors"))), str(folder / "model.safetensors"))
    return str(folder)


def _d2t(value):
    import torch

    return lambda sd: {**sd, "d2t": torch.full_like(sd["d2t"], value)}


HEAD_CASES = {
    "negative": (
        "eagle",
        {"intermediate_size": -5},
        None,
        "config.json: intermediate_size must be a positive integer, not -5",
    ),
    "string": ("eagle", {"hidden_size": "576"}, None, 'config.json: hidden_size must be a positive integer, not "576"'),
    "zero heads": ("eagle", {"num_attention_heads": 0}, None, "num_attention_heads must be a positive integer, not 0"),
    "list": ("eagle", [1, 2], None, "config.json is a JSON list, not an object"),
    "huge": (
        "eagle",
        {"intermediate_size": 3_000_000},
        None,
        "layers.0.mlp.gate_proj.weight has shape [64, 32] in the weights, but config.json makes it [3000000, 32]",
    ),
    "draft vocab": (
        "eagle3",
        {"draft_vocab_size": -1},
        None,
        "config.json: draft_vocab_size must be a positive integer, not -1",
    ),
    "medusa layers": (
        "medusa",
        {"medusa_num_layers": "x"},
        None,
        'config.json: medusa_num_layers must be a positive integer, not "x"',
    ),
    "d2t huge": (
        "eagle3",
        None,
        _d2t(10**9),
        "d2t maps draft id 0 to token 1000000000, outside the vocabulary (0..95)",
    ),
    "d2t negative": ("eagle3", None, _d2t(-(10**6)), "d2t maps draft id 0 to token -1000000, outside the vocabulary"),
}


@pytest.mark.parametrize("case", sorted(HEAD_CASES))
@pytest.mark.parametrize("command", ["validate", "run"])
def test_bad_heads_are_one_line_before_models_load(tmp_path, monkeypatch, case, command):
    from dtbench.harness.models import loading as models

    kind, config, tensors, needle = HEAD_CASES[case]
    head = _head(tmp_path, kind, config, tensors)

    def no_loading(*a, **kw):
        raise AssertionError("a model loaded before the head was checked")

    monkeypatch.setattr(models, "load_model", no_loading)
    name = "medusa" if kind == "medusa" else "eagle"
    suite = write_suite(tmp_path, tiny_suite(decoders=[{"name": "ar"}, {"name": name, "params": {"head": head}}]))
    args = [command, suite] + (["--db", str(tmp_path / "r.db"), "--no-progress"] if command == "run" else [])
    line = one_line_error(invoke(*args), f"decoder '{name}': head {head}", needle)
    assert "target" not in line  # the head's own field is blamed, not the target


@pytest.mark.parametrize("case", ["huge", "d2t huge"])
def test_a_fetched_head_is_checked_before_it_is_allocated(tmp_path, monkeypatch, case):
    """A hub head is checked when it is loaded (validate skips what is not a local folder): still before the module
    is built (EagleHead is never constructed off the meta device)."""
    import torch
    from heads_kit import deep_llama

    from dtbench.decoders import eagle_head as heads

    kind, config, tensors, needle = HEAD_CASES[case]
    folder = _head(tmp_path, kind, config, tensors)
    real = heads.EagleHead

    def only_on_meta(*a, **kw):
        assert torch.empty(0).device.type == "meta", "the head was allocated before its checks"
        return real(*a, **kw)

    monkeypatch.setattr(heads, "EagleHead", only_on_meta)
    with pytest.raises(ValueError, match=re.escape(needle)):
        heads.load_eagle(folder, deep_llama(0))


# --- issue 33 items 10, 6: REST corpora: the tokens file, ids outside the vocabulary -------------------------------


def _tokens_suite(tmp_path, tokens_path: str, decoder: str = "rest") -> str:
    extra = {} if decoder == "rest" else {"draft": {"model": "smollm2-135m", "dtype": "float32"}}
    return write_suite(
        tmp_path, tiny_suite(decoders=[{"name": "ar"}, {"name": decoder, "params": {"tokens": tokens_path}}], **extra)
    )


TOKEN_FILES = {
    "object": ("t.npy", lambda np: np.array([1, "x", None], dtype=object), "holds object values"),
    "empty": ("t.npy", lambda np: np.zeros(0, dtype=np.int64), "is empty (no token ids)"),
    "negative": ("t.npy", lambda np: np.array([5, 6, -1, 7, -5], dtype=np.int64), "holds the negative id -5"),
    "float": ("t.npy", lambda np: np.array([5.7, 6.2, 7.9]), "holds float64 values, not integer token ids"),
    "text": ("t.txt", lambda np: [5, 6, 7], "not a .npy file"),
    "separators": ("t.npy", lambda np: np.array([-1, -1], dtype=np.int64), "only document separators"),
}


@pytest.mark.parametrize("case", sorted(TOKEN_FILES))
@pytest.mark.parametrize("command", ["validate", "run"])
def test_bad_tokens_files_are_one_line_before_models_load(tmp_path, monkeypatch, case, command):
    import numpy as np

    from dtbench.harness.models import loading as models

    name, make, needle = TOKEN_FILES[case]
    path = npy_file(tmp_path, name, make(np))

    def no_loading(*a, **kw):
        raise AssertionError("a model loaded before the tokens file was checked")

    monkeypatch.setattr(models, "load_model", no_loading)
    suite = _tokens_suite(tmp_path, path, "rest" if case != "negative" else "suffix")
    args = [command, suite] + (["--db", str(tmp_path / "r.db"), "--no-progress"] if command == "run" else [])
    one_line_error(invoke(*args), "tokens file", needle)


def test_a_tokens_file_is_bounded_like_a_dataset_file(tmp_path, monkeypatch):
    """A tokens file larger than the bound (256 MiB; 1 kB here) is refused at validate, before anything reads it (a
    1e8-token uint16 file used to pass validate and exhaust memory as Python ints in the run)."""
    import numpy as np

    from dtbench.decoders import datastore

    monkeypatch.setattr(datastore, "MAX_TOKENS_FILE_BYTES", 1000, raising=False)
    path = npy_file(tmp_path, "big.npy", np.arange(2000, dtype=np.uint16))
    one_line_error(invoke("validate", _tokens_suite(tmp_path, path)), "is larger than 1,000 bytes")


@pytest.mark.fast  # keeps the module's subject in the fast tier (issue 57)
def test_a_tokens_file_is_kept_in_numpy():
    """from_flat (the tokens file's path) builds exactly from_documents' datastore, without Python lists."""
    import numpy as np

    from dtbench.decoders.datastore import SEPARATOR, Datastore

    rng = np.random.default_rng(0)
    flat = rng.integers(0, 50, 400).astype(np.int32)
    flat[[0, 17, 18, 19, 100, 250, 399]] = -1  # a leading, repeated and trailing separator, empty documents
    docs = [d.tolist() for d in np.split(flat.astype(np.int64), np.flatnonzero(flat < 0))]
    docs = [[t for t in d if t >= 0] for d in docs]
    a, b = Datastore.from_flat(flat), Datastore.from_documents(docs)
    assert a.tokens.dtype == np.uint32 and np.array_equal(a.tokens, b.tokens) and np.array_equal(a.sa, b.sa)
    assert a.documents == b.documents == int((a.tokens == SEPARATOR).sum())
    assert a.max_token == int(flat.max())


def test_rest_tokens_outside_the_vocabulary_are_refused_when_the_models_load(tmp_path, monkeypatch, data_dir):
    """ids >= the target's vocabulary (49,152 for the embedded model): one line, exit 2, no sample measured (they
    used to crash generation with IndexError, exit 4)."""
    import numpy as np

    from dtbench.harness.measurement import local_measurer as cells

    path = npy_file(tmp_path, "t.npy", np.array([5, 6, 7, -1, 60_000, 8, 9], dtype=np.int64))
    monkeypatch.setattr(cells, "measure_rows", lambda *a, **k: (_ for _ in ()).throw(AssertionError("measured")))
    one_line_error(
        invoke(
            "run",
            _tokens_suite(tmp_path, path),
            "--db",
            str(tmp_path / "r.db"),
            "--no-progress",
            "--data-dir",
            str(data_dir),
        ),
        f"decoder 'rest': tokens file {path} holds token id 60000, outside the target's vocabulary (0..49151)",
    )


def test_a_corpus_outside_the_vocabulary_is_refused_before_timing():
    import torch
    from heads_kit import deep_llama

    from dtbench.core import Corpus
    from dtbench.decoders.rest import Rest, RestParams

    target = deep_llama(0)  # vocabulary 96
    decoder = Rest(target, None, RestParams.model_validate({"corpus": {"name": "wikitext-2"}}))
    with pytest.raises(ValueError, match=r"the corpus holds token id 500, outside the target's vocabulary \(0..95\)"):
        decoder.use_corpus(Corpus("k-vocab", ((1, 2, 3, 500),)))
    assert torch.is_tensor(target.get_output_embeddings().weight)


# --- issue 42 item 10: a plugin proposer returning more drafts than asked ------------------------------------------


class _Greedy:
    """The target's own greedy continuation as a plugin's proposer would compute it, ``extra`` drafts too many."""

    def __init__(self, model, extra: int):
        from dtbench.api import Proposer

        class Over(Proposer):
            def begin(self, prompt, pending):
                self.text = [*prompt, pending]

            def propose(self, max_tokens):
                import torch

                out, ids = [], list(self.text)
                for _ in range(max_tokens + extra):
                    token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
                    out.append(token)
                    ids.append(token)
                return out

            def accept(self, drafts, accepted, committed):
                self.text.extend(committed)

        self.make = Over


@pytest.mark.parametrize("batched", [False, True])
def test_a_proposer_returning_more_drafts_than_asked_is_refused(batched):
    import torch

    from dtbench import api
    from dtbench.testing.fixtures import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(seed=0).eval()
    prompt = torch.tensor([[1, 2, 3, 4]])
    proposers = _Greedy(model, extra=3)
    with (
        torch.inference_mode(),
        pytest.raises(DtbenchError, match=r"proposer Over returned \d+ drafts when asked for at most \d+"),
    ):
        if batched:
            list(api.speculate_chain_batch(model, [proposers.make(), proposers.make()], [prompt, prompt], 12, 4))
        else:
            list(api.speculate_chain(api.KVTarget(model), proposers.make(), prompt, 12, 4))
    exact = _Greedy(model, extra=0)
    with torch.inference_mode():
        steps = list(api.speculate_chain_batch(model, [exact.make()], [prompt], 12, 4))
    assert sum(len(s[0].tokens) for s in steps) == 12 and all(s[0].accepted <= 4 for s in steps)
