"""The conformance kit for a served engine (issue 66): ``dtbench check --server URL --reference URL``.

People who deploy speculative decoding find its correctness bugs by hand (vLLM issue #41758: n-gram speculation
changed greedy output on the prompt ``"serving" * 48``; #11466 asks whether speculation preserves the target's output
at all; PR #7962: log-probabilities are not stable across batch sizes, so a divergence can be a numeric tie or a bug).
This module runs the kit's idea against an engine over HTTP: named checks, a hypothesis search over prompts
(:func:`dtbench.harness.conformance.search`, the same search as the decoder kit's, here with shrinking inside a time
budget), and a counterexample ready to file: both requests as ``curl`` commands (the key masked), the prompt's
SHA-256, the first differing position, both tokens and their text, the reference's margin and the measured noise,
and the engine's version and model as the server reports them.

The checks (:data:`SERVER_CHECKS`, in the order they run), each over prompts drawn from :class:`PromptSpace` (the
dataset's text, random token sequences, an n-gram or a word repeated: the shape n-gram and suffix drafting feed on,
and prompts near the context length):

- ``deterministic``: the same request twice gives the same tokens (exact).
- ``greedy_equals_reference`` (needs ``--reference``): T = 0 output equal to the reference engine's (the same engine
  without speculation), with and without stopping at EOS; tie-aware by the run's one rule
  (:func:`dtbench.harness.serving.check.check_request`: the reference's top-2 margin at the divergence against
  ``tie_margin`` and the noise between its decode and prefill shapes).
- ``concurrency``: each of C prompts sent together equals the same prompt sent alone, tie-aware by the same rule
  with the engine's own candidates (batch variance is a tie, reported with its margin, not a failure).
- ``length``: exactly ``max_tokens`` tokens unless it stopped at EOS as asked (then ``finish_reason`` ``stop``), and
  no token after the first EOS.
- ``stop``: with a stop string (a piece of the output's own text), the text ends before its first occurrence and is
  the unstopped text up to there: nothing after a stop.
- ``streaming``: a streamed and a non-streamed request give the same tokens.
- ``accounting``: where the engine reports speculation counters (per response, or its metrics endpoint), accepted <=
  drafted, steps >= 1 and the acceptance length equal to tokens / steps (n/a where it reports none).

A check's verdict is one of the decoder kit's (:class:`~dtbench.harness.conformance_checks.Outcome`): passed (its
ties listed), failed (the counterexample), n/a (why), skipped (the budget was spent, or the server died before it).
"""

from __future__ import annotations

import hashlib
import json
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dtbench.core import DtbenchError, clip, redact_credentials
from dtbench.decoders.engines import Engine, engine_for
from dtbench.harness.conformance import CheckFailed, NotApplicable, search
from dtbench.harness.conformance_checks import Outcome
from dtbench.harness.serving.check import candidate_shapes, check_request
from dtbench.harness.serving.params import ServerParams, auth_headers

SERVER_CHECKS = (
    "deterministic",
    "greedy_equals_reference",
    "concurrency",
    "length",
    "stop",
    "streaming",
    "accounting",
)
EXAMPLES = {  # hypothesis examples per check by default (each example is one to C + 1 requests)
    "deterministic": 8,
    "greedy_equals_reference": 100,
    "concurrency": 8,
    "length": 10,
    "stop": 8,
    "streaming": 8,
    "accounting": 10,
}
DEFAULT_BUDGET_S = 600.0  # the whole search, shrinking included
DEFAULT_REQUEST_TIMEOUT_S = 60.0
PRECISION = "served"  # the table's column suffix: the engine's own precision, whatever it is


class ServerDown(DtbenchError):
    """The engine (or the reference) cannot be asked any more: unreachable, exited, or a request past its timeout.
    Every check from then on fails with this one line."""


# --- requests -----------------------------------------------------------------------------------------------------------


@dataclass
class Answer:
    """One completion as the client read it: ``tokens`` (ids), ``text``, ``finish`` (finish_reason), ``counters``
    (the engine's per-response counters), ``error`` (one line; None: it succeeded)."""

    tokens: list[int]
    text: str = ""
    finish: str | None = None
    counters: dict[str, float] = field(default_factory=dict)
    error: str | None = None


