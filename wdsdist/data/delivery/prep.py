"""A worker's samples made ready for their batch: each with its own random draws, at the size of
the batch it goes into.

Draws: torch's generator is seeded with the sample's own seed (seeds.sample_draws: the run's
seed, the epoch and the sample's position, or its place in the worker's stream) before its crop,
flip and augmentations are drawn. So a sample's pixels depend on the sample alone: a resumed run,
one resumed on another number of ranks or workers (split=samples), and one that skipped a bad
sample before it all draw the same for it. In a DataLoader worker the generator is the worker's
own; in the caller's process (workers=0) its state is put back after each sample.

Sizes (loader.size_schedule): in epoch mode a sample's epoch gives its size. Otherwise a worker
makes whole batches of its rows in turn, and the DataLoader takes batches from its workers in
turn, from its worker 0, for the whole run: the ``r``-th row of physical worker ``p`` goes into
the rank's batch ``start + (r // batch_size) * workers + p``, ``start`` being the batches the
run had taken when this stream began (``Loader.steps``). Rows are counted as they are made,
and a row's size is chosen when its draws are made, which comes after every row before it is
made (the warm start prepares its first batch's rows ahead, all of batch 0).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from wdsdist.data.decode.draws import CropDraw, whole_image
from wdsdist.data.decode.jpegcrop import crop_decoder
from wdsdist.data.decode.sample import make_augment, make_transform, prepare_sample
from wdsdist.data.options import LoaderConfig
from wdsdist.data.plan import seeds


class SamplePrep:
    """``prep(sample, seq, pos)`` -> what prepare_sample returns for it, drawn from the sample's
    own seed, at its batch's size. ``rows``: the rows made so far in this iteration (the
    worker's stream adds them)."""

    def __init__(self, cfg: LoaderConfig, rank: int, physical: int, nworkers: int, start: int, in_worker: bool) -> None:
        self.cfg, self.rank, self.physical, self.nworkers, self.start = cfg, rank, physical, nworkers, start
        self.in_worker = in_worker
        self.rows = 0
        self._sized: dict[int, tuple[Callable, bool]] = {}

    def size_at(self, epoch: int) -> int:
        """The size of the batch the next row goes into."""
        cfg = self.cfg
        if not cfg.size_schedule:
            return cfg.image_size
        batch = self.start + (self.rows // cfg.batch_size) * self.nworkers + self.physical
        at = epoch if cfg.mode == "epoch" else batch
        return [size for first, size in cfg.size_schedule if first <= at][-1]

    def _prepare(self, size: int) -> tuple[Callable, bool]:
        """prepare_sample for one size, and whether it decodes JPEG regions (made once per size)."""
        if size not in self._sized:
            cfg = self.cfg
            transform = make_transform(cfg, size)
            crop = crop_decoder(transform, cfg.decode_downscale) if cfg.train and cfg.decode_region else None
            draw = None  # decode=gpu: JPEGs leave undecoded with their draws (decode/gpu.py)
            if cfg.decode == "gpu":
                draw = CropDraw(*transform.transforms) if cfg.train else whole_image
            augment = make_augment(cfg, size)
            prepare = functools.partial(
                prepare_sample, cfg=cfg, transform=transform, crop=crop, draw=draw, augment=augment, size=size
            )
            self._sized[size] = (prepare, crop is not None and draw is None)
        return self._sized[size]

    @property
    def regions(self) -> bool:
        """Whether the first batch's JPEGs are decoded as regions (the warm start's threads make those)."""
        return self._prepare(self.size_at(0))[1]

    def __call__(self, sample: dict, epoch: int, worker: int, seq: int, pos: int) -> Callable:
        prepare = self._prepare(self.size_at(epoch))[0]
        if not self.cfg.train:  # evaluation draws nothing
            return prepare(sample)
        seed = seeds.sample_draws(self.cfg.seed, epoch, pos if pos >= 0 else (self.rank, worker, seq))
        if self.in_worker:  # the worker's own generator
            torch.default_generator.manual_seed(seed)
            return prepare(sample)
        state = torch.get_rng_state()
        torch.default_generator.manual_seed(seed)
        try:
            return prepare(sample)
        finally:
            torch.set_rng_state(state)
