"""API keys of ``omni serve`` (``--api-key``, ``--api-key-file``, ``OMNI_API_KEY``).

With at least one key, every HTTP route and WebSocket asks for one, except the public routes
(:data:`DEFAULT_PUBLIC_ROUTES` unless ``--public-route`` says otherwise). A client presents a key
as

- ``Authorization: Bearer KEY`` (the ``openai`` SDK, curl, every HTTP client);
- ``Authorization: Basic ...`` whose password is the key (any user name): what a browser sends
  after its login prompt, so the console page, its push channel (``EventSource``, which cannot set
  headers) and its playground work unchanged;
- on a WebSocket, also the subprotocol ``openai-insecure-api-key.KEY`` (browsers cannot set
  headers on a WebSocket either); the server then accepts the connection with one of the other
  subprotocols the client offered (``realtime`` first), never echoing the key.

Keys are compared in constant time (:func:`hmac.compare_digest`, every key every time) and never
logged, shown or echoed. A refused request gets 401 with ``WWW-Authenticate`` in the error shape
of its route family: the OpenAI shape on the routes APIs mount, the core shape elsewhere.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ..errors import OmniError

#: Routes that may be made public (served without a key).
PUBLIC_ROUTE_CHOICES = ("/health", "/ready", "/metrics", "/openapi.json")

#: Public by default: what load balancers and orchestrators probe. ``/metrics`` (request counts,
#: stage names) needs a key unless made public.
DEFAULT_PUBLIC_ROUTES = ("/health", "/ready")

#: The WebSocket subprotocol prefix that carries a key (what browsers use for OpenAI's Realtime).
KEY_SUBPROTOCOL = "openai-insecure-api-key."

#: The environment variable with a key (one, or several separated by commas).
KEY_ENV = "OMNI_API_KEY"

#: The console's paths: a 401 there also offers Basic, so a browser asks for the key.
CONSOLE_PREFIXES = ("/console/",)


class ApiKeys:
    """The keys a server accepts; empty: no authentication."""

    def __init__(self, keys: Iterable[str] = ()):
        self._keys = tuple(dict.fromkeys(k.encode() for k in keys))

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:  # never the keys themselves
        return f"ApiKeys({len(self._keys)} key(s))"

    def check(self, presented: str | None) -> bool:
        """Whether ``presented`` is one of the keys; compares with every key, in constant time."""
        if presented is None:
            return False
        candidate = presented.encode()
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(candidate, key)
        return ok


def check_key(key: str, where: str) -> str:
    """A key as given, or an OmniError saying what is wrong with it (never the key itself)."""
    if not key:
        raise OmniError(f"{where}: an API key is empty; give a non-empty key")
    if any(c.isspace() for c in key) or not key.isascii() or not key.isprintable():
        raise OmniError(f"{where}: an API key ({len(key)} characters) holds spaces or characters other than printable "
                        "ASCII; HTTP headers cannot carry it, pick a key of letters, digits and -._~+/=")
    return key


def load_keys(keys: Iterable[str] = (), files: Iterable[str] = (), env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Every key from ``--api-key`` values, ``--api-key-file`` files (one key per line; blank
    lines and lines starting with ``#`` skipped) and ``OMNI_API_KEY`` (comma-separated)."""
    environ: Mapping[str, str] = os.environ if env is None else env
    out = [check_key(k, "--api-key") for k in keys]
    for name in files:
        path = Path(name)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise OmniError(f"--api-key-file {name}: cannot read it ({why}); give a readable UTF-8 file with one key "
                            "per line") from None
        found = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
        if not found:
            raise OmniError(f"--api-key-file {name}: no key in it; write one key per line")
        out += [check_key(k, f"--api-key-file {name}, line with a key") for k in found]
    raw = environ.get(KEY_ENV, "")
    out += [check_key(k.strip(), KEY_ENV) for k in raw.split(",") if k.strip()]
    return tuple(dict.fromkeys(out))


