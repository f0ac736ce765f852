"""Learned drafting heads (issue 23): Medusa-1 and EAGLE-1/2/3 loaded from files in their published formats, the
EAGLE-2 dynamic tree checked against sequential head forwards, greedy equivalence with AR (hypothesis, parametrized
over the device as ``models.DEVICES``: on CUDA, skipped without one, float32 token for token and float16 under the
tie-aware rule), an oracle that makes random heads accept, and the one-line errors (sizes that do not fit,
sampling)."""

from __future__ import annotations

import json

import pytest
import torch
from heads_kit import Oracle, deep_llama
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import invoke, one_line_error
from models import DEVICES, assert_lossless, examples, on_device, run_decoder

from dtbench.decoders import kv
from dtbench.decoders.ar import Autoregressive
from dtbench.decoders.eagle import Eagle, EagleDrafter, EagleParams
from dtbench.decoders.eagle_head import load_eagle
from dtbench.decoders.medusa import MC_SIM_7B_63, Medusa, MedusaDrafter, MedusaParams, static_tree
from dtbench.decoders.medusa_head import load_medusa
from dtbench.decoders.tree import speculate_tree
from dtbench.decoders.tree.structure import TokenTree
from dtbench.testing.fixtures import SHARP, VOCAB, tiny_llama, tiny_neox, write_eagle, write_medusa

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = list(range(3, 20))
HIDDEN = 32
SLOW = settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _target(version: int):
    return deep_llama(3) if version == 3 else tiny_llama(0, sharpness=SHARP)


TARGETS = {1: _target(1), 3: _target(3)}
NEOX = tiny_neox(0, sharpness=SHARP)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """Head folders in the published formats, one per layout (written once)."""
    root = tmp_path_factory.mktemp("heads")
    return {
        "medusa": write_medusa(root / "medusa", hidden=HIDDEN, vocab=VOCAB, heads=4),
        1: write_eagle(root / "eagle1", hidden=HIDDEN, vocab=VOCAB, version=1),
        "1st": write_eagle(root / "eagle1-st", hidden=HIDDEN, vocab=VOCAB, version=1, safetensors=True),
        3: write_eagle(root / "eagle3", hidden=HIDDEN, vocab=VOCAB, version=3, draft_vocab=40),
        "3full": write_eagle(root / "eagle3-full", hidden=HIDDEN, vocab=VOCAB, version=3, embedding=True),
    }


def _ar(target, prompt, T):
    return run_decoder(Autoregressive(target, None, Autoregressive.Params()), prompt, T)


# --- loading the published formats --------------------------------------------------------------------------


