"""The chat served over HTTP, on the standard library's threaded server: the page (page.html, no build step) at `/`,
OpenAI's API under `/v1/` (api.py), and `/chat/config` (the models and default settings the page starts with).

Each request is answered on a thread of its own; the engine answers one at a time, so a second waits for the first's
answer, and past MOST_WAITING waiting a request gets a 503 with Retry-After. A streamed answer is server-sent events
(`data: {...}` then `data: [DONE]`), as OpenAI streams. The engine never waits on a client: an answer is drawn on a
thread of its own into a queue the client reads at its pace, and a reader that goes away, or stops reading for
CLIENT_TIMEOUT seconds, ends its answer's decoding (its socket times out; so does a request sent too slowly). What a
stranger could do is bounded: `--api-key` (a Bearer token, as vLLM's) guards the API, a Host that is not the served
one (DNS rebinding) and an Origin of another site (a page the user opened posting here) get a 403 unless
`--allow-origin` names it. A request the chat cannot answer gets a 4xx and OpenAI's error body naming the field; an
error while answering gets a 500 with its reason, and the server goes on."""

from __future__ import annotations

import hmac
import json
import logging
import queue
import sys
import threading
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from llmtrain.chat import api
from llmtrain.chat.engine import Engine, RequestError

MOST_BODY_BYTES = 16 * 1024 * 1024
MOST_WAITING = 16  # requests answered or waiting for the engine at once; past it: 503
CLIENT_TIMEOUT = 30.0  # seconds a client may take to send a request, or leave a streamed answer unread
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
log = logging.getLogger("llmtrain.chat")


@dataclass(frozen=True)
class Guard:
    """Who may use the API: `api_key` (None: anyone who reaches the port), and the page origins besides the served
    one that may post to it (`allowed_origins`, `*` any)."""

    api_key: str | None = None
    allowed_origins: tuple[str, ...] = field(default_factory=tuple)


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class ChatServer(ThreadingHTTPServer):
    """`engine`'s models served at (host, port) with `defaults` for what a request leaves out; `compared`: the two
    models the page answers each message with, side by side (None: one)."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        engine: Engine,
        defaults: api.Defaults,
        compared: list[str] | None,
        guard: Guard = Guard(),
        client_timeout: float = CLIENT_TIMEOUT,
    ):
        super().__init__(address, ChatHandler)
        self.engine, self.defaults, self.compared, self.guard = engine, defaults, compared, guard
        self.client_timeout = client_timeout
        self.page = resources.files("llmtrain.chat").joinpath("page.html").read_bytes()
        self.admitted = threading.BoundedSemaphore(MOST_WAITING)

    def refusal(self, headers: Any, api_route: bool) -> tuple[HTTPStatus, str] | None:
        """Why a request with `headers` may not be answered (a status and a reason), or None: a Host this server
        is not served as, an Origin of another site, or an API request without the key."""
        host = headers.get("Host")  # a browser always sends it; a client of its own may not (HTTP/1.0)
        if host is not None and str(self.server_address[0]) in LOOPBACK:
            named = host.rsplit(":", 1)[0]
            if named not in LOOPBACK:
                return HTTPStatus.FORBIDDEN, f"Host {named!r}: this server answers to this machine's names alone"
        origin, allowed = headers.get("Origin"), self.guard.allowed_origins
        if origin is not None and "*" not in allowed and origin not in allowed:
            if not _same_site(origin, host):
                return (
                    HTTPStatus.FORBIDDEN,
                    f"Origin {origin}: another site's page may not use this chat (--allow-origin)",
                )
        key = self.guard.api_key
        if api_route and key is not None:
            given = (headers.get("Authorization") or "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(given.encode(), key.encode()):
                return HTTPStatus.UNAUTHORIZED, "the API needs its key: Authorization: Bearer <the --api-key>"
        return None

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


def _same_site(origin: str, host: str | None) -> bool:
    """Whether `origin` is the page this request's Host names: this server's own page."""
    return host is not None and origin in (f"http://{host}", f"https://{host}")


class ChatHandler(BaseHTTPRequestHandler):
    server: ChatServer
    protocol_version = "HTTP/1.0"  # every response ends its connection: a stream's end is the connection's

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.client_timeout)  # reading the request, writing what is not read

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _refused(self, api_route: bool) -> bool:
        refusal = self.server.refusal(self.headers, api_route)
        if refusal is not None:
            status, reason = refusal
            self._json(status, error_body(reason, kind="permission_error"))
        return refusal is not None

    def do_GET(self) -> None:
        if self._refused(self.path.startswith("/v1/")):
            return
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
        if self._refused(True):
            return
        if self.path not in routes:
            self._json(
                HTTPStatus.NOT_FOUND, error_body(f"no API at {self.path}: /v1/chat/completions or /v1/completions")
            )
            return
        if not self.server.admitted.acquire(blocking=False):
            message = f"{MOST_WAITING} requests are being answered or waiting: try again shortly"
            self._json(HTTPStatus.SERVICE_UNAVAILABLE, error_body(message, kind="overloaded"), {"Retry-After": "1"})
            return
        try:
            request = api.parse(self.server.engine, self._body(), routes[self.path], self.server.defaults)
            if request.stream:
                self._stream(api.chunks(self.server.engine, request))
            else:
                self._json(HTTPStatus.OK, api.answered(self.server.engine, request))
        except RequestError as error:
            self._json(HTTPStatus(error.status), error_body(str(error), error.param))
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the reader went away or stopped reading (or sending): its answer's decoding has ended with it
        except Exception as error:
            traceback.print_exc(file=sys.stderr)
            self._json(
                HTTPStatus.INTERNAL_SERVER_ERROR, error_body(f"{type(error).__name__}: {error}", kind="server_error")
            )
        finally:
            self.server.admitted.release()

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
        """Server-sent events, each written as soon as it is made and the client takes it. The first is made before
        the headers go, so a request refused at once still gets its status; the rest are drawn on a thread of their
        own (Drawn), so the engine goes at its own pace whatever the client's; an error after the headers is the
        stream's last event."""
        first = next(events)
        drawn = Drawn(events)
        try:
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            self._event(first)
            for event in drawn:
                self._event(event)
            self.wfile.write(b"data: [DONE]\n\n")
        finally:
            drawn.stop()

    def _event(self, event: dict[str, Any]) -> None:
        self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        self.wfile.flush()

    def _json(self, status: HTTPStatus, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(body).encode(), "application/json", headers)

    def _send(
        self, status: HTTPStatus, payload: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class Drawn:
    """An answer's events drawn on a thread of their own into a queue the handler takes them from: the engine is
    held for as long as it decodes, never for as long as a client takes to read. `stop` (the client went away or
    stalled) closes the events, which ends the answer's decoding on every rank; an error while drawing is the
    stream's last event."""

    _END = object()

    def __init__(self, events: Iterator[dict[str, Any]]):
        self._events, self._queue, self._stopped = events, queue.Queue[Any](), threading.Event()
        self._thread = threading.Thread(target=self._draw, daemon=True, name="llmtrain-chat-answer")
        self._thread.start()

    def _draw(self) -> None:
        try:
            for event in self._events:
                if self._stopped.is_set():
                    break
                self._queue.put(event)
        except Exception as error:
            traceback.print_exc(file=sys.stderr)
            self._queue.put(error_body(f"{type(error).__name__}: {error}", kind="server_error"))
        finally:
            self._events.close()  # type: ignore[attr-defined]  # a generator's: its answer's decoding ends
            self._queue.put(self._END)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while (event := self._queue.get()) is not self._END:
            yield event

    def stop(self) -> None:
        self._stopped.set()
