"""Training-free decoders (issue 22, part A): ``ngram``, ``suffix``, ``rest``.

Their search structures against brute force; greedy equivalence with ``ar`` on Llama- and GPT-NeoX-style float64
models with prompts that repeat (drafts accepted) and that do not; proposals made, and accepted, partly accepted
and rejected; sampling checked as a distribution where the method samples (chain methods), refused where not. The
greedy property tests are parametrized over the device (issue 38 item 3, ``models.DEVICES``): on CUDA (skipped
without one) the same seeded pairs in float32 token for token and in float16 under the tie-aware rule.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import DEVICES, assert_lossless, decoder_steps, device_zoo, examples, model_zoo, run_decoder

from dtbench.decoders.ar import ARParams, Autoregressive
from dtbench.decoders.ngram import Ngram, NgramParams, longest_suffix_match
from dtbench.decoders.rest import Datastore, Rest, RestParams, cut_to_choices, frequent_trie
from dtbench.decoders.suffix import SuffixAutomaton, SuffixDecoding, SuffixParams
from dtbench.testing.fixtures import ARCHS, SHARP, VOCAB

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")


def brute_match(tokens, min_n, max_n, occurrence):
    """The longest suffix (min_n..max_n tokens) occurring earlier, and the index after the chosen occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        ends = [e for e in range(n - 1, len(tokens) - 1) if tokens[e - n + 1 : e + 1] == tokens[-n:]]
        if ends:
            return n, (min(ends) if occurrence == "earliest" else max(ends)) + 1
    return 0, 0


@settings(max_examples=examples(200), deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 4),
    occurrence=st.sampled_from(["earliest", "latest"]),
)
def test_kmp_search_finds_the_longest_earlier_suffix(tokens, min_n, extra, occurrence):
    assert longest_suffix_match(tokens, min_n, min_n + extra, occurrence) == brute_match(
        tokens, min_n, min_n + extra, occurrence
    )


@settings(max_examples=examples(100), deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=40))
def test_suffix_automaton_tracks_the_longest_repeated_suffix(tokens):
    sam = SuffixAutomaton()
    for i, t in enumerate(tokens):
        sam.append(t)
        assert sam.repeated_suffix() == brute_match(tokens[: i + 1], 1, len(tokens), "earliest")
    assert len(sam.length) <= max(2 * len(tokens) - 1, len(tokens) + 1)  # the automaton's linear size bound


def test_frequent_trie_keeps_parents_and_the_most_frequent_nodes():
    cont = np.array([[5, 6, 7], [5, 6, 8], [5, 9, -1], [4, -1, -1]])
    trie = frequent_trie(cont, 4)
    assert trie == [((5,), 3), ((4,), 1), ((5, 6), 2), ((5, 9), 1)]  # BFS order; ties: shallower first
    chosen = {t for t, _ in trie}
    assert all(t[:-1] in chosen or len(t) == 1 for t in chosen)


