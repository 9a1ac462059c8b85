"""Who may talk to the server: one ASGI middleware in front of every route, the page's, Gradio's
own (/gradio_api/*, the queue, file downloads) and the API's (/v1).

Three checks, in this order:
1. Host: only requests addressed to the address served, so a web page that rebinds its own DNS
   name to 127.0.0.1 (DNS rebinding) reaches nothing. The browser sends the name it resolved.
2. Origin: a browser request made by another site's page is refused unless it carries the key in
   its Authorization header (a browser adds that header only when the page's script set it).
3. Key (when one is set): every route but /v1, which answers in OpenAI's shape itself (app/api.py),
   needs `Authorization: Bearer KEY` or the page's cookie. The cookie is set by a login form at
   LOGIN_PATH and holds an HMAC of the key, not the key.

It knows nothing about Gradio's routes beyond the one it must leave open (STARTUP_PATH).
"""

import hashlib
import hmac
import html
import ipaddress
import secrets
import socket
import time
from collections import deque
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

LOCAL_NAMES = ("127.0.0.1", "localhost", "::1")
WILDCARDS = ("0.0.0.0", "::", "")
LOGIN_PATH = "/aerie/login"
# Gradio's launch() asks this of its own server, without any key, before it returns; it only
# starts the queue, once, and reveals nothing.
STARTUP_PATH = "/gradio_api/startup-events"
API_PREFIX = "/v1"
MAX_LOGIN_BYTES = 4096
LOGIN_TRIES, LOGIN_WINDOW_S = 5, 60.0   # wrong keys at the form before it makes a guesser wait


@dataclass(frozen=True)
class Policy:
    """What the guard lets through: `hosts` are the Host names the server answers to (lower case,
    IPv6 without brackets); with `any_ip`, any IP literal too (served on every interface: an IP
    literal cannot be rebound); `origins` are the extra origins the user allowed."""

    port: int
    hosts: frozenset[str]
    any_ip: bool = False
    key: str | None = None
    origins: frozenset[str] = frozenset()

    @property
    def cookie(self) -> str:
        return f"aerie-{self.port}"  # one per port: two Aerie servers on one machine keep their own

    def cookie_value(self) -> str:
        assert self.key is not None, "the cookie exists only with a key"
        return hmac.new(self.key.encode(), b"aerie page session", hashlib.sha256).hexdigest()


def policy(host: str, port: int, key: str | None, origins: tuple[str, ...] = ()) -> Policy:
    """The policy for a server on `host`:`port`. A local address answers to every local name;
    a wildcard (every interface) also to this machine's names and to any IP literal."""
    served = host.strip("[]").lower()
    names = set(LOCAL_NAMES)
    if served in WILDCARDS:
        names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
    else:
        names.add(served)
    return Policy(port=port, hosts=frozenset(names), any_ip=served in WILDCARDS, key=key,
                  origins=frozenset(o.rstrip("/").lower() for o in origins))


def split_host(value: str) -> tuple[str, int | None] | None:
    """(name, port) of a Host header or an origin's authority; None when it does not parse."""
    try:
        parts = urlsplit(f"//{value}")
        return (parts.hostname or "").lower(), parts.port
    except ValueError:
        return None


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def host_allowed(p: Policy, value: str) -> bool:
    parsed = split_host(value)
    if parsed is None or parsed[1] != p.port:
        return False
    return parsed[0] in p.hosts or (p.any_ip and is_ip(parsed[0]))


def origin_allowed(p: Policy, origin: str) -> bool:
    """The page's own origin (any address the Host check allows, over http), or one the user allowed."""
    parts = urlsplit(origin.lower())
    return origin.rstrip("/").lower() in p.origins or (parts.scheme == "http" and host_allowed(p, parts.netloc))


def bearer_ok(p: Policy, headers: Headers) -> bool:
    scheme, _, given = headers.get("authorization", "").partition(" ")
    # compare_digest: the time taken must not tell how much of a guessed key was right
    return (p.key is not None and scheme.lower() == "bearer"
            and secrets.compare_digest(given.strip().encode(), p.key.encode()))


def cookie_ok(p: Policy, headers: Headers) -> bool:
    jar = {}
    for item in headers.get("cookie", "").split(";"):
        name, _, value = item.strip().partition("=")
        jar[name] = value
    return p.key is not None and secrets.compare_digest(jar.get(p.cookie, "").encode(), p.cookie_value().encode())


