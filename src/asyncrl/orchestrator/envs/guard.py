"""What an env server lets a request do, and how a peer proves it may send one.

An episode's request names the model endpoint the env server's model client then calls (verifiers'
`ClientConfig`: a base URL, the environment variable holding the API key, headers filled from environment
variables). Unchecked, any peer that reaches the server's port could have it send its keys, or any other
variable of its environment, to a URL of the peer's choosing. `Guard.refusal` admits a request only when its
base URL is one the server allows (default: loopback hosts) and every variable it reads is one the server
allows (default: `OPENAI_API_KEY`).

A shared secret (the same environment variable on both sides) turns on ZeroMQ CURVE. The secret derives the
server's key pair and the clients' one, so a peer without it cannot complete the handshake (it cannot know the
server's public key), and every frame on the wire is encrypted. A frame larger than `max_frame` drops its
connection before it is buffered (ZMQ_MAXMSGSIZE), so one peer cannot take the server's memory.

Invariants: a request is checked before its episode builds a model client; the socket options are set before
the socket binds or connects (libzmq copies them into each connection then); the secret never leaves the
environment variable it is read from (no argument, no log line).
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from asyncrl.config.env_server import DEFAULT_KEY_VARS, is_plain_http
from asyncrl.config.orchestrator import SECRET_VAR


class RequestRefused(Exception):
    """A request that asks the env server for more than its configuration allows (one line, no traceback)."""


@dataclass(frozen=True)
class Guard:
    """The model endpoints and environment variables requests may use (picklable: pool workers get it)."""

    allow_urls: tuple[str, ...] = ()  # base URL prefixes; empty: any loopback URL
    allow_key_vars: tuple[str, ...] = DEFAULT_KEY_VARS

    def refusal(self, client: Any) -> str | None:
        """Why a request whose model client is `client` (verifiers' ClientConfig) is refused, or None."""
        if not self.url_allowed(client.base_url):
            allowed = ", ".join(self.allow_urls) or "loopback hosts only"
            return (
                f"its model endpoint {client.base_url} is not one this env server calls ({allowed}); to allow it, "
                f"start the env server with --allow-urls {_origin(client.base_url)}"
            )
        read = [client.api_key_var, *client.headers_from_env.values()]
        for var in read:
            if var not in self.allow_key_vars:
                return (
                    f"it has the env server read the environment variable {var!r}; requests may read "
                    f"{', '.join(self.allow_key_vars)} only (--allow-key-vars)"
                )
        return None

    def url_allowed(self, url: str) -> bool:
        parts = urlsplit(url)
        if not is_plain_http(parts):
            return False
        if not self.allow_urls:
            return is_loopback(parts.hostname)
        return any(_within(parts, urlsplit(allowed)) for allowed in self.allow_urls)


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _port(parts: Any) -> int | None:
    return parts.port or {"http": 80, "https": 443}.get(parts.scheme)


def _within(url: Any, allowed: Any) -> bool:
    same_origin = (url.scheme, url.hostname, _port(url)) == (allowed.scheme, allowed.hostname, _port(allowed))
    return same_origin and url.path.startswith(allowed.path.rstrip("/"))


def secret(var: str = SECRET_VAR) -> str | None:
    """The shared secret from the environment variable `var` (None when unset or empty)."""
    return os.environ.get(var) or None


def _key_pair(secret: str, role: str) -> tuple[bytes, bytes]:
    import zmq
    from zmq.utils import z85

    secret_key = z85.encode(hashlib.sha256(f"asyncrl env-{role}\0{secret}".encode()).digest())
    return zmq.curve_public(secret_key), secret_key


def server_socket_options(secret: str | None, max_frame: int) -> dict[int, Any]:
    """ZMQ options for an env server's bound socket: the frame cap, and CURVE when there is a secret."""
    import zmq

    options: dict[int, Any] = {zmq.MAXMSGSIZE: max_frame}
    if secret is not None:
        options |= {zmq.CURVE_SERVER: 1, zmq.CURVE_SECRETKEY: _key_pair(secret, "server")[1]}
    return options


def client_socket_options(secret: str | None) -> dict[int, Any]:
    """ZMQ options for a client's socket to an env server that has the same secret (none without one)."""
    import zmq

    if secret is None:
        return {}
    public, private = _key_pair(secret, "client")
    return {
        zmq.CURVE_SERVERKEY: _key_pair(secret, "server")[0],
        zmq.CURVE_PUBLICKEY: public,
        zmq.CURVE_SECRETKEY: private,
    }
