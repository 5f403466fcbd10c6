"""A plain HTTP server on a free local port, served from a daemon thread: the fakes and proxies tests put in front
of (or in place of) an engine subclass `LocalHTTP` and give it their request handler class."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LocalHTTP:
    """Serves `handler` on 127.0.0.1 from construction until `close()`; `url` is its OpenAI-style base URL."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_port}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