def test_cut_to_choices_is_the_reference_arithmetic():
    """REST's lib.rs cut_to_choices: the chosen prefixes with the most distinct tokens are dropped first until the sum
    of the survivors' distinct-token counts is at most choices; the tree is every prefix of the survivors."""
    chain = [(tuple(range(10, 10 + d)), 3) for d in range(1, 11)]  # 1 + 2 + ... + 10 = 55 distinct tokens
    singles = [((100 + i,), 1) for i in range(20)]  # + 20 = 75 > 64
    kept = cut_to_choices(chain + singles, 64)
    assert kept == chain[:8] + singles  # dropping the depth-10 (65 left) and depth-9 (56 <= 64) prefixes
    assert cut_to_choices(chain + singles, 75) == chain + singles  # nothing to cut
    # repeated tokens count once: (5, 5, 5) costs 1, so it outlives the 2-token (5, 6) of the same frequency
    trie = [((5,), 4), ((5, 5), 2), ((5, 6), 2), ((5, 5, 5), 2)]
    assert sum(len(set(t)) for t, _ in trie) == 5
    assert cut_to_choices(trie, 3) == [((5,), 4), ((5, 5), 2), ((5, 5, 5), 2)]
    assert cut_to_choices([((7,), 5), ((7, 8), 5), ((9,), 1)], 2) == [((7,), 5), ((9,), 1)]
    rng = np.random.default_rng(0)  # on random retrievals: a tree (closed under prefixes) within the budget
    for _ in range(200):
        cont = rng.integers(0, 4, (int(rng.integers(1, 40)), int(rng.integers(1, 8))))
        n_max = int(rng.integers(1, 30))
        chosen = frequent_trie(cont, n_max)
        kept = cut_to_choices(chosen, n_max)
        prefixes = {t for t, _ in kept}
        assert set(kept) <= set(chosen) and all(t[:-1] in prefixes for t in prefixes if len(t) > 1)
        assert sum(len(set(t)) for t in prefixes) <= n_max
    cont = np.array([[5, 6, 7], [5, 6, 8], [5, 9, -1], [4, -1, -1]])
    assert cut_to_choices(frequent_trie(cont, 64), 64) == frequent_trie(cont, 64)  # 1+1+2+2+3+3 = 12 <= 64


def test_datastore_finds_every_occurrence():
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 5, 200).tolist() for _ in range(3)]
    store = Datastore.from_documents(docs)
    flat = [t for d in docs for t in [*d, -1]]
    for pattern in ([1], [2, 3], [0, 1, 2], [4, 4, 4, 4]):
        lo, hi = store.find(pattern)
        starts = sorted(int(store.sa[i]) for i in range(lo, hi))
        assert starts == [i for i in range(len(flat)) if flat[i : i + len(pattern)] == pattern]
    assert store.nbytes == store.tokens.nbytes + store.sa.nbytes > 0


# ---------------------------------------------------------------------------------------------- greedy equivalence


def _greedy(target, prompt, T):
    return run_decoder(Autoregressive(target, None, ARParams()), prompt, T)


@pytest.fixture(scope="module")
def store_file(tmp_path_factory):
    """A tokens file for ``rest``: the target's own greedy continuations of a few prompts (retrieval is then
    often right) and random documents (often wrong)."""
    docs = []
    for arch in ARCHS:
        target, _ = model_zoo(arch=arch, sharpness=SHARP)["self"]
        for seed in range(3):
            prompt = torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
            docs.append(prompt + _greedy(target, prompt, 40))
    rng = np.random.default_rng(1)
    docs += [rng.integers(3, VOCAB, 300).tolist() for _ in range(3)]
    path = tmp_path_factory.mktemp("rest") / "store.npy"
    np.save(path, np.array([t for d in docs for t in [*d, -1]], dtype=np.int64))
    return str(path)


def build(name, params, arch, store_file, kind="perturbed", device="cpu", dtype=torch.float64):
    target, draft = device_zoo(device, dtype, arch=arch, sharpness=SHARP)[kind]
    if name == "ngram":
        return Ngram(target, None, NgramParams(**params))
    if name == "suffix":
        params = {**params, "tokens": store_file} if params.get("tokens") == "store" else params
        return SuffixDecoding(target, draft, SuffixParams(**params))
    return Rest(target, None, RestParams(tokens=store_file, **params))


CASES = [
    ("ngram", {}),
    ("ngram", {"k": 3, "min_n": 2, "max_n": 4, "occurrence": "latest"}),
    ("suffix", {}),
    ("suffix", {"k": 4, "min_match": 3, "fallback": "draft"}),
    ("suffix", {"k": 5, "tokens": "store"}),
    ("rest", {}),
    ("rest", {"n_max": 8, "depth": 4, "max_suffix": 4, "min_suffix": 1}),
    ("rest", {"prune": "frequency", "n_max": 16}),
]
prompts = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=16)


