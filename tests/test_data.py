"""harness/data/datasets.py, sources.py and selection.py: the hub's parquet path (offline, on parquet files written here), provenance, held-out
selection (``skip``), and that the tuning suite's prompts share no document with any benchmark suite's."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from dtbench.harness.data import datasets as data
from dtbench.harness.data import selection, sources
from dtbench.harness.errors import DtbenchError
from dtbench.harness.suites.suite import DatasetSpec
from dtbench.harness.suites.suitefile import load_suite

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

SUITES = Path(__file__).resolve().parents[1] / "suites"


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """No network, no local data folder, the datasets cache in tmp: only the hub code path is left."""
    import datasets

    monkeypatch.delenv(sources.DATA_DIR_ENV, raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    return tmp_path


def write_wikitext_repo(folder: Path, raw: str) -> None:
    """The layout of Salesforce/wikitext: a card declaring the config, parquet shards per split, one row per
    line of the raw file (text with its newline; blank lines as empty strings, as the hub's rows are)."""
    import pandas as pd

    (folder / "wikitext-2-raw-v1").mkdir(parents=True)
    rows = [line + "\n" if line.strip() else "" for line in raw.split("\n")]
    pd.DataFrame({"text": rows}).to_parquet(folder / "wikitext-2-raw-v1" / "test-00000-of-00001.parquet")
    pd.DataFrame({"text": ["unused\n"]}).to_parquet(folder / "wikitext-2-raw-v1" / "train-00000-of-00001.parquet")
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: wikitext-2-raw-v1\n  data_files:\n"
        "  - split: test\n    path: wikitext-2-raw-v1/test-*\n  - split: train\n    path: wikitext-2-raw-v1/train-*\n"
        "---\n"
    )


def write_pg19_repo(folder: Path, books: list[tuple[str, str]]) -> None:
    """The layout of emozilla/pg19: data/<split>-*.parquet with PG-19's columns."""
    import pandas as pd

    (folder / "data").mkdir(parents=True)
    frame = pd.DataFrame(
        {
            "short_book_title": [t for t, _ in books],
            "publication_date": [1900] * len(books),
            "url": [f"https://www.gutenberg.org/ebooks/{i}" for i in range(len(books))],
            "text": [x for _, x in books],
        }
    )
    frame.to_parquet(folder / "data" / "test-00000-of-00001-0000000000000000.parquet")


def squeeze(text: str) -> str:
    return re.sub(r"\n\s*\n", "\n", text)


def test_default_hub_sources_are_parquet_repos():
    """A dataset's hub source is its class attribute (no table keyed by name)."""
    assert data.WikiText2.hub.hub_id == "Salesforce/wikitext"
    assert data.WikiText2.hub.config == "wikitext-2-raw-v1"
    assert data.PG19.hub.hub_id == "emozilla/pg19"  # not the loading-script deepmind/pg19
    assert data.TextFiles.hub is None and data.SpecBench.hub is None
    assert not hasattr(data, "HUB_SOURCES") and not hasattr(data, "_PROVENANCE")


