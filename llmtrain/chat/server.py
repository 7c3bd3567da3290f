"""The chat served over HTTP, on the standard library's threaded server: the page (page.html, no build step) at `/`,
OpenAI's API under `/v1/` (api.py), and `/chat/config` (the models and default settings the page starts with).

Each request is answered on a thread of its own; the engine answers one at a time, so a second waits for the first's
answer. A streamed answer is server-sent events (`data: {...}` then `data: [DONE]`), as OpenAI streams; a reader
that goes away mid-answer ends its decoding. A request the chat cannot answer gets a 4xx and OpenAI's error body
naming the field; an error while answering gets a 500 with its reason, and the server goes on."""

from __future__ import annotations

import json
import logging
import sys
import traceback
from collections.abc import Iterator
from dataclasses import asdict
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from llmtrain.chat import api
from llmtrain.chat.engine import Engine, RequestError

MOST_BODY_BYTES = 16 * 1024 * 1024
log = logging.getLogger("llmtrain.chat")


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class ChatServer(ThreadingHTTPServer):
    """`engine`'s models served at (host, port) with `defaults` for what a request leaves out; `compared`: the two
    models the page answers each message with, side by side (None: one)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], engine: Engine, defaults: api.Defaults, compared: list[str] | None):
        super().__init__(address, ChatHandler)
        self.engine, self.defaults, self.compared = engine, defaults, compared
        self.page = resources.files("llmtrain.chat").joinpath("page.html").read_bytes()

    @property
    def url(self) -> str:
        host, port = self.server_address[0], self.server_address[1]
        return f"http://{host!s}:{port}/"

    def page_config(self) -> dict[str, Any]:
        models = [
            {"name": a.name, "context": a.max_seq_len, "chat_template": a.prompts.templated}
            for a in self.engine.answerers.values()
        ]
        return {"models": models, "compared": self.compared, "defaults": asdict(self.defaults)}


class ChatHandler(BaseHTTPRequestHandler):
    server: ChatServer
    protocol_version = "HTTP/1.0"  # every response ends its connection: a stream's end is the connection's

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        if self.path in ("/", "/index.html"):
            self._send(HTTPStatus.OK, self.server.page, "text/html; charset=utf-8")
        elif self.path == "/chat/config":
            self._json(HTTPStatus.OK, self.server.page_config())
        elif self.path == "/v1/models":
            models = [{"id": name, "object": "model", "owned_by": "llmtrain"} for name in self.server.engine.names]
            self._json(HTTPStatus.OK, {"object": "list", "data": models})
        else:
            self._json(HTTPStatus.NOT_FOUND, error_body(f"no page at {self.path}: try / or /v1/models"))

    def do_POST(self) -> None:
        routes = {"/v1/chat/completions": True, "/v1/completions": False}
        if self.path not in routes:
            self._json(
                HTTPStatus.NOT_FOUND, error_body(f"no API at {self.path}: /v1/chat/completions or /v1/completions")
            )
            return
        try:
            request = api.parse(self.server.engine, self._body(), routes[self.path], self.server.defaults)
            if request.stream:
                self._stream(api.chunks(self.server.engine, request))
            else:
                self._json(HTTPStatus.OK, api.answered(self.server.engine, request))
        except RequestError as error:
            self._json(HTTPStatus(error.status), error_body(str(error), error.param))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the reader went away: its answer's decoding has ended with it
        except Exception as error:
            traceback.print_exc(file=sys.stderr)
            self._json(
                HTTPStatus.INTERNAL_SERVER_ERROR, error_body(f"{type(error).__name__}: {error}", kind="server_error")
            )

    def _body(self) -> Any:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise RequestError("the request needs a Content-Length header", status=411) from None
        if not 0 < length <= MOST_BODY_BYTES:
            raise RequestError(f"the request body must be 1 byte to {MOST_BODY_BYTES} bytes, not {length}", status=413)
        try:
            return json.loads(self.rfile.read(length))
        except RecursionError:
            raise RequestError("the request body nests its JSON too deep") from None
        except ValueError as error:  # not JSON, not UTF-8, an integer of more digits than Python converts
            raise RequestError(f"the request body is not JSON: {error}") from None

    def _stream(self, events: Iterator[dict[str, Any]]) -> None:
        """Server-sent events, each written as soon as it is made. The first is made before the headers go, so a
        request refused at once still gets its status; an error after them is the stream's last event."""
        try:
            first = next(events)
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            try:
                self._event(first)
                for event in events:
                    self._event(event)
            except (BrokenPipeError, ConnectionResetError):
                raise
            except Exception as error:
                traceback.print_exc(file=sys.stderr)
                self._event(error_body(f"{type(error).__name__}: {error}", kind="server_error"))
            self.wfile.write(b"data: [DONE]\n\n")
        finally:
            events.close()  # type: ignore[attr-defined]  # a generator's: its answer's decoding ends

    def _event(self, event: dict[str, Any]) -> None:
        self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        self.wfile.flush()

    def _json(self, status: HTTPStatus, body: dict[str, Any]) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: HTTPStatus, payload: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)
