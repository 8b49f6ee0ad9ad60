"""In-process loaders over tiny shards, and a quiet local HTTP server for them."""

from __future__ import annotations

import http.server

import torch

from wdsdist.data import Loader
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


def taken(index: str, config: LoaderConfig, n: int | None = None, state: dict | None = None) -> tuple[list, dict]:
    """A rank-0-of-1 Loader's first ``n`` batches (None: all), resumed from ``state`` where given,
    its workers seeded from 0; and its state after them."""
    loader = Loader(index, config, rank=0, world=1)
    if state is not None:
        loader.load_state_dict(state)
    torch.manual_seed(0)  # the workers' seeds come from it
    out = []
    for batch in loader:
        out.append(batch)
        if n is not None and len(out) == n:
            break
    return out, loader.state_dict()


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass
