"""Scripts the page's HTML carries ahead of Gradio's own: an ASGI middleware on the page's route.

Gradio adds `launch(head=...)` to the page from its own code, once its modules have loaded; a
script that must act before them (app/page_scripts.py FRAME_THROTTLE) has to be in the HTML the
browser parses. A classic inline script runs as it is parsed, and module scripts only after the
whole document is, so the end of <head> is early enough.
"""

import sys

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PAGE_PATH = "/"          # where Gradio serves the page (Aerie's has one page)
HEAD_END = b"</head>"


class PageHead:
    def __init__(self, app: ASGIApp, script: str):
        self.app, self.tag = app, b"<script>" + script.encode() + b"</script>"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "GET" or scope["path"] != PAGE_PATH:
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        parts: list[bytes] = []

        async def held(message: Message) -> None:
            # The head is at the body's start, but the length header goes out first: hold both.
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            parts.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = self.with_script(b"".join(parts), start)
            headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
            await send({**start, "headers": headers + [(b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, held)

    def with_script(self, body: bytes, start: Message) -> bytes:
        """`body` with the script before its </head>, when it is the page's HTML."""
        headers = {k.lower(): v for k, v in start["headers"]}
        if start["status"] != 200 or not headers.get(b"content-type", b"").startswith(b"text/html"):
            return body
        if b"content-encoding" in headers or HEAD_END not in body:
            # Gradio's page changed shape: the page still works, only without the script; say so.
            why = "came compressed" if b"content-encoding" in headers else "has no </head>"
            print(f"Aerie: the page's HTML {why}, so its early script is left out", file=sys.stderr, flush=True)
            return body
        return body.replace(HEAD_END, self.tag + HEAD_END, 1)


def page_head(script: str) -> Middleware:
    """The middleware entry for launch.py: `script` (JavaScript) runs before Gradio's modules."""
    return Middleware(PageHead, script=script)