@pytest.mark.parametrize("on", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name, params", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
@settings(max_examples=examples(8), deadline=None)
@given(prompt=prompts, repeats=st.integers(1, 3), T=st.integers(1, 40))
def test_greedy_output_equals_ar(store_file, on, arch, name, params, prompt, repeats, T):
    """Prompts with repeats > 1 repeat themselves (drafts accepted); others mostly do not."""
    device, dtype, rule = on
    prompt = prompt * repeats
    decoder = build(name, params, arch, store_file, device=device, dtype=dtype)
    steps = decoder_steps(decoder, prompt, T)
    tokens = [t for s in steps for t in s.tokens][:T]
    assert_lossless(decoder.target, prompt, tokens, _greedy(decoder.target, prompt, T), rule)
    context, produced = [*prompt, *steps[0].tokens], 1
    for s in steps[1:]:
        assert 0 <= s.accepted <= s.depth <= s.drafted and len(s.tokens) == s.accepted + 1
        room = min(decoder.params.k if name != "rest" else decoder.params.depth, T - produced - 1)
        if name == "ngram":  # a draft exactly when the context's suffix recurs (and there is room)
            p = decoder.params
            assert bool(s.drafted) == (room > 0 and brute_match(context, p.min_n, p.max_n, "earliest")[0] > 0)
        elif name == "suffix":
            p = decoder.params
            matched = brute_match(context, p.min_match, len(context), "earliest")[0] > 0
            if not p.has_corpus:  # (a corpus drafts on its own matches too)
                assert bool(s.drafted) == (room > 0 and (matched or p.fallback == "draft"))
        context += s.tokens
        produced += len(s.tokens)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name, params", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_proposals_accepted_partly_accepted_and_rejected(store_file, arch, name, params):
    """Over a few prompts every method drafts, and its drafts are fully accepted, partly accepted and rejected."""
    seen = set()
    for seed in range(8):
        prompt = torch.randint(3, VOCAB, (8,), generator=torch.Generator().manual_seed(100 + seed)).tolist()
        decoder = build(name, params, arch, store_file)
        T = 48
        steps = decoder_steps(decoder, prompt * 2, T)
        assert [t for s in steps for t in s.tokens][:T] == _greedy(decoder.target, prompt * 2, T)
        for s in steps[1:]:
            if s.drafted:
                seen.add("all" if s.accepted == s.depth else "part" if s.accepted else "none")
    assert seen == {"all", "part", "none"}
    state = decoder.state_stats()
    assert all(isinstance(v, int) for v in state.values()) and any(
        k.endswith("_bytes") and v > 0 for k, v in state.items()
    )


def test_state_is_recorded(store_file):
    target, _ = model_zoo(arch="llama", sharpness=SHARP)["self"]
    rest = Rest(target, None, RestParams(tokens=store_file))
    info = rest.state_stats()
    assert info["datastore_tokens"] == len(np.load(store_file)) and info["datastore_build_ms"] >= 0
    assert Rest(target, None, RestParams(tokens=store_file)).store is rest.store  # built once per process
    run_decoder(rest, [5, 6, 7, 5, 6], 12)
    assert rest.state_stats()["retrieval_steps"] > 0
    suffix = SuffixDecoding(target, target, SuffixParams(min_match=1))
    run_decoder(suffix, [5, 6, 7, 5, 6], 30)  # the greedy output starts repeating after about 14 tokens
    assert suffix.state_stats()["automaton_states"] >= 5 + 30 and suffix.state_stats()["automaton_draft_steps"] > 0
    with_corpus = SuffixDecoding(target, None, SuffixParams(tokens=store_file))
    run_decoder(with_corpus, [5, 6, 7, 5, 6], 30)
    assert with_corpus.state_stats()["corpus_draft_steps"] > 0 and with_corpus.state_stats()["datastore_bytes"] > 0


def test_bad_params_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="min_n"):
        NgramParams(min_n=4, max_n=2)
    with pytest.raises(ValueError, match="exactly one"):
        RestParams()
    with pytest.raises(ValueError, match="at most one"):
        SuffixParams(tokens="a.npy", corpus={"name": "wikitext-2"})
    target, _ = model_zoo()["self"]
    from dtbench.harness.errors import DtbenchError

    with pytest.raises(ValueError, match="does not exist"):
        RestParams(tokens=str(tmp_path / "missing.npy"))
    (tmp_path / "bad.npy").write_text("not numpy")
    with pytest.raises(DtbenchError, match="cannot read tokens file"):
        Rest(target, None, RestParams(tokens=str(tmp_path / "bad.npy")))