def test_loaders_read_the_published_files_into_the_reference_modules(heads):
    medusa = load_medusa(str(heads["medusa"]), TARGETS[1])
    assert len(medusa.heads) == 4 and medusa.heads[0][1].weight.shape == (VOCAB, HIDDEN)
    saved = torch.load(heads["medusa"] / "medusa_lm_head.pt", weights_only=True)
    assert set(medusa.heads.state_dict()) == set(saved)
    assert torch.equal(medusa.heads.state_dict()["2.0.linear.weight"], saved["2.0.linear.weight"].double())

    e1 = load_eagle(str(heads[1]), TARGETS[1])
    assert e1.version == 1 and e1.hidden_layers == (2,) and e1.fc.bias is not None
    assert not hasattr(e1.layer, "input_layernorm")  # EAGLE-1's decoder layer 0 has no input norm
    saved = torch.load(heads[1] / "pytorch_model.bin", weights_only=True)
    assert torch.equal(e1.layers[0].self_attn.q_proj.weight, saved["layers.0.self_attn.q_proj.weight"].double())
    assert load_eagle(str(heads["1st"]), TARGETS[1]).version == 1  # model.safetensors works for EAGLE-1/2 too

    e3 = load_eagle(str(heads[3]), TARGETS[3])
    L = TARGETS[3].config.num_hidden_layers
    assert e3.version == 3 and e3.hidden_layers == (2, L // 2, L - 3) and e3.lm_head.weight.shape[0] == 40
    from safetensors.torch import load_file

    saved = load_file(str(heads[3] / "model.safetensors"))
    draft_ids = torch.arange(40)
    assert torch.equal(e3.to_target(draft_ids), draft_ids + saved["d2t"])
    assert e3.t2d[e3.to_target(draft_ids)].all() and int(e3.t2d.sum()) == 40
    assert load_eagle(str(heads[3]), TARGETS[3]) is e3  # one load per (target, head): decoders are per prompt
    assert not hasattr(e3, "embed_tokens") and e3.embed(torch.tensor([5])).equal(
        TARGETS[3].get_input_embeddings()(torch.tensor([5]))
    )  # the target's embedding unless the head has one
    own = load_eagle(str(heads["3full"]), TARGETS[3])
    assert own.embed_tokens.weight.shape == (VOCAB, HIDDEN) and torch.equal(own.to_target(draft_ids), draft_ids)


def test_eagle3_loads_like_the_reference_strict_false(tmp_path):
    """cnets.Model is loaded with strict=False: an extra tensor is ignored, a missing one is an error; a
    ``target_hidden_size`` that is not the target's is a one-line error."""
    from safetensors.torch import load_file, save_file

    def variant(name, tensors, **config):
        folder = write_eagle(tmp_path / name, hidden=HIDDEN, vocab=VOCAB, version=3)
        if tensors is not None:
            save_file(tensors(load_file(str(folder / "model.safetensors"))), str(folder / "model.safetensors"))
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **config}))
        return str(folder)  # a folder per variant: heads are loaded once per (target, folder)

    assert load_eagle(variant("extra", lambda sd: {**sd, "extra.scale": torch.ones(2)}), TARGETS[3]).version == 3
    with pytest.raises(ValueError) as exc:
        load_eagle(variant("missing", lambda sd: {k: v for k, v in sd.items() if k != "norm.weight"}), TARGETS[3])
    _one_line(exc, "missing ['norm.weight']")
    with pytest.raises(ValueError) as exc:
        load_eagle(variant("wide", None, target_hidden_size=4096), TARGETS[3])
    _one_line(exc, "target_hidden_size 4096", "32")


def test_a_computed_rope_buffer_in_the_weights_is_ignored(tmp_path):
    """An EAGLE-1/2 head saved where RoPE's inv_freq was a persistent buffer (older transformers) loads; any other
    unexpected tensor is still a one-line error (EAGLE-1/2 layout is strict here)."""
    folder = write_eagle(tmp_path / "old", hidden=HIDDEN, vocab=VOCAB, version=1)
    sd = torch.load(folder / "pytorch_model.bin")
    torch.save({**sd, "layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}, folder / "pytorch_model.bin")
    assert load_eagle(str(folder), TARGETS[1]).version == 1
    other = write_eagle(tmp_path / "other", hidden=HIDDEN, vocab=VOCAB, version=1)
    torch.save({**sd, "layers.0.self_attn.extra.weight": torch.ones(4)}, other / "pytorch_model.bin")
    with pytest.raises(ValueError) as exc:
        load_eagle(str(other), TARGETS[1])
    _one_line(exc, "unexpected ['layers.0.self_attn.extra.weight']")


def test_the_version_comes_from_the_config_not_the_name(tmp_path):
    folder = write_eagle(tmp_path / "EAGLE3-LLaMA3.1-Instruct-8B", hidden=HIDDEN, vocab=VOCAB, version=1)
    assert load_eagle(str(folder), TARGETS[1]).version == 1
    folder = write_eagle(tmp_path / "EAGLE-Vicuna-7B-v1.3", hidden=HIDDEN, vocab=VOCAB, version=3)
    assert load_eagle(str(folder), TARGETS[3]).version == 3


def _one_line(exc: pytest.ExceptionInfo, *needles: str) -> None:
    text = str(exc.value)
    assert "\n" not in text, text
    for n in needles:
        assert n in text, text


@pytest.mark.parametrize(
    "what, write, needles",
    [
        ("eagle hidden", lambda f: write_eagle(f, hidden=64, vocab=VOCAB), ("hidden size 64", "hidden size 32")),
        ("eagle vocab", lambda f: write_eagle(f, hidden=HIDDEN, vocab=100), ("vocabulary size 100", "size 96")),
        ("eagle fc", lambda f: write_eagle(f, hidden=HIDDEN, vocab=VOCAB, fc_in=48), ("fc input size 48", "64")),
        ("medusa hidden", lambda f: write_medusa(f, hidden=64, vocab=VOCAB), ("hidden size 64", "hidden size 32")),
        ("medusa vocab", lambda f: write_medusa(f, hidden=HIDDEN, vocab=100), ("vocabulary size 100", "size 96")),
    ],
)
def test_a_head_that_does_not_fit_the_target_is_a_one_line_error_naming_both_sizes(tmp_path, what, write, needles):
    folder = write(tmp_path / "head")
    cls, params = (Medusa, MedusaParams) if what.startswith("medusa") else (Eagle, EagleParams)
    with pytest.raises(ValueError) as exc:
        cls(TARGETS[1], None, params(head=str(folder)))
    _one_line(exc, *needles)


def test_malformed_heads_are_one_line_errors(tmp_path, heads):
    with pytest.raises(ValueError) as exc:  # EAGLE-3 needs three distinct target layers
        load_eagle(str(heads[3]), TARGETS[1])
    _one_line(exc, "L >= 7", "has 2")
    folder = write_eagle(tmp_path / "three", hidden=HIDDEN, vocab=VOCAB, version=3)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "draft_vocab_size"}))
    with pytest.raises(ValueError) as exc:  # EAGLE-3 weights under an EAGLE-1/2 config
        load_eagle(str(folder), TARGETS[3])
    _one_line(exc, "layers.0.", "EAGLE-1/2")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError) as exc:
        load_eagle(str(tmp_path / "empty"), TARGETS[1])
    _one_line(exc, "holds none of config.json")
    folder = write_medusa(tmp_path / "m", hidden=HIDDEN, vocab=VOCAB)
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 4}))
    with pytest.raises(ValueError) as exc:
        load_medusa(str(folder), TARGETS[1])
    _one_line(exc, "lacks medusa_num_layers")