class Endpoint:
    """A served engine the kit asks: a label (what the table and errors call it), its :class:`ServerParams` (the
    engine adapter, the key's variable, ``tie_margin``), its base URL (as given: credentials are sent, never shown)
    and, when dtbench launched it, the :class:`~dtbench.harness.serving.process.Launched` process.

    Requests are the run's: :func:`dtbench.harness.serving.client.send_requests` streams them (the engine adapter
    writes and reads each one); a non-streamed one goes through ``httpx`` with the adapter's body, ``stream`` false.
    Answers to requests sent alone are cached by body (hypothesis replays an example while it shrinks)."""

    def __init__(self, label: str, params: ServerParams, base_url: str, server: Any = None, tokenizer: Any = None):
        from dtbench.harness.serving.record import token_bytes_of

        self.label, self.params, self.server = label, params, server
        self.base_url = base_url.rstrip("/")
        self.shown_url = redact_credentials(self.base_url)
        self.engine: Engine = engine_for(params.engine)
        self.where = f"see its log {server.log_path}" if server is not None else f"at {self.shown_url}"
        self.tokenizer = tokenizer
        self.token_bytes = token_bytes_of(tokenizer) if tokenizer is not None else None
        self.down: str | None = None  # why it cannot be asked any more
        self.cache: dict[str, Answer] = {}
        self.answers: list[Answer] = []  # every answer read (the accounting check's material)
        self.sent = 0

    def body(self, prompt: list[int], T: int, stop_at_eos: bool, stop: list[str] | None = None) -> dict[str, Any]:
        """The adapter's streamed request body (greedy, ``max_tokens`` T), with ``stop`` strings when given."""
        body = self.engine.request_body(self.params, list(prompt), T, stop_at_eos)
        if stop:
            body["stop"] = list(stop)
        return body

    def _fail(self, what: str) -> ServerDown:
        code = self.server.exited() if self.server is not None else None
        if code is not None:
            what = f"exited with code {code}"
        self.down = f"server '{self.label}' {what}; {self.where}"
        return ServerDown(self.down)

    def send(self, bodies: list[dict[str, Any]], concurrency: int = 1) -> list[Answer]:
        """The bodies as streamed requests, ``concurrency`` in flight (one client: the run's own), in order.

        Raises:
            ServerDown: the server is unreachable or exited, or a request ran past the request timeout.
        """
        from dtbench.harness.serving.client import send_requests

        if self.down:
            raise ServerDown(self.down)
        self.sent += len(bodies)
        try:
            records = send_requests(self.base_url, bodies, self.params, concurrency, self.tokenize, self.engine)
        except (DtbenchError, OSError, Exception) as exc:  # unreachable (ConnectError), an error event, ...
            raise self._fail(f"is unreachable: {clip(exc, 200)}") from None
        out = []
        for rec, body in zip(records, bodies):
            if rec.error is not None and ("no answer from" in rec.error or "Timeout" in rec.error):
                raise self._fail(f"did not answer in time: {rec.error}")
            if rec.error is None and rec.decoded and len(rec.tokens) < rec.decoded:
                self._recover(body, rec)  # ids llama.cpp held back inside a UTF-8 character: the run's recovery
            out.append(Answer(list(rec.tokens), rec.text, rec.finish, dict(rec.counters), rec.error))
        if self.server is not None and self.server.exited() is not None:
            raise self._fail("exited")
        self.answers.extend(a for a in out if a.error is None)
        return out

    def tokenize(self, text: str) -> list[int]:
        """Text as the tokenizer's ids ([] without a tokenizer): a text-only engine's output."""
        if self.tokenizer is None:
            return []
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def detokenize(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else str(self.tokenizer.decode(ids, clean_up_tokenization_spaces=False))

    def _recover(self, body: dict[str, Any], rec: Any) -> None:
        """A stream's held-back token ids, as a run recovers them (:func:`~dtbench.harness.serving.record.
        recover_ids`); when they cannot be told, the answer is a failed request saying so, never a divergence."""
        from dtbench.harness.serving.record import recover_ids

        try:
            recover_ids(self.base_url, body, rec, self.engine, self.label, self.where, self.detokenize,
                        self.token_bytes, auth_headers(self.params))  # fmt: skip
        except DtbenchError as exc:
            rec.error = f"its stream held back token ids that could not be recovered: {clip(exc, 200)}"

    def once(self, body: dict[str, Any]) -> Answer:
        """One streamed request sent alone (cached by its body)."""
        key = json.dumps(body, sort_keys=True)
        if key not in self.cache:
            self.cache[key] = self.send([body])[0]
        return self.cache[key]

    def unstreamed(self, body: dict[str, Any]) -> Answer:
        """The same request, not streamed (``stream`` false, no ``stream_options``).

        Raises:
            ServerDown: as :meth:`send`.
        """
        import httpx

        if self.down:
            raise ServerDown(self.down)
        plain = {k: v for k, v in body.items() if k != "stream_options"}
        plain["stream"] = False
        self.sent += 1
        try:
            response = httpx.post(
                self.base_url + "/v1/completions",
                json=plain,
                timeout=self.params.request_timeout_s,
                headers=auth_headers(self.params),
            )
        except httpx.TimeoutException:
            raise self._fail(
                f"did not answer in time: no answer from /v1/completions within {self.params.request_timeout_s:g} s"
            ) from None
        except httpx.HTTPError as exc:
            raise self._fail(f"is unreachable: {clip(exc, 200)}") from None
        if response.status_code != 200:
            return Answer([], error=f"HTTP {response.status_code}: {clip(response.text, 200)}")
        try:
            chunk = self.engine.parse_event(response.json())
        except (ValueError, DtbenchError) as exc:
            return Answer([], error=f"HTTP 200 but the body is no completion: {clip(exc, 200)}")
        tokens = list(chunk.tokens) if chunk.tokens is not None else self.tokenize(chunk.text)
        return Answer(tokens, chunk.text, chunk.finish, dict(chunk.counters))

    def candidates(self, prompt: list[int], reference: list[int], i: int) -> Any:
        """This engine's top candidates at output position i of ``reference`` in its decode and prefill shapes
        (:func:`~dtbench.harness.serving.check.candidate_shapes`).

        Raises:
            ServerDown: the check requests failed.
        """
        if self.down:
            raise ServerDown(self.down)
        try:
            return candidate_shapes(
                self.base_url, self.params, list(prompt), list(reference), i, max(self.params.top_logprobs, 5)
            )
        except (DtbenchError, OSError, Exception) as exc:
            raise self._fail(f"failed a check request (top candidates): {clip(exc, 200)}") from None

    def curl(self, body: dict[str, Any]) -> str:
        """The request as a ``curl`` command a user can paste: the URL with credentials masked, the key as its
        environment variable (``$NAME``), never its value."""
        parts = ["curl", "-sS", f"{self.shown_url}/v1/completions", "-H", "Content-Type: application/json"]
        cmd = " ".join(shlex.quote(p) for p in parts)
        if self.params.api_key_env:
            cmd += f' -H "Authorization: Bearer ${self.params.api_key_env}"'
        return cmd + " -d " + shlex.quote(json.dumps(body, separators=(",", ":")))

    def identity(self) -> dict[str, Any]:
        """The engine's version and model as the server reports them (each asked with a 5 s limit, best effort):
        ``/version`` (vLLM, SGLang's ``version``), ``/props`` (llama.cpp: ``build_info``, ``model_path``, the slot's
        ``n_ctx``) and ``/v1/models`` (the served model's id, vLLM's ``max_model_len``)."""
        import httpx

        out: dict[str, Any] = {"label": self.label, "engine": self.params.engine, "url": self.shown_url}
        if self.down:
            return out
        headers = auth_headers(self.params)

        def get(path: str) -> Any:
            try:
                answer = httpx.get(self.base_url + path, timeout=5.0, headers=headers)
                return answer.json() if answer.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None

        version = get("/version")
        if isinstance(version, dict) and version.get("version"):
            out["version"] = str(version["version"])
        props = get("/props")
        if isinstance(props, dict):
            if props.get("build_info"):
                out.setdefault("version", str(props["build_info"]))
            if props.get("model_path"):
                out["model"] = str(props["model_path"])
            settings = props.get("default_generation_settings")
            if isinstance(settings, dict) and isinstance(settings.get("n_ctx"), int):
                out["n_ctx"] = settings["n_ctx"]
        models = get("/v1/models")
        if isinstance(models, dict) and isinstance(models.get("data"), list) and models["data"]:
            first = models["data"][0] if isinstance(models["data"][0], dict) else {}
            out.setdefault("model", str(first.get("id", "")) or None)
            if isinstance(first.get("max_model_len"), int):
                out.setdefault("n_ctx", first["max_model_len"])
        return out


# --- prompts ------------------------------------------------------------------------------------------------------------


def prompt_sha256(prompt: list[int] | str) -> str:
    """The SHA-256 (hex) of a prompt as sent: the UTF-8 of its text, or of its token ids as compact JSON
    (``[1,2,3]``)."""
    data = prompt if isinstance(prompt, str) else json.dumps(list(prompt), separators=(",", ":"))
    return hashlib.sha256(data.encode()).hexdigest()


class PromptSpace:
    """The prompts the kit searches (hypothesis strategies of token-id lists), from the target's tokenizer and the
    dataset's documents: *text* (a slice of a document), *random* (ids of ordinary tokens), *ngram* (an n-gram of 1-4
    tokens repeated 2-48 times), *word* (a word of the text repeated 2-48 times, as ``"serving" * 48``) and, when the
    context length is known, *near context* (a prompt leaving 0-7 tokens of the context after T). Hypothesis shrinks
    each kind toward shorter prompts (fewer repeats, a shorter slice, fewer ids)."""

    def __init__(self, tokenizer: Any, documents: list[str], n_ctx: int | None, max_T: int):
        self.tokenizer = tokenizer
        self.vocab = len(tokenizer)
        self.special = set(getattr(tokenizer, "all_special_ids", None) or [])
        self.docs = [self.encode(d)[:4096] for d in documents[:32]]
        self.docs = [d for d in self.docs if len(d) >= 8]
        words: list[str] = []
        for d in documents[:32]:
            words.extend(w for w in d.split() if w.isalpha() and len(w) >= 4)
        self.words = sorted(set(words))[:400] or ["serving"]
        self.n_ctx, self.max_T = n_ctx, max_T

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def text_of(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(list(ids), clean_up_tokenization_spaces=False))

    def ordinary(self) -> Any:
        from hypothesis import strategies as st

        return st.integers(0, self.vocab - 1).filter(lambda t: t not in self.special)

    def kinds(self, near_context: bool = False) -> dict[str, Any]:
        """The strategies by kind (each draws a list of token ids)."""
        from hypothesis import strategies as st

        out: dict[str, Any] = {}
        if self.docs:
            docs = self.docs
            out["text"] = st.tuples(st.integers(0, len(docs) - 1), st.integers(0, 4096), st.integers(1, 64)).map(
                lambda a: docs[a[0]][a[1] % len(docs[a[0]]) :][: a[2]] or docs[a[0]][: a[2]]
            )
        out["ngram"] = st.tuples(st.lists(self.ordinary(), min_size=1, max_size=4), st.integers(2, 48)).map(
            lambda a: a[0] * a[1]
        )
        words = self.words
        out["word"] = st.tuples(st.sampled_from(words), st.integers(2, 48), st.sampled_from(["", " "])).map(
            lambda a: self.encode(a[2].join([a[0]] * a[1])) or [0]
        )
        out["random"] = st.lists(self.ordinary(), min_size=1, max_size=48)
        if near_context and self.n_ctx and self.docs and self.n_ctx - self.max_T - 8 >= 16:
            flat = [t for d in self.docs for t in d]
            length = self.n_ctx - self.max_T - 8

            def near(extra: int) -> list[int]:
                return (flat * (length // len(flat) + 1))[: length + extra]

            out["near context"] = st.integers(0, 7).map(near)
        return out

    def prompts(self, near_context: bool = False) -> Any:
        """One strategy over every kind (hypothesis shrinks toward the first kinds: text, then the repeats)."""
        from hypothesis import strategies as st

        kinds = self.kinds(near_context)
        near = kinds.pop("near context", None)
        common = st.one_of(*kinds.values())
        if near is None:
            return common
        # one example in ten near the context length (a long prefill on both engines: seconds on a CPU server);
        # the shrinker moves toward 0, away from it, unless only such a prompt fails
        return st.integers(0, 9).flatmap(lambda k: near if k == 9 else common)


# --- the checks ---------------------------------------------------------------------------------------------------------


@dataclass
class Session:
    """What every check of one engine shares: the engine, the reference (None: the greedy check is n/a), the prompt
    space, the budget's deadline (``time.monotonic``), max T, the concurrency C, the EOS ids, examples per check
    (``examples``: None, each check's own) and the ties each check saw."""

    engine: Endpoint
    reference: Endpoint | None
    space: PromptSpace
    deadline: float
    max_T: int = 32
    concurrency: int = 4
    eos: frozenset[int] = frozenset()
    examples: int | None = None
    shrink: bool = True
    ties: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def n(self, check: str) -> int:
        return self.examples if self.examples is not None else EXAMPLES[check]

    def token(self, t: int | None) -> dict[str, Any] | None:
        return None if t is None else {"id": t, "text": self.space.text_of([t])}


def _prompt_fields(s: Session, prompt: list[int]) -> dict[str, Any]:
    return {
        "prompt_sha256": prompt_sha256(prompt),
        "prompt_tokens": len(prompt),
        "prompt": list(prompt),
        "prompt_text": s.space.text_of(prompt),
    }


def _divergence(s: Session, check: str, prompt: list[int], got: Answer, want: Answer, result: dict[str, Any],
                bodies: tuple[dict[str, Any], dict[str, Any]], against: Endpoint, extra: dict[str, Any]) -> dict:  # fmt: skip
    """The counterexample of a divergence ``result`` (:func:`check_request`'s columns) between the engine's answer
    ``got`` and ``want`` (the reference's, or the engine's own in another shape), ready to file."""
    diag = (result.get("lossless_diagnoses") or [{}])[0]
    pos = result.get("first_divergence")
    a = want.tokens[pos] if pos is not None and pos < len(want.tokens) else None
    b = got.tokens[pos] if pos is not None and pos < len(got.tokens) else None
    return {
        "check": check,
        **_prompt_fields(s, prompt),
        **extra,
        "position": pos,
        "engine_token": s.token(b),
        "reference_token": s.token(a),
        "margin": diag.get("margin"),
        "noise": diag.get("noise"),
        "tie_margin": s.engine.params.tie_margin,
        "rule": result.get("lossless_rule"),
        "curl": {"engine": s.engine.curl(bodies[0]), "reference": against.curl(bodies[1])},
    }


def _judge(s: Session, check: str, prompt: list[int], got: Answer, want: Answer, against: Endpoint,
           bodies: tuple[dict[str, Any], dict[str, Any]], extra: dict[str, Any], what: str) -> None:  # fmt: skip
    """Compare ``got`` with ``want`` by the run's tie rule (candidates asked of ``against`` at a divergence): a tie is
    recorded in ``s.ties``; an error raises :class:`CheckFailed` with the counterexample."""
    if got.error or want.error:
        failed = got.error or want.error
        raise CheckFailed(f"a request failed: {failed}", {"check": check, **_prompt_fields(s, prompt), **extra})
    if got.tokens == want.tokens:
        return
    ids = list(prompt)
    result = check_request(
        got.tokens, want.tokens, lambda i: against.candidates(ids, want.tokens, i), s.engine.params, "tie_aware"
    )
    example = _divergence(s, check, prompt, got, want, result, bodies, against, extra)
    if result["lossless"]:
        seen = s.ties.setdefault(check, [])
        key = (example["prompt_sha256"], extra.get("T"), example["position"])
        if all((t["prompt_sha256"], t.get("T"), t["position"]) != key for t in seen):
            seen.append(example)
        return
    pos, a, b = example["position"], example["reference_token"], example["engine_token"]
    margin = example["margin"]
    shown = f"margin {margin:.3g} nats" if isinstance(margin, float) else "no margin (a token not among the top)"
    raise CheckFailed(
        f"{what} at output position {pos}: {b and b['id']} instead of {a and a['id']} ({shown}, noise "
        f"{example['noise'] or 0:.3g}; {len(prompt)}-token prompt)",
        example,
    )


def _greedy(s: Session) -> dict[str, Any]:
    from hypothesis import strategies as st

    if s.reference is None:
        raise NotApplicable("no reference engine (--reference URL, or a suite entry's reference:)")
    ref = s.reference

    def body(prompt: list[int], T: int, stop_at_eos: bool) -> None:
        mine, theirs = s.engine.body(prompt, T, stop_at_eos), ref.body(prompt, T, stop_at_eos)
        got, want = s.engine.once(mine), ref.once(theirs)
        extra = {"T": T, "stop_at_eos": stop_at_eos}
        _judge(
            s, "greedy_equals_reference", prompt, got, want, ref, (mine, theirs), extra, "differs from the reference"
        )

    space = {"prompt": s.space.prompts(near_context=True), "T": st.integers(1, s.max_T), "stop_at_eos": st.booleans()}
    return _search(s, "greedy_equals_reference", space, body)


def _deterministic(s: Session) -> dict[str, Any]:
    from hypothesis import strategies as st

    def body(prompt: list[int], T: int) -> None:
        request = s.engine.body(prompt, T, False)
        first, second = s.engine.send([request])[0], s.engine.send([request])[0]
        if first.error or second.error or first.tokens != second.tokens:
            example = {"check": "deterministic", **_prompt_fields(s, prompt), "T": T, "curl": s.engine.curl(request)}
            if first.error or second.error:
                raise CheckFailed(f"a request failed: {first.error or second.error}", example)
            i = next(i for i in range(max(len(first.tokens), len(second.tokens))) if first.tokens[i:i + 1] != second.tokens[i:i + 1])  # fmt: skip
            example.update(position=i, first=first.tokens[i : i + 1], second=second.tokens[i : i + 1])
            raise CheckFailed(f"the same request twice differs at output position {i}", example)

    return _search(s, "deterministic", {"prompt": s.space.prompts(), "T": st.integers(1, s.max_T)}, body)


def _concurrency(s: Session) -> dict[str, Any]:
    from hypothesis import strategies as st

    C = s.concurrency
    if C < 2:
        raise NotApplicable("concurrency 1 (--concurrency C >= 2 sends C requests together)")

    def body(prompts: list[list[int]], T: int) -> None:
        bodies = [s.engine.body(p, T, False) for p in prompts]
        together = s.engine.send(bodies, concurrency=C)
        for r, (p, b, got) in enumerate(zip(prompts, bodies, together)):
            alone = s.engine.once(b)
            extra = {"T": T, "row": r, "concurrency": C, "others": [prompt_sha256(q) for q in prompts if q is not p]}
            _judge(s, "concurrency", p, got, alone, s.engine, (b, b), extra, f"sent among {C} differs from sent alone")

    space = {
        "prompts": st.lists(s.space.prompts(), min_size=C, max_size=C, unique_by=tuple),
        "T": st.integers(max(1, s.max_T // 2), s.max_T),
    }
    return _search(s, "concurrency", space, body, size=lambda kw: sum(len(p) for p in kw["prompts"]))


def _length(s: Session) -> dict[str, Any]:
    from hypothesis import strategies as st

    def body(prompt: list[int], T: int, stop_at_eos: bool) -> None:
        request = s.engine.body(prompt, T, stop_at_eos)
        got = s.engine.once(request)
        example = {"check": "length", **_prompt_fields(s, prompt), "T": T, "stop_at_eos": stop_at_eos,
                   "tokens": len(got.tokens), "finish_reason": got.finish, "curl": s.engine.curl(request)}  # fmt: skip
        if got.error:
            raise CheckFailed(f"the request failed: {got.error}", example)
        eos_at = next((i for i, t in enumerate(got.tokens) if t in s.eos), None)
        if len(got.tokens) > T:
            raise CheckFailed(f"sent {len(got.tokens)} tokens for max_tokens {T}", example)
        if stop_at_eos and eos_at is not None and eos_at < len(got.tokens) - 1:
            raise CheckFailed(f"sent {len(got.tokens) - eos_at - 1} token(s) after EOS at position {eos_at}", example)
        if len(got.tokens) < T and not (stop_at_eos and got.finish == "stop"):
            raise CheckFailed(
                f"sent {len(got.tokens)} of {T} tokens (finish_reason {got.finish!r}"
                + (", EOS ignored as asked" if not stop_at_eos else "")
                + ")",
                example,
            )

    space = {"prompt": s.space.prompts(), "T": st.integers(1, s.max_T), "stop_at_eos": st.booleans()}
    return _search(s, "length", space, body)


def _stop(s: Session) -> dict[str, Any]:
    from hypothesis import strategies as st

    def body(prompt: list[int], T: int, at: int) -> None:
        full = s.engine.once(s.engine.body(prompt, T, False))
        if full.error:
            raise CheckFailed(f"the request failed: {full.error}", {"check": "stop", **_prompt_fields(s, prompt)})
        pieces = [s.space.text_of([t]) for t in full.tokens]
        stop = pieces[at % len(pieces)].strip() if pieces else ""
        if len(stop) < 2 or stop not in full.text:
            return  # a token without text of its own (whitespace, a byte of a character): nothing to stop on
        request = s.engine.body(prompt, T, False, stop=[stop])
        got = s.engine.once(request)
        want = full.text[: full.text.index(stop)]
        if got.error or got.text != want:
            example = {"check": "stop", **_prompt_fields(s, prompt), "T": T, "stop": stop, "text": got.text,
                       "expected_text": want, "curl": s.engine.curl(request)}  # fmt: skip
            if got.error:
                raise CheckFailed(f"the request failed: {got.error}", example)
            what = "text after the stop string" if len(got.text) > len(want) else "text that is not the unstopped text"
            raise CheckFailed(f"with stop {stop!r}: {what} ({len(got.text)} characters, {len(want)} expected)", example)

    space = {"prompt": s.space.prompts(), "T": st.integers(4, s.max_T), "at": st.integers(1, 64)}
    return _search(s, "stop", space, body)


def _streaming(s: Session) -> dict[str, Any]:
    from hypothesis import strategies as st

    def body(prompt: list[int], T: int) -> None:
        request = s.engine.body(prompt, T, False)
        streamed, plain = s.engine.once(request), s.engine.unstreamed(request)
        if streamed.error or plain.error or streamed.tokens != plain.tokens:
            example = {"check": "streaming", **_prompt_fields(s, prompt), "T": T, "streamed": streamed.tokens,
                       "not_streamed": plain.tokens, "curl": s.engine.curl(request)}  # fmt: skip
            if streamed.error or plain.error:
                raise CheckFailed(f"a request failed: {streamed.error or plain.error}", example)
            n = min(len(streamed.tokens), len(plain.tokens))
            i = next((i for i in range(n) if streamed.tokens[i] != plain.tokens[i]), n)
            raise CheckFailed(f"streamed and non-streamed output differ at output position {i}", example)

    return _search(s, "streaming", {"prompt": s.space.prompts(), "T": st.integers(1, s.max_T)}, body)


def _accounting(s: Session) -> dict[str, Any]:
    from hypothesis import strategies as st

    engine = s.engine.engine
    seen = {"counted": 0}

    def body(prompt: list[int], T: int) -> None:
        request = s.engine.body(prompt, T, False)
        got = s.engine.once(request)
        if got.error:
            return
        example = {"check": "accounting", **_prompt_fields(s, prompt), "T": T, "tokens": len(got.tokens),
                   "counters": got.counters, "curl": s.engine.curl(request)}  # fmt: skip
        try:
            spec = engine.acceptance(got.counters, len(got.tokens))
        except DtbenchError as exc:
            raise CheckFailed(str(exc), example) from None
        if not spec:
            return
        seen["counted"] += 1
        drafted, accepted, steps = spec.get("drafted"), spec.get("accepted"), spec.get("steps")
        example["acceptance"] = spec
        if drafted is not None and accepted is not None and accepted > drafted:
            raise CheckFailed(f"accepted {accepted} > drafted {drafted}", example)
        if steps is not None and not 1 <= steps <= max(len(got.tokens), 1):
            raise CheckFailed(f"{steps} verification steps for {len(got.tokens)} tokens", example)
        length = spec.get("acceptance_length")
        if steps and length is not None and abs(length - len(got.tokens) / steps) > 1e-6 * max(1.0, length):
            raise CheckFailed(
                f"acceptance length {length:g} is not tokens / steps = {len(got.tokens)} / {steps}", example
            )

    before = _metrics(s.engine)
    out = _search(s, "accounting", {"prompt": s.space.prompts(), "T": st.integers(2, s.max_T)}, body)
    after = _metrics(s.engine)
    if before is not None and after is not None:
        try:
            delta = engine.metrics_delta(before, after)
        except DtbenchError as exc:
            raise CheckFailed(f"its metrics endpoint: {exc}") from None
        drafted, accepted = delta.get("drafted"), delta.get("accepted")
        if isinstance(drafted, int | float) and isinstance(accepted, int | float) and accepted > drafted:
            raise CheckFailed(f"its metrics count accepted {accepted:g} > drafted {drafted:g}", {"metrics": delta})
        seen["counted"] += bool(delta)
    if not seen["counted"]:
        raise NotApplicable("the engine reported no speculation counters (none in its responses or metrics)")
    out["counted"] = seen["counted"]
    return out


def _metrics(ep: Endpoint) -> dict[str, Any] | None:
    import httpx

    path = ep.engine.metrics_path
    if path is None or ep.down:
        return None
    try:
        answer = httpx.get(ep.base_url + path, timeout=10.0, headers=auth_headers(ep.params))
    except httpx.HTTPError:
        return None
    return ep.engine.parse_metrics(answer.text) if answer.status_code == 200 else None


CHECKS: dict[str, Callable[[Session], dict[str, Any]]] = {
    "deterministic": _deterministic,
    "greedy_equals_reference": _greedy,
    "concurrency": _concurrency,
    "length": _length,
    "stop": _stop,
    "streaming": _streaming,
    "accounting": _accounting,
}


def _size(kw: dict[str, Any]) -> int:
    return len(kw.get("prompt") or [])


def _search(s: Session, check: str, space: dict[str, Any], body: Callable[..., None], size=_size) -> dict[str, Any]:
    """:func:`~dtbench.harness.conformance.search` with shrinking until the check's deadline; the ``ServerDown``
    a request raises ends the search at once."""
    down: list[ServerDown] = []

    def guarded(**kw: Any) -> None:
        if down:
            return
        try:
            body(**kw)
        except ServerDown as exc:
            down.append(exc)

    stats = search(s.n(check), space, guarded, shrink=s.shrink, deadline=s.deadline, size=size)
    if down:
        raise down[0]
    return {"examples": stats.examples, "out_of_time": stats.out_of_time}


def run_checks(s: Session, checks: list[str] | None = None, progress: Callable[[Outcome], None] | None = None) -> list[Outcome]:  # fmt: skip
    """Run the chosen checks (:data:`SERVER_CHECKS` order) on ``s.engine``, the budget shared: each check may use the
    time left divided by the checks left (a check that ends early leaves its time to the others).

    Returns:
        One :class:`~dtbench.harness.conformance_checks.Outcome` per check (``precision`` ``served``): its examples
        and ties in ``detail``, the ties in ``counterexample["ties"]`` for a pass, the shrunk counterexample for a
        failure.
    """
    chosen = [c for c in SERVER_CHECKS if checks is None or c in checks]
    end = s.deadline
    outcomes: list[Outcome] = []
    for k, name in enumerate(chosen):
        start = time.monotonic()
        s.deadline = start + max(0.0, end - start) / (len(chosen) - k)
        outcome = Outcome(s.engine.label, name, PRECISION, "passed")
        try:
            if s.engine.down or (s.reference is not None and s.reference.down):
                raise ServerDown(s.engine.down or (s.reference.down if s.reference else ""))
            if time.monotonic() >= end:
                outcome.status, outcome.detail = "skipped", "not run: the budget (--budget) was spent"
            else:
                stats = CHECKS[name](s)
                ties = s.ties.get(name, [])
                outcome.detail = f"{stats['examples']} example(s)" + (
                    " (the budget ran out: fewer than asked)" if stats["out_of_time"] else ""
                )
                if "counted" in stats:
                    outcome.detail += f"; speculation counters in {stats['counted']} answer(s)"
                if ties:
                    margins = ", ".join(f"{t['margin']:.3g}" for t in ties if isinstance(t.get("margin"), float))
                    outcome.detail += f"; {len(ties)} tie(s) (margins {margins} nats)"
                    outcome.counterexample = {"ties": ties}
        except CheckFailed as exc:
            outcome.status, outcome.detail, outcome.counterexample = "failed", exc.message, exc.counterexample
        except NotApplicable as exc:
            outcome.status, outcome.detail = "n/a", str(exc)
        except ServerDown as exc:
            outcome.status, outcome.detail = "failed", str(exc)
        outcome.seconds = time.monotonic() - start
        if outcome.status == "failed" and outcome.counterexample:
            outcome.counterexample.setdefault("engine", s.engine.identity())
            if s.reference is not None:
                outcome.counterexample.setdefault("reference_engine", s.reference.identity())
        outcomes.append(outcome)
        if progress is not None:
            progress(outcome)
    s.deadline = end
    return outcomes


def fetch_identity_context(ep: Endpoint) -> int | None:
    """The context length the server reports (:meth:`Endpoint.identity`'s ``n_ctx``), None when it reports none."""
    n = ep.identity().get("n_ctx")
    return int(n) if isinstance(n, int) and n > 0 else None


__all__ = ["EXAMPLES", "SERVER_CHECKS", "Answer", "Endpoint", "PromptSpace", "ServerDown", "Session", "prompt_sha256",
           "run_checks"]  # fmt: skip
