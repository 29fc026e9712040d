"""A fake AI provider for tests/proxy_clients: enough of the OpenAI and
Ollama HTTP APIs for their official Python packages to work against it.

Standard library only. HTTP/1.1 with keep-alive: a whole answer carries its
Content-Length, a stream is sent with Transfer-Encoding: chunked, framed
here chunk by chunk, each chunk flushed on its own.

Everything it answers is deterministic, so that a test can assert exact
usage:

- prompt tokens are the number of whitespace-separated words in the input
  (every message's text for a chat, every input for an embedding);
- a chat always answers REPLY, REPLY_TOKENS output tokens, one word a chunk
  when streamed;
- an OpenAI answer names the request's model + MODEL_SUFFIX (as OpenAI
  answers "gpt-4o-mini" with "gpt-4o-mini-2024-07-18"), so that the proxy's
  refinement of the model shows; Ollama echoes the model it was asked for.

An OpenAI chat holds CHAT_DELAY seconds, and the number of OpenAI chats in
progress is counted: `openai_chat_peak()` is the most seen at once since
`reset_openai_chat_peak()`. Each request is also kept in `requests_seen()`
(method, path, headers) so that a test can check what the proxy forwarded.
"""

from __future__ import annotations

import base64
import json
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterable

MODEL_SUFFIX = "-2024-07-18"
REPLY = "Hello from the fake upstream"
REPLY_TOKENS = len(REPLY.split())
CHAT_DELAY = 0.05
# Between two chunks of a stream, so that the proxy sees them apart.
CHUNK_GAP = 0.005
EMBEDDING_DIMENSIONS = 4
CREATED = 1_786_622_400
OLLAMA_CREATED_AT = "2026-08-13T12:00:00.000000Z"

_lock = threading.Lock()
_openai_chats_now = 0
_openai_chats_peak = 0
_seen: list[tuple[str, str, dict[str, str]]] = []


def reset_openai_chat_peak() -> None:
    global _openai_chats_peak
    with _lock:
        _openai_chats_peak = _openai_chats_now


def openai_chat_peak() -> int:
    with _lock:
        return _openai_chats_peak


def requests_seen() -> list[tuple[str, str, dict[str, str]]]:
    with _lock:
        return list(_seen)


def _openai_chat_begins() -> None:
    global _openai_chats_now, _openai_chats_peak
    with _lock:
        _openai_chats_now += 1
        _openai_chats_peak = max(_openai_chats_peak, _openai_chats_now)


def _openai_chat_ends() -> None:
    global _openai_chats_now
    with _lock:
        _openai_chats_now -= 1


def count_words(texts: Iterable[str]) -> int:
    return sum(len(text.split()) for text in texts)


def _message_texts(messages: Any) -> list[str]:
    """The text of each message: a string content, or the text parts of a
    list content (OpenAI's content parts)."""
    texts: list[str] = []
    for message in messages or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(part.get("text", "") for part in content if isinstance(part, dict))
    return texts