# --- the EAGLE-2 tree against sequential head forwards -------------------------------------------------------


@pytest.mark.parametrize("version, attn", [(1, "sdpa"), (3, "sdpa"), (1, "eager")])
def test_every_drafted_node_has_the_log_prob_of_a_sequential_head_pass(heads, version, attn):
    """The tree mask, positions and head cache of ``EagleDrafter.draft`` give each node exactly the log-probability
    the head computes when run sequentially (no cache reuse, no mask) along the node's path (with the target's
    attention implementation: a boolean mask for sdpa, an additive one for eager)."""
    target = TARGETS[version] if attn == "sdpa" else tiny_llama(0, attn=attn, sharpness=SHARP)
    head = load_eagle(str(heads[version]), target)
    drafter = EagleDrafter(head, top_k=3, depth=3, total_token=20)
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        _, logits, features = kv.prefill_features(target, ids, head.hidden_layers)
        pending = int(logits.argmax())
        drafter.feed_target(features, PROMPT[1:] + [pending])
        tree = TokenTree(pending, drafter.n_max, 64, target.device)
        drafter.draft(tree, pending, depth_cap=10)
        assert kv.cache_len(drafter.cache) == len(PROMPT)  # tree KV dropped, committed pairs kept
        to_draft = (
            {int(t): d for d, t in enumerate(head.to_target(torch.arange(head.lm_head.weight.shape[0])))}
            if version == 3
            else None
        )
        nodes = tree.nodes()
        assert len(nodes) == 20 and max(n.depth for n in nodes) >= 3  # a full budget, several levels deep
        for u, _node in enumerate(nodes[1:], start=1):
            path = []
            while u:
                path.append(u)
                u = nodes[u].parent
            path.reverse()
            cache = kv.new_cache()
            pairs = torch.tensor([PROMPT[1:] + [pending]])
            n = pairs.shape[1]
            hidden, logp = head(
                input_ids=pairs,
                features=features[None],
                position_ids=torch.arange(n)[None],
                ancestors=torch.ones(n, n, dtype=torch.bool).tril(),
                past_key_values=cache,
            )
            h, lp = hidden[:, -1:], logp[-1]
            for j, v in enumerate(path[:-1]):
                one = torch.ones(1, 1, dtype=torch.bool)
                h, lp = head(
                    input_ids=torch.tensor([[nodes[v].token]]),
                    features=h,
                    position_ids=torch.tensor([[n + j]]),
                    ancestors=one,
                    past_key_values=cache,
                )
                lp = lp[-1]
            tok = nodes[path[-1]].token
            want = lp[to_draft[tok] if to_draft else tok]
            # eager attention takes its softmax in float32 (transformers), sdpa stays in float64
            assert float(tree.logp[path[-1]]) == pytest.approx(float(want), abs=1e-4 if attn == "eager" else 1e-9)
        # the tree holds the best candidates: every node at least as probable as any unexpanded alternative of its
        # parent is not checked here; the best-first property is: scores never increase along a path
        cum = tree.cum_logp[: tree.size]
        assert all(cum[u] <= cum[nodes[u].parent] + 1e-12 for u in range(1, tree.size))


