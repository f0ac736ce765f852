"""A fake *model-like* engine in llama.cpp's shapes for the server kit's tests (issue 66): unlike tests/fakeserver.py
(cycled tokens), its output is a deterministic function of the prompt, a toy language model over SmolLM2's vocabulary
(EOS id 2), so a "plain" fake is the reference of a "speculative" one and the tests plant where they differ:

- next token of a context c: ``a = best(c)``; the runner-up ``b = a + 1``; the top-2 margin is 0.01 nats at a
  *tie position* (a hash of c divisible by 7) and 3.0 elsewhere; EOS now and then (a hash divisible by 29);
- ``plain``: always ``a`` (``ignore_eos``: the runner-up instead of EOS);
- ``bug``: on a *repetitive* prompt (a period of 1-4 tokens over at least 8 of its tokens: the shape n-gram drafting
  feeds on), ``b`` at the first output position that is not a tie: a planted divergence only that shape shows;
- ``ties``: ``b`` at every tie position (within the reference's margin: a tie, never a failure);
- ``batchtie``: ``b`` at tie positions while another request is in flight (batch variance: the concurrency check
  sees a tie);
- ``badcount``: as ``plain``, with speculation counters that accept more than they drafted; ``nostop``: as
  ``plain``, stop strings ignored (text after a stop);
- ``die``: exits the process at the first completion (run as a process); ``hang``: never answers a completion.

Stop strings (``stop``) end the text before their first occurrence. ``GET /props`` gives llama.cpp's
``build_info``, ``model_path`` and ``n_ctx``; check requests (``n_probs``) get ``logprobs.content`` with
``top_logprobs``. Run in a thread (:func:`serve`) or as a process (``python tests/fakeengine.py --port N --mode M``).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VOCAB = 49152
EOS = 2
TIE, FAR = 0.01, 3.0


def _hash(c: list[int]) -> int:
    return (c[-1] * 1103 + (c[-2] if len(c) > 1 else 0) * 97 + len(c) * 13) % 9973


def top(c: list[int]) -> list[tuple[int, float]]:
    """The toy model's top-3 (id, log-probability) after context ``c``, best first."""
    h = _hash(c)
    a = EOS if h % 29 == 0 else 100 + (h * 4) % (VOCAB - 300)
    b = 101 if a == EOS else a + 1
    margin = TIE if h % 7 == 0 else FAR
    return [(a, -0.05), (b, -0.05 - margin), (b + 1, -8.0)]


def repetitive(prompt: list[int]) -> bool:
    """A period of 1-4 tokens over at least 8 consecutive prompt tokens."""
    for p in range(1, 5):
        run = 0
        for i in range(p, len(prompt)):
            run = run + 1 if prompt[i] == prompt[i - p] else 0
            if run + p >= 8:
                return True
    return False


def generate(mode: str, prompt: list[int], n: int, ignore_eos: bool, batched: bool) -> list[int]:
    out: list[int] = []
    planted = False
    for _ in range(n):
        cands = top(prompt + out)
        (a, _), (b, lp_b) = cands[0], cands[1]
        tie = -0.05 - lp_b <= TIE + 1e-9
        t = a
        if mode == "bug" and not planted and not tie and repetitive(prompt):
            t, planted = b, True
        elif (mode == "ties" or (mode == "batchtie" and batched)) and tie:
            t = b
        if t == EOS and ignore_eos:
            t = b
        out.append(t)
        if t == EOS:
            break
    return out


def handler(mode: str, detok, n_ctx: int = 256):
    inflight = [0]
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _json(self, obj, status=200):
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/props":  # echoes the Authorization header, as a careless server might
                auth = self.headers.get("Authorization")
                build = f"fake-engine 1.0 ({mode})" + (f" auth={auth}" if auth else "")
                return self._json({"build_info": build, "model_path": "fake-lm.gguf",
                                   "default_generation_settings": {"n_ctx": n_ctx}})  # fmt: skip
            if self.path == "/health":
                return self._json({"status": "ok"})
            return self._json({"error": {"message": "not found"}}, 404)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if mode == "hang":
                time.sleep(3600)
                return
            if mode == "die":
                os._exit(3)
            prompt = [int(t) for t in body.get("prompt", [])]
            n = int(body.get("max_tokens", 16))
            with lock:
                inflight[0] += 1
            try:
                if mode == "batchtie" and body.get("stream"):
                    time.sleep(0.15)  # requests sent together overlap here
                with lock:
                    batched = inflight[0] > 1
                out = generate(mode, prompt, n, bool(body.get("ignore_eos")), batched)
            finally:
                with lock:
                    inflight[0] -= 1
            pieces = [detok([t]) for t in out]
            finish = "stop" if out and out[-1] == EOS else "length"
            stops = [s for s in (body.get("stop") or []) if s] if mode != "nostop" else []
            text = "".join(pieces)
            if stops:
                cut = min((text.find(s) for s in stops if s in text), default=-1)
                if cut >= 0:
                    keep, used = [], 0
                    for t, piece in zip(out, pieces):
                        keep.append(t)
                        used += len(piece)
                        if used >= cut:
                            break
                    out, text, finish = keep, text[:cut], "stop"
                    pieces = pieces[: len(out)]
                    pieces[-1] = pieces[-1][: max(0, len(pieces[-1]) - (used - cut))] if pieces else ""
            counters = {"predicted_n": len(out)}
            if mode in ("bug", "ties", "batchtie", "badcount"):
                drafted = 2 * len(out)
                accepted = max(0, len(out) - 1) // 2 if mode != "badcount" else drafted + 1
                counters.update(draft_n=drafted, draft_n_accepted=accepted)
            if not body.get("stream"):
                choice = {"text": text, "index": 0, "finish_reason": finish}
                if body.get("n_probs"):
                    k = int(body["n_probs"])
                    content = []
                    for i, t in enumerate(out):
                        cands = top(prompt + out[:i])
                        lp = dict(cands).get(t, -9.0)
                        content.append({"id": t, "logprob": lp,
                                        "top_logprobs": [{"id": c, "logprob": v} for c, v in cands[:k]]})  # fmt: skip
                    choice["logprobs"] = {"content": content}
                return self._json({"choices": [choice], "__verbose": {"tokens": out}, "timings": counters})
            events = [
                {"choices": [{"text": piece, "index": 0, "finish_reason": None}], "__verbose": {"tokens": [t]}}
                for t, piece in zip(out, pieces)
            ]
            final = {"choices": [{"text": "", "index": 0, "finish_reason": finish}], "timings": counters}
            data = "".join(f"data: {json.dumps(e)}\n\n" for e in [*events, final]) + "data: [DONE]\n\n"
            raw = data.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    return Handler


def serve(mode: str = "plain", detok=None, n_ctx: int = 256, port: int = 0):
    """Start the fake engine in a daemon thread; returns (server, base URL). ``detok``: token ids -> text (the
    tests' SmolLM2 tokenizer; default ``<id>``)."""
    detok = detok or (lambda ids: "".join(f"<{i}>" for i in ids))
    server = ThreadingHTTPServer(("127.0.0.1", port), handler(mode, detok, n_ctx))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", default="plain")
    ap.add_argument("rest", nargs="*")  # a test's marker (to find the process)
    args = ap.parse_args()
    serve(args.mode, port=args.port)
    threading.Event().wait()