def _inputs(value: Any) -> list[str]:
    """An embedding request's input: a string or a list of strings."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    raise ValueError("input must be a string or a list of strings")


def embedding_of(text: str) -> list[float]:
    """A small vector that depends on the text only; every component is
    exact in float32, so that a base64 round trip gives it back unchanged."""
    return [float(len(text)), float(len(text.split())), 0.5, -0.25]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-upstream/1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    # -- the wire ------------------------------------------------------

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            body = bytearray()
            while True:
                size_line = self.rfile.readline()
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    # Trailers, if any, up to the empty line.
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(body)
                body += self.rfile.read(size)
                self.rfile.readline()  # the CRLF after the chunk's data
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send_whole(self, status: int, value: Any, before_last_bytes: Any = None) -> None:
        body = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if before_last_bytes is not None:
            before_last_bytes()
        self.wfile.write(body)
        self.wfile.flush()

    def _start_stream(self, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.wfile.flush()

    def _send_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()
        time.sleep(CHUNK_GAP)

    def _end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _error(self, status: int, message: str) -> None:
        self._send_whole(status, {"error": {"message": message, "type": "invalid_request_error"}})

    # -- routing -------------------------------------------------------

    def _remember(self) -> None:
        with _lock:
            _seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))

    def do_GET(self) -> None:
        self._remember()
        if self.path == "/v1/models":
            self._send_whole(
                200,
                {
                    "object": "list",
                    "data": [
                        {"id": "gpt-4o-mini", "object": "model", "created": CREATED, "owned_by": "system"},
                        {"id": "text-embedding-3-small", "object": "model", "created": CREATED, "owned_by": "system"},
                    ],
                },
            )
        elif self.path == "/api/tags":
            self._send_whole(
                200,
                {
                    "models": [
                        {
                            "name": "llama3.2:latest",
                            "model": "llama3.2:latest",
                            "modified_at": OLLAMA_CREATED_AT,
                            "size": 2019393189,
                            "digest": "a80c4f17acd55265feec403c7aef86be0c25983ab279d83f3bcd3abbcb5b8b72",
                            "details": {
                                "parent_model": "",
                                "format": "gguf",
                                "family": "llama",
                                "families": ["llama"],
                                "parameter_size": "3.2B",
                                "quantization_level": "Q4_K_M",
                            },
                        }
                    ]
                },
            )
        else:
            self._error(404, f"no route GET {self.path}")

    def do_POST(self) -> None:
        self._remember()
        raw = self._read_body()
        try:
            request = json.loads(raw or b"{}")
            if not isinstance(request, dict):
                raise ValueError("the body is not an object")
            routes = {
                "/v1/chat/completions": self._openai_chat,
                "/v1/embeddings": self._openai_embeddings,
                "/api/chat": self._ollama_chat,
                "/api/embed": self._ollama_embed,
            }
            route = routes.get(self.path)
            if route is None:
                self._error(404, f"no route POST {self.path}")
                return
            route(request)
        except (ValueError, KeyError, TypeError) as e:
            self._error(400, str(e))

    # -- OpenAI ----------------------------------------------------------

    def _openai_chat(self, request: dict[str, Any]) -> None:
        model = str(request["model"]) + MODEL_SUFFIX
        prompt_tokens = count_words(_message_texts(request.get("messages")))
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": REPLY_TOKENS,
            "total_tokens": prompt_tokens + REPLY_TOKENS,
        }
        base = {"id": "chatcmpl-fake0001", "created": CREATED, "model": model, "system_fingerprint": "fp_fake"}
        _openai_chat_begins()
        ended = False

        def ends() -> None:
            # Counted out before the answer's last bytes leave: until then the
            # proxy cannot know that this call ended, so it may not have
            # started another one in its place.
            nonlocal ended
            if not ended:
                ended = True
                _openai_chat_ends()

        try:
            time.sleep(CHAT_DELAY)
            if not request.get("stream"):
                self._send_whole(
                    200,
                    {
                        **base,
                        "object": "chat.completion",
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": REPLY, "refusal": None},
                                "logprobs": None,
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": usage,
                        "service_tier": "default",
                    },
                    before_last_bytes=ends,
                )
                return
            include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
            chunk = {**base, "object": "chat.completion.chunk"}
            if include_usage:
                chunk["usage"] = None

            def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
                return b"data: " + json.dumps({**chunk, "choices": choices, **extra}).encode() + b"\n\n"

            self._start_stream("text/event-stream; charset=utf-8")
            self._send_chunk(event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]))
            words = REPLY.split()
            for i, word in enumerate(words):
                text = word if i == 0 else " " + word
                self._send_chunk(event([{"index": 0, "delta": {"content": text}, "finish_reason": None}]))
            self._send_chunk(event([{"index": 0, "delta": {}, "finish_reason": "stop"}]))
            if include_usage:
                self._send_chunk(event([], usage=usage))
            ends()
            self._send_chunk(b"data: [DONE]\n\n")
            self._end_stream()
        finally:
            ends()

    def _openai_embeddings(self, request: dict[str, Any]) -> None:
        inputs = _inputs(request["input"])
        as_base64 = request.get("encoding_format") == "base64"
        data = []
        for index, text in enumerate(inputs):
            vector: Any = embedding_of(text)
            if as_base64:
                vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": index, "embedding": vector})
        tokens = count_words(inputs)
        self._send_whole(
            200,
            {
                "object": "list",
                "data": data,
                "model": str(request["model"]) + MODEL_SUFFIX,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            },
        )

    # -- Ollama --------------------------------------------------------

    def _ollama_chat(self, request: dict[str, Any]) -> None:
        model = str(request["model"])
        prompt_tokens = count_words(_message_texts(request.get("messages")))
        done = {
            "done": True,
            "done_reason": "stop",
            "total_duration": 61_000_000,
            "load_duration": 1_000_000,
            "prompt_eval_count": prompt_tokens,
            "prompt_eval_duration": 10_000_000,
            "eval_count": REPLY_TOKENS,
            "eval_duration": 50_000_000,
        }
        base = {"model": model, "created_at": OLLAMA_CREATED_AT}
        if request.get("stream") is False:
            self._send_whole(200, {**base, "message": {"role": "assistant", "content": REPLY}, **done})
            return
        self._start_stream("application/x-ndjson")
        for i, word in enumerate(REPLY.split()):
            text = word if i == 0 else " " + word
            line = {**base, "message": {"role": "assistant", "content": text}, "done": False}
            self._send_chunk(json.dumps(line).encode() + b"\n")
        self._send_chunk(json.dumps({**base, "message": {"role": "assistant", "content": ""}, **done}).encode() + b"\n")
        self._end_stream()

    def _ollama_embed(self, request: dict[str, Any]) -> None:
        inputs = _inputs(request["input"])
        self._send_whole(
            200,
            {
                "model": str(request["model"]),
                "embeddings": [embedding_of(text) for text in inputs],
                "total_duration": 14_000_000,
                "load_duration": 1_000_000,
                "prompt_eval_count": count_words(inputs),
            },
        )


class FakeUpstream:
    """The fake provider on 127.0.0.1, served from a daemon thread."""

    def __init__(self, port: int = 0) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _Handler)
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-upstream", daemon=True)

    def start(self) -> "FakeUpstream":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    port = parser.parse_args().port
    upstream = FakeUpstream(port).start()
    print(f"listening on http://127.0.0.1:{upstream.port}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        upstream.stop()
