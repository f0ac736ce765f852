"""The server decoder's parsing and rules without a server (issue 30): vLLM's /metrics and stream formats, SGLang's
meta_info (reproduced from their source, tests/fixtures/engines/README.md), llama.cpp's stream events (the shapes of
its tools/server/server-task.cpp), the output check's tie rule, seeded Poisson arrivals, the `concurrency:` key and
the plan's rules for server cells."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtbench.decoders.server import (
    ServerParams,
    metrics_delta,
    parse_chunk,
    parse_metrics,
    request_acceptance,
    request_body,
    top_body,
)
from dtbench.harness.errors import DtbenchError
from dtbench.harness.serving import _events, arrival_delays, check_output

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

FIX = Path(__file__).parent / "fixtures" / "engines"
PLAIN = {"launch": ["server-binary", "--port", "{port}"]}


def test_vllm_metrics_counters_and_delta():
    before = parse_metrics((FIX / "vllm_metrics_before.txt").read_text())
    after = parse_metrics((FIX / "vllm_metrics_after.txt").read_text())
    assert before == {"drafts": 120.0, "draft_tokens": 360.0, "accepted": 200.0, "accepted_per_pos": [90.0, 65.0, 45.0]}
    delta = metrics_delta(before, after)
    assert delta == {"drafts": 100.0, "draft_tokens": 300.0, "accepted": 180.0, "accepted_per_pos": [80.0, 60.0, 40.0]}
    assert sum(delta["accepted_per_pos"]) == delta["accepted"]  # vLLM's observe_draft invariant holds after parsing
    assert 1 + delta["accepted"] / delta["drafts"] == pytest.approx(2.8)  # vLLM's mean acceptance length


def test_metrics_without_spec_counters_and_bad_text():
    assert parse_metrics('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 1.0\n') == {}
    with pytest.raises(DtbenchError, match="not Prometheus text"):
        parse_metrics("this is { not prometheus")


def test_vllm_stream_token_ids_and_top_logprobs():
    chunks = [parse_chunk("vllm", json.loads(line)) for line in (FIX / "vllm_stream.jsonl").read_text().splitlines()]
    tokens = [t for c in chunks if c.tokens for t in c.tokens]
    assert tokens == [12366, 374, 279, 6864]
    assert chunks[1].top[1] == [(279, -0.3), (264, -1.5)]  # token_id:N keys become ids, best first
    assert chunks[2].finish == "length" and chunks[3].tokens is None


def test_sglang_meta_info_acceptance_length():
    event = json.loads((FIX / "sglang_generate.json").read_text())
    chunk = parse_chunk("sglang", event)
    acc = request_acceptance(chunk.counters, new_tokens=7)
    assert acc["steps"] == 3 and acc["acceptance_length"] == pytest.approx(7 / 3)  # SGLang's completion / verify_ct
    assert acc["source"].startswith("sglang")


def test_llama_cpp_events_ids_timings_and_derived_steps():
    partial = {
        "choices": [
            {
                "text": " a",
                "index": 0,
                "finish_reason": None,
                "logprobs": {
                    "content": [
                        {
                            "id": 253,
                            "token": " a",
                            "logprob": -0.1,
                            "top_logprobs": [
                                {"id": 253, "token": " a", "logprob": -0.1},
                                {"id": 9, "token": " b", "logprob": -2.5},
                            ],
                        }
                    ]
                },
            }
        ]
    }
    final = {
        "choices": [{"text": "", "index": 0, "finish_reason": "length"}],
        "timings": {"predicted_n": 32, "draft_n": 40, "draft_n_accepted": 20, "prompt_n": 10},
    }
    c = parse_chunk("llama.cpp", partial)
    assert c.tokens == [253] and c.top == [[(253, -0.1), (9, -2.5)]]
    verbose = {"choices": [{"text": "In", "index": 0, "finish_reason": None}], "__verbose": {"tokens": [788]}}
    assert parse_chunk("llama.cpp", verbose).tokens == [788]  # return_tokens + verbose, as llama-server streams it
    f = parse_chunk("llama.cpp", final)
    acc = request_acceptance(f.counters, new_tokens=32)
    assert (acc["drafted"], acc["accepted"], acc["steps"]) == (40, 20, 12)  # 32 tokens - 20 accepted = 12 steps
    assert acc["acceptance_length"] == pytest.approx(32 / 12) and acc["steps_rule"].startswith("derived")
    assert request_acceptance({"llama.cpp:predicted_n": 5.0}, 5) == {}  # no draft_n: the server did not speculate


def test_error_event_is_one_line():
    with pytest.raises(DtbenchError, match="answered with an error: context too long"):
        parse_chunk("llama.cpp", {"error": {"code": 400, "message": "context too long"}})


def test_sse_framing_split_across_reads():
    first, rest = _events(b'data: {"a": 1}\n\ndata: {"b"')
    assert first == [{"a": 1}] and rest == b'data: {"b"'
    second, rest = _events(rest + b": 2}\r\n\r\ndata: [DONE]\n\n")
    assert second == [{"b": 2}] and rest == b""


def test_request_body_per_engine():
    p = ServerParams(**PLAIN)
    body = request_body(p, [1, 2, 3], 16, stop_at_eos=False)
    assert body["prompt"] == [1, 2, 3] and body["temperature"] == 0.0 and body["stream"] is True
    assert body["ignore_eos"] is True and body["return_tokens"] and "n_probs" not in body and body["max_tokens"] == 16
    check = top_body(p, [1, 2, 3, 9], 2)
    assert check["n_probs"] == 2 and check["max_tokens"] == 1 and check["prompt"] == [1, 2, 3, 9]
    v = request_body(ServerParams(base_url="http://x:1", engine="vllm", model="m"), [1], 4, stop_at_eos=True)
    assert v["return_token_ids"] and v["ignore_eos"] is False and v["model"] == "m" and "logprobs" not in v
    vc = top_body(ServerParams(base_url="http://x:1", engine="vllm"), [1], 2)
    assert vc["logprobs"] == 2 and vc["return_tokens_as_token_ids"]


def test_params_need_one_source():
    with pytest.raises(ValueError, match="exactly one of base_url"):
        ServerParams()
    with pytest.raises(ValueError, match="exactly one of base_url"):
        ServerParams(base_url="http://127.0.0.1:1", launch=["x"])
    with pytest.raises(ValueError, match="http"):
        ServerParams(base_url="127.0.0.1:8000")


def test_output_check_tie_error_exact():
    p = ServerParams(**PLAIN)
    ref = [5, 6, 7, 8]
    ref_top = [[(5, -0.1), (1, -3.0)], [(6, -0.1), (2, -3.0)], [(7, -0.70), (9, -0.72)], [(8, -0.1), (3, -2.0)]]
    asked = []

    def top_at(i):
        asked.append(i)
        return ref_top[i], ref_top[i]  # the decode and prefill shapes agree: noise 0

    same = check_output(ref, ref, top_at, p, "tie_aware")
    assert same["lossless"] is True and same["lossless_checked"] == 4 and same["lossless_rule"].startswith("tie_aware")
    assert asked == []  # equal outputs: no check request
    tie = check_output([5, 6, 9, 1], ref, top_at, p, "tie_aware")  # 9 within 0.02 of 7 at position 2
    assert tie["lossless"] is True and tie["lossless_ties"] == 1 and tie["first_divergence"] == 2 and asked == [2]
    assert tie["lossless_tie_margin"] == pytest.approx(0.02) and tie["lossless_checked"] == 3
    err = check_output([5, 2, 7, 8], ref, top_at, p, "tie_aware")  # 2 is 2.9 below 6: not a tie
    assert err["lossless"] is False and err["lossless_first_error"] == 1 and err["lossless_error_margin"] > 2
    outside = check_output([5, 4, 7, 8], ref, top_at, p, "tie_aware")  # 4 is not among the reference's top 2
    assert outside["lossless"] is False and outside["lossless_error_margin"] is None
    exact = check_output([5, 6, 9, 1], ref, top_at, p, "exact")  # the suite's exact rule: no tie allowed
    assert exact["lossless"] is False and exact["lossless_rule"] == "exact"
    noisy = check_output(
        [5, 6, 9, 1], ref, lambda i: ([(7, -0.5), (9, -0.9)], [(7, -0.8), (9, -0.7)]), p, "tie_aware"
    )  # margin 0.4, but the two shapes disagree by 0.3 on 7 and 0.2 on 9: noise 0.3
    assert noisy["lossless"] is False and noisy["lossless_noise"] == pytest.approx(0.3)
    within = check_output(
        [5, 6, 9, 1], ref, lambda i: ([(7, -0.5), (9, -0.7)], [(7, -0.8), (9, -0.7)]), p, "tie_aware"
    )  # margin 0.2 <= noise 0.3: a tie
    assert within["lossless"] is True and within["lossless_ties"] == 1
    no_top = check_output([5, 6, 9, 1], ref, lambda i: (None, None), p, "tie_aware")  # no candidates: exact
    assert no_top["lossless"] is False and no_top["lossless_rule"].startswith("exact")
    assert check_output(ref, None, None, p, "tie_aware")["lossless"] is None  # a reference itself


def test_poisson_arrivals_seeded():
    a = arrival_delays(6, 4.0, seed=7)
    assert a == arrival_delays(6, 4.0, seed=7) and a != arrival_delays(6, 4.0, seed=8)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    assert arrival_delays(3, None, seed=7) == [0.0, 0.0, 0.0]


def _suite(extra: dict, decoders: list[dict]):
    from dtbench.harness.suites.suite import Suite

    return Suite.model_validate(
        {
            "name": "s",
            "datasets": [{"name": "wikitext-2", "prompts": 4, "warmup": 1}],
            "generation_lengths": [8],
            "decoders": decoders,
            **extra,
        }
    )


def test_concurrency_is_the_batch_size_axis():
    s = _suite({"concurrency": [1, 2]}, [{"name": "server", "params": PLAIN, "concurrency": [2]}])
    assert s.batch_sizes == [1, 2] and s.decoders[0].batch_sizes == [2]
    with pytest.raises(ValueError, match="one axis"):
        _suite({"concurrency": [1, 2], "batch_sizes": [1, 4]}, [{"name": "ar"}])


def test_plan_pairs_speculative_server_with_its_plain_server():
    from dtbench.harness.suites.plan import plan_suite

    plan = plan_suite(
        _suite(
            {"concurrency": [1, 2]},
            [
                {"name": "server", "label": "plain", "params": PLAIN},
                {"name": "server", "label": "spec", "params": {**PLAIN, "speculative": True, "reference": PLAIN}},
                {"name": "ar"},
            ],
        )
    )
    by = {c.label: c for c in plan.decoders}
    assert by["spec"].reference_label == "plain" and by["plain"].reference_label is None
    assert by["spec"].cls.requests and by["spec"].cls.family == "external" and not by["ar"].cls.requests
    assert {k.batch_size for k in by["spec"].points} == {1, 2}
    assert [c.label for c in plan.decoders].index("plain") < [c.label for c in plan.decoders].index("spec")


def test_single_turn_questions_batch_and_multi_turn_are_refused():
    from dtbench.harness.suites.grouping import slot_groups
    from dtbench.harness.suites.plan import plan_suite
    from dtbench.harness.suites.suite import Suite

    base = {"name": "s", "generation_lengths": [8], "concurrency": [1, 2], "decoders": [{"name": "ar"}]}
    ok = Suite.model_validate(
        {**base, "datasets": [{"name": "spec-bench", "categories": ["qa", "translation"], "prompts": 3, "warmup": 1}]}
    )
    plan_suite(ok)
    bad = Suite.model_validate({**base, "datasets": [{"name": "spec-bench", "prompts": 3, "warmup": 1}]})
    with pytest.raises(DtbenchError, match="multi-turn"):
        plan_suite(bad)
    assert slot_groups([True, False, False, True, False, False], 2) == [(0, 3), (1, 2), (4, 5)]


class _Answer:
    def __init__(self, tokens):
        self.status_code = 200
        self._data = {"choices": [{"text": "", "index": 0, "finish_reason": "length"}], "__verbose": {"tokens": tokens}}

    def json(self):
        return self._data


def _held_back_record():
    """A stream of 6 tokens whose ids at positions 1 and 4-5 were held back (llama.cpp: UTF-8 characters split
    over byte tokens): ids 10, _, 12, 13, _, _ streamed with the text "kmn" (the toy tokenizer below)."""
    from dtbench.harness.serving.client import RequestRecord

    return RequestRecord(row=0, tokens=[10, 12, 13], text="kmn", decoded=6, gaps=[(1, 2), (4, 6)])


def _detok(ids):  # a toy tokenizer: id i is the character chr(97 + i), ids from 20 up are held-back bytes (no text)
    return "".join(chr(97 + i) for i in ids if i < 20)


def test_held_back_ids_from_a_repeat(monkeypatch):
    """A repeat that agrees with every streamed id fills the held-back ones (``recovered`` "repeat")."""
    import httpx

    from dtbench.decoders.engines import engine_for
    from dtbench.harness.serving.record import recover_ids as _recover_ids

    sent = []
    monkeypatch.setattr(
        httpx,
        "post",
        lambda url, json, timeout, headers=None, verify=None: sent.append(json) or _Answer([10, 21, 12, 13, 22, 23]),
    )
    rec = _held_back_record()
    _recover_ids("http://x", {"prompt": [1, 2], "max_tokens": 6}, rec, engine_for("llama.cpp"), "s", "log", _detok)
    assert (rec.tokens, rec.recovered) == ([10, 21, 12, 13, 22, 23], "repeat")
    assert [b["stream"] for b in sent] == [False]


def test_held_back_ids_from_the_streamed_prefix_when_the_repeat_diverges(monkeypatch):
    """At concurrency > 1 the repeat (run alone) can take another path than the batched stream: it is refused (an id
    at a streamed position differs), and each gap is filled by a greedy request continuing the streamed output."""
    import httpx

    from dtbench.decoders.engines import engine_for
    from dtbench.harness.serving.record import recover_ids as _recover_ids

    sent = []

    def post(url, json, timeout, headers=None, verify=None):
        sent.append(json)
        if json["prompt"] == [1, 2]:  # the repeat: another path after position 2
            return _Answer([10, 21, 12, 14, 22, 23])
        return _Answer({3: [21], 6: [22, 23]}[len(json["prompt"])])

    monkeypatch.setattr(httpx, "post", post)
    rec = _held_back_record()
    _recover_ids("http://x", {"prompt": [1, 2], "max_tokens": 6}, rec, engine_for("llama.cpp"), "s", "log", _detok)
    assert (rec.tokens, rec.recovered) == ([10, 21, 12, 13, 22, 23], "prefix")
    assert [(b["prompt"], b["max_tokens"]) for b in sent[1:]] == [([1, 2, 10], 1), ([1, 2, 10, 21, 12, 13], 2)]


def test_held_back_ids_that_nothing_reproduces_fail_in_one_line(monkeypatch):
    import httpx

    from dtbench.decoders.engines import engine_for
    from dtbench.harness.serving import ServerError
    from dtbench.harness.serving.record import recover_ids as _recover_ids

    monkeypatch.setattr(
        httpx,
        "post",
        lambda url, json, timeout, headers=None, verify=None: _Answer([10, 1, 12, 14, 22, 23][: json["max_tokens"]]),
    )
    rec = _held_back_record()
    with pytest.raises(ServerError, match="streamed 3 token ids for 6 tokens and neither a repeat nor requests"):
        _recover_ids("http://x", {"prompt": [1, 2], "max_tokens": 6}, rec, engine_for("llama.cpp"), "s", "log", _detok)
    assert rec.recovered is None and rec.tokens == [10, 12, 13]


def _katakana_stream(tokenizer):
    """llama.cpp's events for " アア" in the embedded model's tokenizer: " " (one id), then each "ア" as two tokens
    (a 2-byte token held back, its last byte's event carrying one id), and the final event."""
    space, head, tail = tokenizer(" ア", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode([head]) != "ア" and tokenizer.decode([head, tail]) == "ア"  # head ends inside "ア"

    def event(text, ids, decoded, finish=None):
        verbose = {"tokens": ids, "tokens_predicted": decoded}
        return {"choices": [{"text": text, "index": 0, "finish_reason": finish}], "__verbose": verbose}

    final = {"choices": [{"text": "", "index": 0, "finish_reason": "length"}], "usage": {"completion_tokens": 5}}
    events = [event(" ", [space], 1), event("ア", [tail], 3), event("ア", [tail], 5), final]
    return events, [space, head, tail, head, tail]


def test_a_stream_records_each_gap_with_the_text_of_the_event_that_ended_it():
    """_read_stream against a served llama.cpp-shaped stream (httpx's MockTransport): gaps and their events."""
    import asyncio

    import httpx

    from dtbench.decoders.engines import engine_for
    from dtbench.harness.models.loading import load_tokenizer
    from dtbench.harness.serving.client import RequestRecord, _read_stream
    from dtbench.harness.suites.suite import ModelSpec

    tokenizer = load_tokenizer(ModelSpec())
    events, ids = _katakana_stream(tokenizer)
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
    rec = RequestRecord(row=0)

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            params = ServerParams(engine="llama.cpp", base_url="http://x")
            await _read_stream(client, "http://x/v1/completions", {}, params, engine_for("llama.cpp"), rec, 0.0)

    asyncio.run(go())
    assert rec.decoded == 5 and rec.tokens == [ids[0], ids[2], ids[4]] and rec.text == " アア"
    assert rec.gaps == [(1, 2), (3, 4)] and rec.gap_events == [("ア", [ids[2]]), ("ア", [ids[4]])]


def test_held_back_ids_from_the_streamed_text_when_repeat_and_prefix_diverge(monkeypatch):
    """A near tie at concurrency > 1: the repeat and the greedy gap requests (run alone) answer other ids, but each
    gap's bytes (its event's text less the event's own id) are one token of the vocabulary in one way only: the
    ids are taken from the text ("text"), no gap request is sent; without the vocabulary the gap requests decide, and
    their ids do not reproduce the text: the one-line error."""
    import httpx

    from dtbench.decoders.engines import engine_for
    from dtbench.harness.models.loading import load_tokenizer
    from dtbench.harness.serving import ServerError
    from dtbench.harness.serving.client import RequestRecord
    from dtbench.harness.serving.record import TokenBytes, recover_ids
    from dtbench.harness.suites.suite import ModelSpec

    tokenizer = load_tokenizer(ModelSpec())
    events, ids = _katakana_stream(tokenizer)
    sent = []
    monkeypatch.setattr(
        httpx,
        "post",
        lambda url, json, timeout, headers=None, verify=None: sent.append(json) or _Answer([7] * json["max_tokens"]),
    )

    def detok(t):
        return str(tokenizer.decode(t, clean_up_tokenization_spaces=False))

    def record(gaps):
        evs = [("ア", [ids[2]]), ("ア", [ids[4]])]
        return RequestRecord(row=0, tokens=[ids[0], ids[2], ids[4]], text=" アア", decoded=5, gaps=gaps, gap_events=evs)

    rec = record([(1, 2), (3, 4)])
    recover_ids(
        "http://x",
        {"prompt": [1, 2], "max_tokens": 5},
        rec,
        engine_for("llama.cpp"),
        "s",
        "log",
        detok,
        TokenBytes(tokenizer),
    )
    assert (rec.tokens, rec.recovered) == (ids, "text")
    assert len(sent) == 1  # the repeat only
    rec = record([(1, 2), (3, 4)])
    with pytest.raises(ServerError, match="neither a repeat nor requests"):  # without the vocabulary: the requests
        recover_ids("http://x", {"prompt": [1, 2], "max_tokens": 5}, rec, engine_for("llama.cpp"), "s", "log", detok)
