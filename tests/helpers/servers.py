"""Local HTTP servers for the tests that read shards over http: one per call, on 127.0.0.1 and a
free port, served on a thread, shut down and closed when the test is done."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
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


class CountingStore(http.server.SimpleHTTPRequestHandler):
    """A store of the files under its folder (``directory``), whole (200) or the one byte range a
    ``Range: bytes=A-B`` header asks for (206), as object stores answer; ``sent`` counts the body
    bytes each path was sent. Make a class per store with its own ``sent`` (``counting_store``)."""

    sent: dict[str, int]
    lock = threading.Lock()

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        root = Path(self.directory).resolve()
        path = (root / self.path.lstrip("/").partition("?")[0]).resolve()
        if root not in path.parents or not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        first, last, want = 0, len(data) - 1, self.headers.get("Range")
        if want:
            a, _, b = want.removeprefix("bytes=").partition("-")
            first, last = int(a), min(int(b) if b else len(data) - 1, len(data) - 1)
        body = data[first : last + 1]
        self.send_response(206 if want else 200)
        if want:
            self.send_header("Content-Range", f"bytes {first}-{last}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            return  # the client hung up after the part it needed: what it did not take was not sent
        with self.lock:
            self.sent[self.path] = self.sent.get(self.path, 0) + len(body)


def counting_store(root: Path) -> tuple[Callable[..., Any], dict[str, int]]:
    """A handler serving ``root`` as a CountingStore of its own, and the dict it counts in."""
    sent: dict[str, int] = {}
    handler = type("Store", (CountingStore,), {"sent": sent})
    return lambda *a: handler(*a, directory=str(root)), sent