def test_validate_refuses_bad_rest_params_and_sampling(tmp_path, store_file):
    """`dtbench validate`: a one-line error, exit 2, before any model loads (no traceback)."""
    from kit import invoke, one_line_error, suite_dict, tiny_pair, write_suite

    pair = tiny_pair(tmp_path / "models")
    bad = suite_dict(*pair, [{"name": "rest", "params": {"corpus": {"name": "wikitext-3"}}}])
    one_line_error(invoke("validate", write_suite(tmp_path, bad, "a.yaml")), "corpus", "wikitext-3")
    sampled = suite_dict(
        *pair, [{"name": "ngram"}, {"name": "rest", "params": {"tokens": store_file}}], sampling={"temperature": 0.8}
    )
    one_line_error(invoke("validate", write_suite(tmp_path, sampled, "b.yaml")), "decoders.1", "rest")


def test_suffix_fallback_uses_the_draft_model_only_on_short_matches():
    target, draft = model_zoo(sharpness=SHARP)["perturbed"]
    prompt = list(range(10, 30))  # no repeats: the automaton cannot draft at first
    none = SuffixDecoding(target, draft, SuffixParams(fallback="none"))
    with_draft = SuffixDecoding(target, draft, SuffixParams(fallback="draft", k=4))
    first_none = decoder_steps(none, prompt, 20)
    first_draft = decoder_steps(with_draft, prompt, 20)
    assert first_none[1].drafted == 0 and first_draft[1].drafted == 4
    assert with_draft.state_stats()["fallback_draft_steps"] > 0
    assert [t for s in first_draft for t in s.tokens][:20] == _greedy(target, prompt, 20)


# ---------------------------------------------------------------------------------------------------- sampling


@pytest.mark.full  # a thousand sampled generations per setting
# suffix at t = 1 with its declared settings is the kit's sampling check (tests/test_conformance_sampling.py)
@pytest.mark.parametrize("decoder, setting", [("ngram", "t0.7-topk4"), ("suffix-draft", "topp0.8")])
def test_chain_methods_sample_the_target_distribution(decoder, setting):
    from test_sampling import ALPHA, SETTINGS, models, p_value

    target = models()["self"]
    make = {
        "ngram": lambda: Ngram(target, None, NgramParams(k=3, occurrence="latest")),
        "suffix": lambda: SuffixDecoding(target, None, SuffixParams(k=3, min_match=1)),
        "suffix-draft": lambda: SuffixDecoding(target, models()["perturbed"], SuffixParams(k=2, fallback="draft")),
    }
    dec = make[decoder]()
    dec.sampling, dec.generator = SETTINGS[setting], torch.Generator().manual_seed(0)
    assert any(s.drafted for s in dec.generate(torch.tensor([[1, 4, 2, 5]]), 6))  # drafts are verified
    assert p_value(dec, SETTINGS[setting], length=6) > ALPHA


# ---------------------------------------------------------------------------------------------------- the peer