# --- greedy equivalence ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("on", DEVICES)
@SLOW
@given(
    version=st.sampled_from([1, 3, "3full"]),
    T=st.integers(1, 24),
    top_k=st.integers(1, 5),
    depth=st.integers(0, 4),
    total=st.integers(2, 30),
    strategy=st.sampled_from(["compact", "rebuild"]),
    prompt=st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=12),
)
def test_eagle_equals_ar(heads, on, version, T, top_k, depth, total, strategy, prompt):
    device, dtype, rule = on
    target = on_device(TARGETS[3 if version == "3full" else version], device, dtype)
    params = EagleParams(head=str(heads[version]), top_k=top_k, depth=depth, total_token=total, cache_strategy=strategy)
    assert_lossless(target, prompt, run_decoder(Eagle(target, None, params), prompt, T), _ar(target, prompt, T), rule)


@pytest.mark.parametrize("on", DEVICES)
@SLOW
@given(
    arch=st.sampled_from(["llama", "neox"]),
    T=st.integers(1, 24),
    n_heads=st.integers(1, 5),
    strategy=st.sampled_from(["compact", "rebuild"]),
    small=st.booleans(),
    prompt=st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=12),
)
def test_medusa_equals_ar(tmp_path_factory, on, arch, T, n_heads, strategy, small, prompt):
    device, dtype, rule = on
    target = on_device(TARGETS[1] if arch == "llama" else NEOX, device, dtype)
    folder = write_medusa(tmp_path_factory.mktemp("m"), hidden=HIDDEN, vocab=VOCAB, heads=n_heads)
    choices = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]] if small else "mc_sim_7b_63"
    params = MedusaParams(head=str(folder), choices=choices, cache_strategy=strategy)
    assert_lossless(target, prompt, run_decoder(Medusa(target, None, params), prompt, T), _ar(target, prompt, T), rule)


def test_medusa_static_tree_is_the_reference_mc_sim_7b_63():
    paths, parents = static_tree(MC_SIM_7B_63)
    assert len(paths) == 63 and max(len(p) for p in paths) == 4
    assert paths[:3] == [(0,), (1,), (2,)] and all(len(a) <= len(b) for a, b in zip(paths, paths[1:]))
    assert all(p == -1 or paths[p] == c[:-1] for c, p in zip(paths, parents))
    with pytest.raises(ValueError, match="lacks its parent"):
        static_tree([[0], [1, 0]])


# --- the oracle: acceptance and tree paths -------------------------------------------------------------------


def _with_oracle(target, drafter, T, last_child=False):
    greedy = _ar(target, PROMPT, T)
    oracle = Oracle(drafter, greedy, last_child=last_child)
    steps = list(speculate_tree(target, None, torch.tensor([PROMPT]), T, oracle, "compact", tree_root="pending"))
    tokens = [t for s in steps for t in s.tokens][:T]
    return tokens, greedy, steps[1:], oracle


@pytest.mark.parametrize("version", [1, 3])
def test_eagle_with_an_oracle_accepts_several_tokens_down_tree_paths(heads, version):
    target = TARGETS[version]
    drafter = EagleDrafter(load_eagle(str(heads[version]), target), top_k=4, depth=5, total_token=24)
    tokens, greedy, steps, oracle = _with_oracle(target, drafter, 40, last_child=True)
    assert tokens == greedy  # still lossless
    assert max(s.accepted for s in steps) >= 3 and sum(s.accepted >= 2 for s in steps) >= 3
    assert all(s.drafted > s.depth for s in steps if s.drafted)  # trees, not chains: some node has siblings
    # planted down a branch other than the most probable one, and accepted down it
    assert any(side and s.accepted >= planted >= 2 for (planted, side), s in zip(oracle.log, steps))
    assert sum(s.accepted for s in steps) >= oracle.planted - sum(1 for p, _ in oracle.log if p)


