"""A fake OpenAI-compatible completions server for the server path's tests without llama.cpp (issue 42).

It answers ``GET /health`` with 200 and ``POST /v1/completions`` by its *mode*, in llama.cpp's shapes
(``__verbose.tokens`` per streamed event, ``timings`` on the final one; tests/test_server_formats.py):

- ``hang``: never answers a completion (a server stuck on a request); ``stall``: sends a stream's headers, then
  nothing;
- ``drop``: closes the first streamed request's connection without a response (as llama-server did on a loaded
  machine), then as ``stream``;
- ``garbage3`` / ``cut3``: as ``stream``, but every 3rd streamed request (the 3rd, 6th, ...) gets HTTP 200 with a
  body that is not JSON (``garbage3``) or a stream that ends cleanly after half its tokens, with no final event
  (``cut3``): one bad answer among good ones (issue 67 item 3);
- ``stream``: streams ``max_tokens`` token ids (``--tokens`` cycled), then a final event with ``--timings`` (JSON,
  written as given: NaN and Infinity included); a non-streamed request (the check request) gets ``--check``
  verbatim (default: a valid JSON answer with top candidates). With ``durations`` (seconds, cycled over the
  streamed requests in the order they arrive) each stream's events are spread over that long (issue 39: requests
  that take 1x or 4x as long).

Run in a thread (:func:`serve`) or as a process (``python tests/fakeserver.py --port N --mode M``: ``launch:``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def handler(mode: str, tokens: list[int], timings: str, check: str | None, mark: str | None = None, durations=None):
    arrived = itertools.count()
    dropped = itertools.count()
    streamed = itertools.count(1)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def do_GET(self):
            self.server.authorizations.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def do_POST(self):
            self.server.authorizations.append(self.headers.get("Authorization"))
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if mark:  # tells a test that a request is in flight, and which process serves it
                with open(mark, "a") as f:
                    f.write(f"{os.getpid()}\n")
            if mode == "hang":
                time.sleep(3600)
                return
            if mode == "stall":  # headers of a stream, then nothing
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self.wfile.flush()
                time.sleep(3600)
                return
            if mode == "drop" and body.get("stream") and next(dropped) == 0:
                self.close_connection = True  # no status line: the client sees the connection closed
                return
            if not body.get("stream"):
                text = check or json.dumps(
                    {"choices": [{"text": "", "logprobs": {"content": [{"id": tokens[0], "top_logprobs": []}]}}]}
                )
                data = text.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            n = int(body.get("max_tokens", 1))
            bad = mode in ("garbage3", "cut3") and next(streamed) % 3 == 0
            if bad:  # a body that is no event stream, or half the tokens and no final event (the stream just ends)
                cut = [tokens[i % len(tokens)] for i in range(max(1, n // 2))]
                events = [{"choices": [{"text": "x", "index": 0, "finish_reason": None}], "__verbose": {"tokens": [t]}}
                          for t in cut]  # fmt: skip
                data = "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode()
                if mode == "garbage3":
                    data = b"<html><body>502 upstream hiccup</body></html>"
                kind = "text/html" if mode == "garbage3" else "text/event-stream"
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            out = [tokens[i % len(tokens)] for i in range(n)]
            events = [
                {"choices": [{"text": "x", "index": 0, "finish_reason": None}], "__verbose": {"tokens": [t]}}
                for t in out
            ]
            final = '{"choices": [{"text": "", "index": 0, "finish_reason": "length"}], "timings": ' + timings + "}"
            payload = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + f"data: {final}\n\ndata: [DONE]\n\n"
            if durations:  # one event per token, spread over this request's duration
                pause = durations[next(arrived) % len(durations)] / max(1, len(events))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                parts = [f"data: {json.dumps(e)}\n\n" for e in events] + [f"data: {final}\n\ndata: [DONE]\n\n"]
                for i, part in enumerate(parts):
                    if i < len(events):
                        time.sleep(pause)
                    raw = part.encode()
                    self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
                return
            data = payload.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def serve(
    mode: str = "stream",
    tokens=(5, 6, 7),
    timings: str = "{}",
    check: str | None = None,
    port: int = 0,
    mark: str | None = None,
    durations=None,
):
    """Start the fake server in a daemon thread; returns (server, base URL). ``server.shutdown()`` stops it.
    ``mark``: a file created when a completion request arrives; ``durations``: seconds per streamed request, cycled
    in arrival order; ``server.authorizations``: each request's Authorization header, in arrival order."""
    server = ThreadingHTTPServer(
        ("127.0.0.1", port), handler(mode, list(tokens), timings, check, mark, list(durations or []))
    )
    server.daemon_threads = True
    server.authorizations = []  # each request's Authorization header (None: none sent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", default="stream")
    ap.add_argument("--mark")
    args = ap.parse_args()
    server, _ = serve(args.mode, port=args.port, mark=args.mark)
    threading.Event().wait()