def test_wikitext_hub_path_reads_parquet(offline_hub, data_dir):
    """The hub path's own datasets.load_dataset call, pointed (hub_id) at a local copy of the repo layout,
    yields the same articles as the raw file; provenance names the source."""
    raw = (data_dir / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
    repo = offline_hub / "Salesforce-wikitext"
    write_wikitext_repo(repo, raw)
    spec = DatasetSpec(name="wikitext-2", hub_id=str(repo), revision=None)
    hub = data.load_documents(spec)
    local = data.load_documents(DatasetSpec(name="wikitext-2"), str(data_dir))
    assert [t for t, _ in hub] == [t for t, _ in local] and len(hub) > 50
    assert all(squeeze(a) == squeeze(b) for (_, a), (_, b) in zip(hub, local))
    prov = hub.provenance  # returned with the documents
    assert prov == {
        "name": "wikitext-2",
        "source": "hub",
        "hub_id": str(repo),
        "config": "wikitext-2-raw-v1",
        "split": "test",
        "revision": None,
        "datasets": prov["datasets"],
        "skip": 0,
    }
    loc = local.provenance
    assert loc["source"] == "local" and loc["files"][0].endswith("wiki.test.raw") and len(loc["sha256"]) == 64


def test_pg19_hub_path_streams_parquet(offline_hub):
    books = [(f"Book {i}", f"Chapter I.\n\n{'word ' * 50}{i}") for i in range(6)]
    repo = offline_hub / "emozilla-pg19"
    write_pg19_repo(repo, books)
    spec = DatasetSpec(name="pg19", prompts=3, warmup=1, hub_id=str(repo), skip=1)
    docs = data.load_documents(spec)
    assert list(docs) == [(t, x.strip()) for t, x in books[:4]]  # streamed: prompts + skip books read
    assert docs.skip == 1
    prov = docs.provenance
    assert prov["source"] == "hub" and prov["hub_id"] == str(repo) and prov["rows_read"] == 4 and prov["skip"] == 1


def test_hub_errors_are_one_line(offline_hub):
    with pytest.raises(DtbenchError, match="pg19: cannot load .*--data-dir"):
        data.load_documents(DatasetSpec(name="pg19", hub_id=str(offline_hub / "missing")))


class WordTokenizer:
    def encode(self, text):
        return [hash(w) % 1000 for w in text.split()]


def test_skip_leaves_out_the_documents_of_smaller_selections():
    """With the same seed, prompts <= K and skip = K never share a document, short documents included."""
    rnd = random.Random(1)
    docs = [(f"doc{i}", " ".join("w" for _ in range(rnd.choice([5, 20, 40, 200])))) for i in range(40)]
    tok = WordTokenizer()
    for seed in range(20):
        for k in (1, 3, 6):
            held = selection.select_prompts(data.Documents(docs, skip=k), tok, 5, 32, seed)
            assert len(held) == 5
            for n in range(1, k + 1):
                bench = selection.select_prompts(docs, tok, n, 32, seed)
                assert not {p.document for p in bench} & {p.document for p in held}, (seed, k, n)
    assert selection.select_prompts(docs, tok, 4, 32, 0, skip=0) == selection.select_prompts(
        data.Documents(docs), tok, 4, 32, 0
    )
    with pytest.raises(DtbenchError, match="after skipping 40 documents"):
        selection.select_prompts(docs, tok, 1, 32, 0, skip=40)


@pytest.mark.slow
def test_tuning_prompts_come_from_other_documents_than_every_benchmark(data_dir):
    """suites/dynatree-tuning.yaml against every suite that measures the embedded pair on the same datasets:
    the prompts it tunes on and the prompts the benchmarks measure share no document."""
    from dtbench.harness.models import loading as models

    tuning, _ = load_suite(SUITES / "dynatree-tuning.yaml")
    tokenizer = models.load_tokenizer(tuning.target)
    checked = 0
    for path in sorted(SUITES.glob("*.yaml")):
        bench, _ = load_suite(path)
        if path.name == "dynatree-tuning.yaml" or bench.target.model != tuning.target.model:
            continue
        for t_ds in tuning.datasets:
            for b_ds in (d for d in bench.datasets if d.name == t_ds.name):
                assert b_ds.skip == 0
                held = {
                    p.document
                    for l_max in t_ds.l_maxes
                    for p in selection.select_prompts(
                        data.load_documents(t_ds, str(data_dir)), tokenizer, t_ds.prompts, l_max, tuning.seed
                    )
                }
                used = {
                    p.document
                    for l_max in b_ds.l_maxes
                    for p in selection.select_prompts(
                        data.load_documents(b_ds, str(data_dir)), tokenizer, b_ds.prompts, l_max, bench.seed
                    )
                }
                assert held and used and not held & used, (path.name, held & used)
                checked += 1
    assert checked >= 4