def test_medusa_with_an_oracle_accepts_several_tokens(heads):
    target = TARGETS[1]
    drafter = MedusaDrafter(load_medusa(str(heads["medusa"]), target), MC_SIM_7B_63, target.config.num_hidden_layers)
    tokens, greedy, steps, oracle = _with_oracle(target, drafter, 40, last_child=True)
    assert tokens == greedy
    assert max(s.accepted for s in steps) >= 3 and sum(s.accepted >= 2 for s in steps) >= 3
    assert any(side and s.accepted >= planted >= 2 for (planted, side), s in zip(oracle.log, steps))


def test_a_random_head_accepts_little_without_the_oracle(heads):
    """The oracle test is not vacuous: the same head without it rarely accepts more than one token."""
    target = TARGETS[1]
    steps = list(
        Eagle(target, None, EagleParams(head=str(heads[1]), top_k=4, depth=5, total_token=24)).generate(
            torch.tensor([PROMPT]), 40
        )
    )[1:]
    assert sum(s.accepted >= 2 for s in steps) < 3


# --- declared capabilities, sampling ------------------------------------------------------------------------


def test_verify_sizes_are_declared(heads):
    assert Eagle.verify_sizes(EagleParams(head="x", total_token=60)) == (0, 60)
    assert Medusa.verify_sizes(MedusaParams(head="x")) == (0, 64)
    steps = list(
        Eagle(TARGETS[1], None, EagleParams(head=str(heads[1]), top_k=4, depth=4, total_token=17)).generate(
            torch.tensor([PROMPT]), 12
        )
    )
    assert max(s.drafted for s in steps) + 1 == 17  # the declared size is what one verification feeds


@pytest.mark.parametrize("name", ["medusa"])  # eagle samples (issue 34): tests/test_sampling.py
def test_sampling_is_refused_in_one_line(tmp_path, name):
    """medusa samples only when its lossy typical acceptance is asked for by name."""
    (tmp_path / "s.yaml").write_text(f"""
name: sampled-heads
device: cpu
target: {{model: smollm2-135m}}
datasets: [{{name: wikitext-2, prompts: 3, L_max: 64}}]
generation_lengths: [8]
sampling: {{temperature: 0.7}}
decoders:
  - {{name: {name}, params: {{head: {tmp_path}}}}}
""")
    one_line_error(invoke("validate", str(tmp_path / "s.yaml")), "typical acceptance, which is lossy by design")


def test_eagle_sampling_is_not_refused(tmp_path):
    folder = write_eagle(tmp_path / "head", hidden=576, vocab=49152, version=1)
    (tmp_path / "s.yaml").write_text(f"""
name: sampled-eagle
device: cpu
target: {{model: smollm2-135m}}
datasets: [{{name: wikitext-2, prompts: 3, L_max: 64}}]
generation_lengths: [8]
sampling: {{temperature: 0.7}}
decoders:
  - {{name: eagle, params: {{head: {folder}}}}}
""")
    result = invoke("validate", str(tmp_path / "s.yaml"))
    assert result.exit_code == 0 and "does not support sampling" not in result.output, result.output


def test_calibration_covers_the_declared_verify_sizes():
    from dtbench.harness.calibration.calibrate import decoder_sizes
    from dtbench.harness.suites.plan import plan_suite
    from dtbench.harness.suites.suitefile import parse_suite

    suite = parse_suite("""
name: heads
device: cpu
target: {model: smollm2-135m}
datasets: [{name: wikitext-2, prompts: 3, L_max: 64}]
generation_lengths: [8]
decoders:
  - {name: eagle, params: {head: some/head, total_token: 37}}
  - {name: medusa, params: {head: some/medusa}}
""")
    assert decoder_sizes(plan_suite(suite)) == (1, 64)  # medusa: root + mc_sim_7b_63's 63 nodes
    assert decoder_sizes(plan_suite(suite.model_copy(update={"decoders": suite.decoders[:1]}))) == (1, 37)