def public_routes(values: Iterable[str] | None) -> tuple[str, ...]:
    """The public routes from ``--public-route`` values (None: the defaults; ``none``: no route)."""
    if values is None:
        return DEFAULT_PUBLIC_ROUTES
    out = []
    for value in values:
        if value == "none":
            continue
        path = value if value.startswith("/") else "/" + value
        if path not in PUBLIC_ROUTE_CHOICES:
            raise OmniError(f"--public-route {value!r}: only {', '.join(PUBLIC_ROUTE_CHOICES)} can be public "
                            "(or 'none': every route needs a key)")
        out.append(path)
    return tuple(dict.fromkeys(out))


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or name) listens on this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _subprotocols(scope: dict) -> list[str]:
    return [p for p in scope.get("subprotocols") or () if isinstance(p, str)]


def presented_key(scope: dict) -> str | None:
    """The key a request presents (see the module docstring), or None."""
    auth = _header(scope, b"authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        value = value.strip()
        if scheme.lower() == "bearer" and value:
            return value
        if scheme.lower() == "basic" and value:
            try:
                decoded = base64.b64decode(value, validate=True).decode("utf-8")
            except (binascii.Error, UnicodeDecodeError):
                return None
            return decoded.partition(":")[2] or None
        return None
    if scope["type"] == "websocket":
        for proto in _subprotocols(scope):
            if proto.startswith(KEY_SUBPROTOCOL):
                return proto[len(KEY_SUBPROTOCOL):] or None
    return None


def chosen_subprotocol(scope: dict) -> str | None:
    """The subprotocol to accept a WebSocket with when the client offered some: ``realtime`` if
    offered, else the first that is not a key (a browser fails a connection whose offer got no
    answer); None when only a key was offered."""
    offered = [p for p in _subprotocols(scope) if not p.startswith(KEY_SUBPROTOCOL)]
    if "realtime" in offered:
        return "realtime"
    return offered[0] if offered else None


def core_path(path: str, core_paths: Iterable[str]) -> bool:
    """Whether ``path`` is one of omni serve's own routes (core shape) rather than an API's."""
    for pattern in core_paths:
        if "{" in pattern:
            head = pattern.split("{", 1)[0]
            if path.startswith(head):
                return True
        elif path == pattern:
            return True
    return path.startswith(CONSOLE_PREFIXES)


class Auth:
    """ASGI middleware: a key on every HTTP request and WebSocket but the public routes."""

    def __init__(self, app: Any, keys: ApiKeys, public: Iterable[str], core_paths: Iterable[str]):
        self.app = app
        self.keys = keys
        self.public = frozenset(public)
        self.core_paths = tuple(core_paths)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        kind = scope["type"]
        if kind == "websocket" and _subprotocols(scope):
            send = _answer_subprotocol(scope, send)
        if kind not in ("http", "websocket") or not self.keys:
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if path in self.public:
            await self.app(scope, receive, send)
            return
        presented = presented_key(scope)
        if self.keys.check(presented):
            await self.app(scope, receive, send)
            return
        message = ("this server needs an API key: send the header 'Authorization: Bearer <key>'"
                   + (" (or the WebSocket subprotocol 'openai-insecure-api-key.<key>')" if kind == "websocket" else "")
                   if presented is None else "the API key is not valid: check the key given to omni serve "
                   "(--api-key, --api-key-file or OMNI_API_KEY)")
        status, headers, body = self.refusal(path, message)
        if kind == "http":
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        elif "websocket.http.response" in (scope.get("extensions") or {}):
            await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": 1008, "reason": "API key required"})

    def refusal(self, path: str, message: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """The 401's status, headers and body for ``path``'s route family."""
        challenge = [b'Bearer realm="omni"']
        if path == "/" or path.startswith(CONSOLE_PREFIXES):
            challenge.append(b'Basic realm="omni console", charset="UTF-8"')
        if core_path(path, self.core_paths):
            error: dict[str, Any] = {"type": "Unauthorized", "stage": None, "message": message}
        else:
            error = {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
        body = json.dumps({"error": error}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(b"www-authenticate", c) for c in challenge]
        return 401, headers, body


def _answer_subprotocol(scope: dict, send: Callable) -> Callable:
    """``send`` that accepts the WebSocket with :func:`chosen_subprotocol` when the app accepts
    it without one (the app need not know about the key subprotocol)."""
    chosen = chosen_subprotocol(scope)

    async def wrapped(message: dict) -> None:
        if message["type"] == "websocket.accept" and not message.get("subprotocol") and chosen is not None:
            message = {**message, "subprotocol": chosen}
        await send(message)

    return wrapped
