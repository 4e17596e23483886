"""A small OpenAI-compatible model server for the embedded demo, the tests and the benchmark.

It speaks the real wire protocol over HTTP on loopback: /v1/models, /v1/chat/completions
(plain and `stream: true` as server-sent events, with the usage chunk when
`stream_options.include_usage` is set), /v1/completions and /v1/embeddings. Answers are
deterministic and `usage` counts are real counts of whitespace-separated words, so a test can
add up exactly what the gateway should have metered. Markers in the last user message inject
faults: `[[fail:500]]`, `[[fail:400]]`, `[[sleep:MS]]`, `[[slow:MS]]` (per streamed chunk),
`[[cut]]` (drop the stream before usage), `[[nousage]]`. It is a stand-in for vLLM/KServe,
never a production server: no auth, no real model.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MARKER = re.compile(r"\[\[(fail|sleep|slow|cut|nousage)(?::(\d+))?\]\]")


def words(text) -> int:
    if isinstance(text, list):  # content parts
        text = " ".join(p.get("text", "") for p in text if isinstance(p, dict))
    return len(str(text or "").split())


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.bodies: list[dict] = []

    def add(self, body: dict, prompt: int, completion: int) -> None:
        with self.lock:
            self.requests += 1
            self.prompt_tokens += prompt
            self.completion_tokens += completion
            self.bodies.append(body)
            del self.bodies[:-200]

    def reset(self) -> None:
        with self.lock:
            self.requests = self.prompt_tokens = self.completion_tokens = 0
            self.bodies.clear()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in separate writes: no 40 ms delayed-ACK stalls
    server_version = "atrium-upstream/1"

    def log_message(self, fmt, *args):  # quiet: tests and benchmarks run thousands of requests
        return

    # --- plumbing ---
    def _json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict | None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            self._json(400, {"error": {"message": "invalid JSON", "type": "invalid_request_error"}})
            return None
        return body if isinstance(body, dict) else {}

    def do_GET(self):
        if self.path.rstrip("/") == "/v1/models":
            names = self.server.model_names
            self._json(200, {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "atrium"} for n in names]})
        else:
            self._json(404, {"error": {"message": "not found", "type": "invalid_request_error"}})

    def do_POST(self):
        body = self._body()
        if body is None:
            return
        path = self.path.rstrip("/")
        if self.server.latency_ms:
            time.sleep(self.server.latency_ms / 1000)
        if path == "/v1/chat/completions":
            messages = body.get("messages") or []
            last = next((m.get("content") for m in reversed(messages) if isinstance(m, dict) and m.get("role") == "user"), "")
            prompt = sum(words(m.get("content")) for m in messages if isinstance(m, dict))
            self._complete(body, str(last if isinstance(last, str) else ""), prompt, chat=True)
        elif path == "/v1/completions":
            text = body.get("prompt") or ""
            text = " ".join(text) if isinstance(text, list) else str(text)
            self._complete(body, text, words(text), chat=False)
        elif path == "/v1/embeddings":
            inputs = body.get("input") or ""
            inputs = inputs if isinstance(inputs, list) else [inputs]
            data = []
            for i, item in enumerate(inputs):
                digest = hashlib.sha256(str(item).encode()).digest()
                data.append({"object": "embedding", "index": i, "embedding": [b / 255 for b in digest[:8]]})
            prompt = sum(words(str(x)) for x in inputs)
            self.server.stats.add(body, prompt, 0)
            self._json(200, {"object": "list", "data": data, "model": body.get("model", ""),
                             "usage": {"prompt_tokens": prompt, "total_tokens": prompt}})
        else:
            self._json(404, {"error": {"message": "not found", "type": "invalid_request_error"}})

    def _complete(self, body: dict, last: str, prompt: int, *, chat: bool) -> None:
        marks = {m.group(1): int(m.group(2) or 0) for m in MARKER.finditer(last)}
        if "sleep" in marks:
            time.sleep(marks["sleep"] / 1000)
        if "fail" in marks:
            status = marks["fail"] or 500
            self._json(status, {"error": {"message": f"injected failure {status} at /internal/worker-7",
                                          "type": "server_error" if status >= 500 else "invalid_request_error"}})
            return
        reply_words = ("echo: " + MARKER.sub("", last)).split()
        max_tokens = body.get("max_tokens")
        if isinstance(max_tokens, int) and max_tokens > 0:
            reply_words = reply_words[:max_tokens]
        completion = len(reply_words)
        model = body.get("model", "")
        rid = "cmpl-" + hashlib.sha1(json.dumps(body, sort_keys=True).encode(), usedforsecurity=False).hexdigest()[:16]  # an id
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if body.get("stream"):
            self._stream(body, rid, model, reply_words, usage, marks, chat=chat)
            return
        self.server.stats.add(body, prompt, completion)
        text = " ".join(reply_words)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        else:
            choice = {"index": 0, "text": text, "finish_reason": "stop"}
        payload = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                   "model": model, "choices": [choice]}
        if "nousage" not in marks:
            payload["usage"] = usage
        self._json(200, payload)

    def _stream(self, body, rid, model, reply_words, usage, marks, *, chat: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        # chunked, as vLLM/uvicorn send it: each event is one HTTP chunk, so a client can read
        # events as they arrive; a cut stream lacks the terminating chunk (a protocol error).
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        obj = "chat.completion.chunk" if chat else "text_completion"

        def send(payload) -> None:
            event = b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"
            self.wfile.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            self.wfile.flush()

        try:
            for i, w in enumerate(reply_words):
                if chat:
                    choice = {"index": 0, "delta": ({"role": "assistant"} if i == 0 else {}) | {"content": w + " "},
                              "finish_reason": None}
                else:
                    choice = {"index": 0, "text": w + " ", "finish_reason": None}
                send({"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]})
                if marks.get("slow"):
                    time.sleep(marks["slow"] / 1000)
                if "cut" in marks and i >= len(reply_words) // 2:
                    self.server.stats.add(body, 0, 0)  # nothing reported: the gateway must not bill it
                    self.close_connection = True
                    return
            last = {"index": 0, "finish_reason": "stop"} | ({"delta": {}} if chat else {"text": ""})
            send({"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [last]})
            reported = (body.get("stream_options") or {}).get("include_usage") and "nousage" not in marks
            if reported:
                send({"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": usage})
                self.server.stats.add(body, usage["prompt_tokens"], usage["completion_tokens"])
            else:
                self.server.stats.add(body, 0, 0)
            send(b"[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            return


class UpstreamServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256

    def __init__(self, address, *, latency_ms: int = 0, model_names=("demo-llm",)):
        super().__init__(address, Handler)
        self.latency_ms = latency_ms
        self.model_names = list(model_names)
        self.stats = Stats()

    @property
    def base_url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/v1"


def start(host: str = "127.0.0.1", port: int = 0, *, latency_ms: int = 0, model_names=("demo-llm",)) -> UpstreamServer:
    """Start a server in a daemon thread; `server.shutdown()` stops it. Port 0 picks a free port."""
    server = UpstreamServer((host, port), latency_ms=latency_ms, model_names=model_names)
    threading.Thread(target=server.serve_forever, name="atrium-upstream", daemon=True).start()
    return server


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--latency-ms", type=int, default=0)
    args = parser.parse_args(argv)
    server = UpstreamServer((args.host, args.port), latency_ms=args.latency_ms)
    print(f"atrium upstream on {server.base_url}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()


if __name__ == "__main__":
    main()
