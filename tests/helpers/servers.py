"""Local HTTP servers for the tests that read shards over http: one per call, on 127.0.0.1 and a
free port, served on a thread, shut down and closed when the test is done."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any


@contextmanager
def http_server(handler: Callable[..., Any], on_close: Callable[[], None] | None = None) -> Iterator[str]:
    """A ThreadingHTTPServer serving ``handler``; its base URL (http://127.0.0.1:PORT).
    ``on_close`` runs before the shutdown (to release a handler a test left waiting)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        if on_close is not None:
            on_close()
        server.shutdown()
        server.server_close()


class Servers(ExitStack):
    """Many servers for one test (a fixture's factory): ``start`` each, all closed together."""

    def start(self, handler: Callable[..., Any], on_close: Callable[[], None] | None = None) -> str:
        return self.enter_context(http_server(handler, on_close))