@pytest.mark.slow
def test_a_run_with_a_head_that_does_not_fit_stops_in_one_line_before_any_sample(tmp_path, data_dir):
    write_eagle(tmp_path / "head", hidden=64, vocab=49152)  # the embedded SmolLM2 has hidden size 576
    (tmp_path / "s.yaml").write_text(f"""
name: misfit
device: cpu
target: {{model: smollm2-135m}}
datasets: [{{name: wikitext-2, prompts: 2, warmup: 1, L_max: 32}}]
generation_lengths: [4]
decoders:
  - {{name: eagle, label: E, params: {{head: {tmp_path / "head"}}}}}
""")
    result = invoke("run", str(tmp_path / "s.yaml"), "--db", str(tmp_path / "r.db"), "--data-dir", str(data_dir))
    one_line_error(result, "decoder 'E'", "hidden size 64", "hidden size 576")
    from sqlalchemy import create_engine, inspect, text

    engine = create_engine(f"sqlite:///{tmp_path / 'r.db'}")
    if "samples" in inspect(engine).get_table_names():
        with engine.connect() as c:
            assert c.execute(text("select count(*) from samples")).scalar() == 0


def test_the_cost_model_does_not_price_head_forwards_with_the_draft_models_curve(heads):
    from dtbench.harness.data.prompt import Prompt
    from dtbench.harness.measurement.measure import measure
    from dtbench.harness.measurement.observation import sample_row
    from dtbench.reports.pricing.costmodel import uses_draft_model
    from dtbench.reports.pricing.pricing import price_sample

    class Flat:  # every forward of either role costs 1 s
        def roles(self):
            return {"target", "draft"}

        def cost(self, role, n, past, flags):
            return 1.0

    decoder = Eagle(TARGETS[1], None, EagleParams(head=str(heads[1]), top_k=3, depth=2, total_token=8))
    m = measure(decoder, PROMPT, 8, torch.device("cpu"))
    stats = json.loads(json.dumps(sample_row(m, Prompt(0, "doc", tuple(PROMPT)), False, None)["step_stats"]))
    assert m.steps and sum(stats["draft_forwards"]) > 0  # the head's forwards are counted (and timed) as draft's
    assert stats["forward_s"]["draft"] > 0
    as_draft = price_sample(Flat(), stats)
    head = price_sample(Flat(), stats, draft_model=False)
    assert as_draft.draft_s == sum(stats["draft_forwards"]) and not as_draft.approx
    assert head.draft_s == 0.0 and head.approx and head.target_s == as_draft.target_s
    # the database says which cells ran the draft model: the runner records cells.draft_model only for those
    from types import SimpleNamespace

    assert not uses_draft_model(SimpleNamespace(draft_model=None))
    assert uses_draft_model(SimpleNamespace(draft_model="smollm2-135m (float32)"))