@pytest.mark.parametrize("on", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
@settings(max_examples=examples(6), deadline=None)
@given(prompt=prompts, repeats=st.integers(1, 3), T=st.integers(2, 40))
def test_ngram_emits_what_transformers_prompt_lookup_emits(on, arch, prompt, repeats, T):
    """``ngram`` with transformers' settings (K = 10, n-grams of 2 then 1, earliest occurrence) and ``hf_generate``
    with ``prompt_lookup_num_tokens: 10`` emit the same tokens, and both draft from a prompt that repeats.
    (Their iterations are not aligned: transformers drafts its first candidates from the prompt alone, in the
    prefill forward.) Under the tie-aware rule each is checked against the target (their verification shapes
    differ, so a near tie may break differently in each)."""
    from dtbench.decoders.hf_assisted import HFGenerate, HFGenerateParams

    device, dtype, rule = on
    target, _ = device_zoo(device, dtype, arch=arch)["self"]
    prompt = prompt * repeats
    ours = decoder_steps(Ngram(target, None, NgramParams(k=10, max_n=2)), prompt, T)
    theirs = decoder_steps(HFGenerate(target, None, HFGenerateParams(prompt_lookup_num_tokens=10)), prompt, T)
    ours_tokens, theirs_tokens = [t for s in ours for t in s.tokens][:T], [t for s in theirs for t in s.tokens][:T]
    if rule == "exact":
        assert ours_tokens == theirs_tokens
    else:
        reference = _greedy(target, prompt, T)
        assert_lossless(target, prompt, ours_tokens, reference, rule)
        assert_lossless(target, prompt, theirs_tokens, reference, rule)
    if repeats > 1:  # the prompt's last token occurs earlier: transformers proposes in its first verification
        assert theirs[0].drafted > 0
    assert all(s.accepted == len(s.tokens) - 1 <= s.drafted for s in theirs)


def test_rest_corpus_skip_leaves_out_the_prompt_documents():
    """`corpus: {skip: K}` with the suite's seed holds none of the documents K prompts of that seed come from, at an
    L_max below 16 too, and every document after the K-th usable one of the seeded order."""
    from dtbench.harness.data.selection import held_out_documents, seeded_order, select_prompts

    class Chars:
        def encode(self, text):
            return [ord(c) for c in text]

    rng = np.random.default_rng(0)
    docs = [
        (f"d{i}", "".join(chr(97 + int(x)) for x in rng.integers(0, 26, int(n))))
        for i, n in enumerate(rng.integers(5, 80, 30))
    ]  # some shorter than a prompt's 16 tokens
    by_text = {text: title for title, text in docs}
    for seed in (0, 3):
        order = [docs[i][0] for i in seeded_order(len(docs), seed)]
        for k in (1, 3, 7):
            kept = [by_text["".join(map(chr, ids))] for ids in held_out_documents(docs, Chars(), k, seed)]
            for l_max in (8, 32):
                used = {p.document for p in select_prompts(docs, Chars(), k, l_max, seed)}
                assert len(used) == k and not used & set(kept)
            assert kept == order[len(order) - len(kept) :] and len(kept) <= len(docs) - k


def test_suffix_fallback_catches_up_in_pieces_within_its_compiled_sizes():
    """Compiled execution: the fallback draft's backlog (the committed tokens of the steps the automaton drafted)
    is fed in pieces of at most k + 1 tokens, the sizes ``compiled_sizes`` declares for the draft (issue 59 item 6:
    the kit's B = 3 leg saw a 17+ token catch-up run bucket 32, compiled inside the sample). Eager: one forward."""
    from dtbench.decoders.chain import DraftModelProposer
    from dtbench.decoders.static_kv import StaticKV

    class Recording(DraftModelProposer):
        def forward(self, feed, exact):
            self.fed.append(len(feed))
            return torch.zeros(VOCAB)

    params = SuffixParams(k=3, fallback="draft")
    decoder = SuffixDecoding(torch.nn.Identity(), torch.nn.Identity(), params)
    proposer = decoder._fallback()
    assert proposer is not None and proposer.max_feed == params.k + 1
    for compiled, expected in ((True, [4, 4, 4, 4, 1, 1, 1]), (False, [17, 1, 1])):
        rec = Recording(torch.nn.Identity(), max_feed=proposer.max_feed)
        rec.sampling, rec.generator, rec.resident, rec.fed = None, None, False, []
        rec.cache = StaticKV.__new__(StaticKV) if compiled else object()
        if compiled:
            rec.cache.length = 40  # prefilled
        rec.backlog = list(range(17))
        rec.propose(3)
        assert rec.fed == expected
        largest = max(SuffixDecoding.verify_sizes(params))
        assert max(rec.fed) <= (largest if compiled else 17)
