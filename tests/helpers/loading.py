"""In-process loaders over tiny shards, and a quiet local HTTP server for them."""

from __future__ import annotations

import http.server

from wdsdist.data.options import LoaderConfig


def cfg(**kw):
    base = dict(batch_size=4, workers=0, mode="epoch", image_size=8, with_keys=True, shuffle_buffer=0)
    return LoaderConfig(**(base | kw))


def keys_and_bad(loader):
    keys, bad = [], [0, 0]
    for b in loader:
        keys += b["key"]
        bad[0] += int(b["bad"][:, 0].sum())
        bad[1] += int(b["bad"][:, 1].sum())
    return keys, bad


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass
