"""Bearer-token auth: with an api key configured, every route but /health needs `Authorization: Bearer <key>`.

One ASGI middleware, installed the same way on the embedded app and on vLLM's app, rather than a
route dependency: it must also guard the routes vLLM registers itself (built before we see its app),
and it answers before any body is read, so a request without the key is a 401 whatever else is wrong
with it. CORS preflights (OPTIONS) pass, as browsers send them without credentials.
"""

from __future__ import annotations

import secrets

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from asyncrl.inference.api.errors import error_response

UNGUARDED_PATHS = frozenset({"/health"})


def install_auth(app: FastAPI, api_key: str | None) -> None:
    """Guard `app` with `api_key` (None: no auth)."""
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)


class BearerAuth:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._allowed(scope):
            return await self.app(scope, receive, send)
        response = error_response(401, "Invalid or missing API key (send 'Authorization: Bearer <key>')")
        await response(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        if scope["path"] in UNGUARDED_PATHS or scope["method"] == "OPTIONS":
            return True
        return secrets.compare_digest(_bearer_token(scope), self.api_key)


def _bearer_token(scope: Scope) -> bytes:
    header = dict(scope["headers"]).get(b"authorization", b"")
    scheme, _, token = header.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""