def refusal(scope: Scope, p: Policy) -> Response | None:
    """The response that refuses this request, or None to let it through."""
    headers = Headers(scope=scope)
    host = headers.get("host", "")
    if not host_allowed(p, host):
        names = ", ".join(sorted(f"[{h}]" if ":" in h else h for h in p.hosts))
        return _error(421, f"Aerie answers only requests addressed to itself ({names}, port {p.port}), not to "
                           f"Host {host!r}: this guards against DNS rebinding.")
    origin = headers.get("origin")
    if origin is not None and not origin_allowed(p, origin) and not bearer_ok(p, headers):
        return _error(403, f"Cross-site request refused: Origin {origin!r} is not Aerie's own page. A client "
                           "on another origin must send 'Authorization: Bearer KEY'.")
    path = scope.get("path", "")
    if p.key is None or path == API_PREFIX or path.startswith(API_PREFIX + "/") or path in (STARTUP_PATH, LOGIN_PATH):
        return None
    if bearer_ok(p, headers) or cookie_ok(p, headers):
        return None
    if scope.get("method") == "GET" and "text/html" in headers.get("accept", ""):
        return login_page(401)
    return _error(401, "Aerie needs its key: open the page in a browser and enter it, or send "
                       "'Authorization: Bearer KEY'.")


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "access_error", "code": status}}, status_code=status,
                        headers=headers)


def login_page(status: int, wrong: bool = False) -> HTMLResponse:
    note = "<p role='alert'>That is not the key Aerie was started with.</p>" if wrong else ""
    body = (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>Aerie: key</title>"
            "<meta name='viewport' content='width=device-width'></head>"
            "<body style='font-family:system-ui,sans-serif;max-width:26rem;margin:18vh auto;padding:0 1rem'>"
            "<h1>Aerie</h1><p>This Aerie was started with an API key. Enter it to open the chat.</p>"
            f"{note}<form method='post' action='{html.escape(LOGIN_PATH)}'>"
            "<input type='password' name='key' autofocus required aria-label='API key' "
            "style='width:100%;padding:.5rem;box-sizing:border-box'>"
            "<button type='submit' style='margin-top:.75rem;padding:.5rem 1rem'>Open</button></form></body></html>")
    return HTMLResponse(body, status_code=status, headers={"Cache-Control": "no-store"})


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The request body, or None when it is longer than `limit`."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if len(body) > limit:
            return None
        if not message.get("more_body", False):
            return body


class LoginThrottle:
    """After LOGIN_TRIES wrong keys within LOGIN_WINDOW_S, every try waits until the oldest of them
    is that old: a guesser gets five keys a minute, not thousands a second."""

    def __init__(self, clock=time.monotonic):
        self.clock, self.wrong = clock, deque()

    def wait_s(self) -> float:
        now = self.clock()
        while self.wrong and now - self.wrong[0] >= LOGIN_WINDOW_S:
            self.wrong.popleft()
        return LOGIN_WINDOW_S - (now - self.wrong[0]) if len(self.wrong) >= LOGIN_TRIES else 0.0

    def failed(self) -> None:
        self.wrong.append(self.clock())


async def login(scope: Scope, receive: Receive, p: Policy, throttle: LoginThrottle) -> Response:
    """The login form's POST: the right key sets the page's cookie and opens the page."""
    if p.key is None:
        return RedirectResponse("/", status_code=303)
    if (wait := throttle.wait_s()) > 0:
        return _error(429, f"Too many wrong keys: try again in {wait:.0f} s.", {"Retry-After": f"{wait:.0f}"})
    body = await read_body(receive, MAX_LOGIN_BYTES)
    given = parse_qs((body or b"").decode("utf-8", "replace")).get("key", [""])[0]
    if not secrets.compare_digest(given.encode(), p.key.encode()):
        throttle.failed()
        return login_page(401, wrong=True)
    response = RedirectResponse("/", status_code=303)
    # HttpOnly: no script reads it; SameSite=Strict: no other site's request carries it.
    response.set_cookie(p.cookie, p.cookie_value(), httponly=True, samesite="strict", path="/")
    return response


class GuardMiddleware:
    """Starlette middleware: `Middleware(GuardMiddleware, policy=...)` in the app's middleware."""

    def __init__(self, app: ASGIApp, policy: Policy):
        self.app, self.policy = app, policy
        self.throttle = LoginThrottle()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        denied = refusal(scope, self.policy)
        if denied is not None and scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        if denied is None and scope["type"] == "http" and scope["path"] == LOGIN_PATH:
            denied = await login(scope, receive, self.policy, self.throttle) if scope["method"] == "POST" else login_page(200)
        if denied is not None:
            await denied(scope, receive, send)
            return
        await self.app(scope, receive, send)


def guard(host: str, port: int, key: str | None, origins: tuple[str, ...] = ()) -> Middleware:
    """The middleware entry for the app served on `host`:`port` (FastAPI's `middleware=`)."""
    return Middleware(GuardMiddleware, policy=policy(host, port, key, origins))