def test_eagle3_features_are_the_inputs_of_target_layers_2_mid_and_L_minus_3():
    """The loop's verify forward hands EAGLE-3 the inputs of layers 2, L // 2 and L - 3 (the reference's
    modeling_llama_kv.py collects hidden_states before those layers), EAGLE-1/2 the final-normed output."""
    target = TARGETS[3]
    L = target.config.num_hidden_layers
    seen = {}
    hooks = [
        target.model.layers[i].register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: seen.__setitem__(i, (args[0] if args else kwargs["hidden_states"])[0]),
            with_kwargs=True,
        )
        for i in (2, L // 2, L - 3)
    ]
    try:
        with torch.inference_mode():
            _, _, features = kv.prefill_features(target, torch.tensor([PROMPT]), (2, L // 2, L - 3))
    finally:
        for h in hooks:
            h.remove()
    assert torch.equal(features, torch.cat([seen[2], seen[L // 2], seen[L - 3]], dim=-1))
    with torch.inference_mode():
        _, _, last = kv.prefill_features(target, torch.tensor([PROMPT]), (L,))
        assert torch.allclose(last, target.model(input_ids=torch.tensor([PROMPT])).last_hidden_state[0])


def test_a_head_that_is_neither_a_folder_nor_reachable_on_the_hub_is_a_one_line_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError) as exc:
        Eagle(TARGETS[1], None, EagleParams(head="no-such-user/no-such-eagle-head"))
    _one_line(exc, "no-such-user/no-such-eagle-head", "could not be fetched from the hub", "config.json")


def test_the_recorded_node_budget_predicts_the_acceptance_of_smaller_trees(heads):
    """eagle records, per accepted token, how many best-scored drafted nodes its tree needed. Rerun with exactly
    the budget the run needed, the same oracle accepts the same tokens in every iteration; every accepted token is
    accounted for once; the cost model turns the record into a speedup per total_token."""
    from dtbench.reports.pricing.pricing import budget_speedups

    target = TARGETS[1]
    head = load_eagle(str(heads[1]), target)

    def run(total):
        drafter = EagleDrafter(head, top_k=4, depth=5, total_token=total)
        tokens, greedy, steps, _ = _with_oracle(target, drafter, 40)
        return steps, drafter.budget_stats()

    steps, stats = run(40)
    needing = {int(k.split("_")[3]): v for k, v in stats.items() if k.startswith("accepted_tokens_needing_")}
    assert sum(needing.values()) == sum(s.accepted for s in steps) > 0
    assert stats["drafting_iterations"] == sum(1 for s in steps if s.drafted) and stats["drafted_nodes"] == 39
    need = max(needing)
    assert 2 <= need < 39  # the oracle's planted chains sit among the best-scored nodes, not at the budget's end
    again, stats_again = run(need + 1)
    assert [s.accepted for s in again] == [s.accepted for s in steps]

    class Flat:  # AR token 1 s; verifying n tokens costs 1 + n / 10 s
        def cost(self, role, n, past, flags):
            return 1.0 if n == 1 else 1.0 + n / 10

    speed = budget_speedups(Flat(), [stats], head_s=0.5, past=0)
    assert sorted(speed) == list(range(2, 41))
    iters = stats["drafting_iterations"]
    within = sum(v for m, v in needing.items() if m <= 9)
    assert speed[10] == pytest.approx((1 + within / iters) / (0.5 + 2.0))


def test_a_calibrated_run_prices_eagle_and_predicts_its_best_total_token(tmp_path, data_dir, monkeypatch):
    """`calibrate: true` covers eagle's declared verify size; `report --cost-model` prices its target forwards,
    flags the head's as unpriced and names a predicted best total_token."""
    from kit import fast_calibration_settings, suite_dict, tiny_pair, write_suite

    import dtbench.cli.main  # noqa: F401  (imported before Settings is patched: its options read the defaults)
    from dtbench.harness.calibration import calibrate_run

    monkeypatch.setattr(calibrate_run, "Settings", fast_calibration_settings())
    target, draft = tiny_pair(tmp_path)
    cfg = json.loads((target / "config.json").read_text())
    head = write_eagle(tmp_path / "head", hidden=cfg["hidden_size"], vocab=cfg["vocab_size"])
    suite = suite_dict(
        target,
        draft,
        [
            {"name": "ar"},
            {"name": "eagle", "label": "E", "params": {"head": str(head), "top_k": 3, "depth": 2, "total_token": 9}},
        ],
        calibrate=True,
    )
    dbfile = tmp_path / "r.db"
    result = invoke(
        "run",
        write_suite(tmp_path, suite),
        "--db",
        str(dbfile),
        "--data-dir",
        str(data_dir),
        "--no-progress",
        "--no-report",
    )
    assert result.exit_code == 0, result.output
    result = invoke("report", "--db", str(dbfile), "--cost-model", "--format", "json")
    assert result.exit_code == 0, result.output
    cell = {c["label"]: c for c in json.loads(result.output)["cells"]}["E"]
    assert cell["predicted_s"] > 0 and cell["target_s"] > 0 and cell["draft_s"] == 0 and cell["approx"]
    assert 2 <= cell["predicted_best_total_token"] <= 9 and cell["predicted_best_total_token_speedup"] > 0
    result = invoke("report", "--db", str(dbfile), "--cost-model", "--format", "markdown")
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if line.startswith("| wikitext-2") and "| E |" in line)
    assert "Best config (pred.)" in result.output and f"total_token={cell['predicted_best_total_token']} (" in row
