"""The HTTP side of tests/helpers/fake_sglang.py: SGLang's routes, status codes and reply bodies
(sources: that module's docstring). Runs on the server's ThreadingHTTPServer, one thread per connection.
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any

from tests.helpers.fake_sglang_lora import LoraRequestError

if TYPE_CHECKING:
    from tests.helpers.fake_sglang import FakeSGLangServer

DONE = object()
"""Ends a request's output queue."""

_FLUSH_TEXT = (
    b"Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
    b"requests, the operation will not be performed.)\n"
)


class BadRequest(Exception):
    """A request SGLang refuses with HTTP 400 before running it."""


def handler_class(server: FakeSGLangServer) -> type[BaseHTTPRequestHandler]:
    """The request handler of `server`."""

    class Handler(BaseHTTPRequestHandler):
        def setup(self) -> None:
            super().setup()
            server.connected(self.connection, True)

        def finish(self) -> None:
            server.connected(self.connection, False)
            try:
                super().finish()
            except OSError:
                pass

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
            pass

        def do_GET(self) -> None:
            if self.path in ("/health", "/health_generate"):
                self._reply(200, b"", "text/plain")
            elif self.path == "/get_model_info":
                self._json(200, server.model_info())
            elif self.path == "/get_weight_version":
                self._json(200, {"weight_version": server.weight_version})
            else:
                self._json(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            try:
                body = self._body()
                route = self.path.split("?", 1)[0]
                if route == "/generate":
                    self._generate(body)
                elif route == "/pause_generation":
                    server.pause(str(body.get("mode", "abort")))
                    self._json(200, {"message": "Generation paused successfully.", "status": "ok"})
                elif route == "/continue_generation":
                    server.resume()
                    self._json(200, {"message": "Generation continued successfully.", "status": "ok"})
                elif route == "/update_weights_from_disk":
                    ok, message = server.update_weights(body)
                    reply = {"success": ok, "message": message, "num_paused_requests": 0}
                    self._json(200 if ok else 400, reply)
                elif route == "/flush_cache":
                    ok = server.flush_cache()
                    self._reply(200 if ok else 400, _FLUSH_TEXT, "text/plain")
                elif route == "/load_lora_adapter":
                    error = server.loras.load(body.get("lora_name"), body.get("lora_path"))
                    self._json(*server.loras.reply(error))
                elif route == "/unload_lora_adapter":
                    self._json(*server.loras.reply(server.unload_lora(body.get("lora_name"))))
                elif route == "/abort_request":
                    server.abort(body)
                    self._reply(200, b"", "text/plain")
                else:
                    self._json(404, {"detail": "Not Found"})
            except BadRequest as exc:
                self._json(400, {"object": "error", "message": str(exc), "type": "Bad Request", "code": 400})
            except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
                pass

        def _generate(self, body: dict[str, Any]) -> None:
            try:
                request = server.generate(body)
            except LoraRequestError as exc:  # SGLang's ValueError while admitting the request
                error = {"error": {"message": str(exc)}}
                if not body.get("stream"):
                    self._json(400, error)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self.wfile.write(b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n")
                self.wfile.flush()
                return
            if not request.stream:
                final = None
                while (item := request.out.get()) is not DONE:
                    final = item
                if final is None:
                    raise ConnectionAbortedError("server stopped")
                self._json(200, final)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            try:
                while True:
                    item = request.out.get()
                    if item is DONE:
                        if not server.stopping:
                            self.wfile.write(b"data: [DONE]\n\n")
                            self.wfile.flush()
                        return
                    self.wfile.write(b"data: " + json.dumps(item).encode() + b"\n\n")
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError, OSError):
                server.cancel(request)

        def _body(self) -> dict[str, Any]:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if not raw:
                return {}
            try:
                data = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise BadRequest(f"JSON decode error: {exc}") from exc
            if not isinstance(data, dict):
                raise BadRequest("request body must be a JSON object")
            return data

        def _json(self, status: int, data: Any) -> None:
            self._reply(status, json.dumps(data).encode(), "application/json")

        def _reply(self, status: int, payload: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    return Handler
