"""PyTorch Lightning on the loader: ``WdsDataModule``, imported only where it is used.

    dm = WdsDataModule("data/train.index.json", LoaderConfig(mode="epoch", batch_size=64), val_shards=...)
    trainer = pytorch_lightning.Trainer(strategy="ddp", devices=2, use_distributed_sampler=False)
    trainer.fit(model, datamodule=dm, ckpt_path=...)  # resumes the loader exactly, also on other devices

Nothing else in wdsdist imports this module (``import wdsdist.data`` does not import Lightning).
What it does about Lightning 2.6's handling of a stateful loader, as read in its fit loop:

- Lightning writes the checkpoint on global rank 0 only. ``Loader.state_dict()`` holds every
  rank's position (a gather: Lightning builds the checkpoint on every rank, so it runs there).
- Lightning reads ``len()`` before it restores the loader's state, and when
  ``trainer.estimated_stepping_batches`` is read first (an LR scheduler in
  ``configure_optimizers``) it builds the loader before the state is there and never loads it
  (Lightning's issue 20550). The DataModule keeps the loader's position in its own state, which
  Lightning restores before it asks for ``train_dataloader()``, so the Loader is built at its
  saved position either way; the fit loop's later load of the same state rebuilds it there again.
- For a loader without a length (``mode=repeat``, ``resampled``) Lightning fetches one batch ahead,
  so the Loader's position would be one batch ahead of training. The Loader is made with
  ``mark_taken`` and ``on_before_batch_transfer`` marks each training batch taken (a subclass that
  overrides that hook calls ``super()``).
- Lightning caches the number of training batches from the first ``len()``. After a resume on
  another number of devices the epoch under way has its own length (its remaining samples
  re-split) and later epochs the new layout's: then the DataModule sets
  ``trainer.reload_dataloaders_every_n_epochs = 1`` (saying so in one line), so Lightning reads
  ``len()`` again at each epoch (it gets the same Loader back). ``estimated_stepping_batches``
  still counts every epoch at the resumed one's length.
- ``val_dataloader()`` is an ``EvalLoader``: every sample once, so ranks may get different numbers
  of batches. Run no collective per validation step (no ``self.log(..., sync_dist=True)`` there):
  sum on each rank and all-reduce once in ``on_validation_epoch_end`` (examples/lightning_train.py).
  DDP's first forward after training broadcasts buffers (a collective), and Lightning runs
  ``validation_step`` through DDP, so every rank needs a validation shard (checked).

Use ``Trainer(use_distributed_sampler=False)``: the loader splits the data itself. Do not use
``limit_train_batches``: an epoch is what ``len()`` says.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

try:
    import pytorch_lightning as pl
except ImportError as exc:  # the install without the extra
    raise ImportError(
        f"wdsdist.lightning needs PyTorch Lightning: pip install 'wds-distributed[lightning]' ({exc})"
    ) from None

from wdsdist.data import (
    EvalLoader,
    Loader,
    LoaderConfig,
    LoaderMode,
    ShardSpec,
    Source,
    Transform,
    UserError,
    expand_shards,
)

STATE_KEY = "loader"
log = logging.getLogger(__name__)


class WdsDataModule(pl.LightningDataModule):
    """Our ``Loader`` for training and ``EvalLoader`` for validation, built once per fit on each
    rank (rank and world from torch.distributed, which Lightning has set up by then).

    ``train_shards``, ``val_shards``: shard specs as ``Loader`` takes them (``train_shards`` may
    be a list of ``Source``: several data sets, each batch's ``source`` saying whose). ``config``: the
    loader's options (``mode=epoch`` for epochs of equal length on every rank, ``repeat`` with
    ``Trainer(max_steps=N)``). ``transform``: as ``Loader``'s, run in the workers.
    """

    def __init__(
        self,
        train_shards: ShardSpec | Sequence[Source],
        config: LoaderConfig,
        val_shards: ShardSpec | None = None,
        transform: Transform | None = None,
    ):
        super().__init__()
        self.train_shards, self.val_shards = train_shards, val_shards
        self.config, self.transform = config, transform
        self.loader: Loader | None = None  # built by the first train_dataloader()
        self.eval_loader: EvalLoader | None = None
        self._saved: dict | None = None  # a checkpoint's loader state, until the Loader is built

    def train_dataloader(self) -> Loader:
        if self.loader is None:
            has_length = self.config.mode == LoaderMode.epoch
            loader = Loader(self.train_shards, self.config, transform=self.transform, mark_taken=not has_length)
            if self._saved is not None:
                loader.load_state_dict(self._saved, where="the Lightning checkpoint")
                self._saved = None
            self.loader = loader
            if has_length and len(loader) != loader.batches_per_epoch:
                self._reload_every_epoch()
        return self.loader

    def _reload_every_epoch(self) -> None:
        trainer = self.trainer
        if trainer is None or trainer.reload_dataloaders_every_n_epochs == 1:
            return
        if trainer.global_rank == 0:
            log.info(
                "the resumed epoch has its own length (resumed on another number of devices): "
                "setting Trainer(reload_dataloaders_every_n_epochs=1) so that Lightning reads each epoch's len()"
            )
        trainer.reload_dataloaders_every_n_epochs = 1

    def val_dataloader(self) -> EvalLoader | list:
        if self.val_shards is None:
            return []
        if self.eval_loader is None:
            world = self.trainer.world_size if self.trainer is not None else 1
            nshards = len(expand_shards(self.val_shards, self.config))
            if nshards < world:
                raise UserError(
                    f"val_shards: {nshards} shards for {world} ranks: every rank needs one (Lightning runs "
                    f"validation_step through DDP, whose first forward is a collective); write more, smaller shards"
                )
            self.eval_loader = EvalLoader(self.val_shards, self.config)
        return self.eval_loader

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Lightning calls this on the batch its training step is about to use, after fetching the
        # next one; validation batches pass here too and are not the Loader's.
        trainer = self.trainer
        if self.loader is not None and trainer is not None and trainer.training:
            self.loader.taken(batch)
        return batch

    def state_dict(self) -> dict:
        """Every rank's loader position (a collective once the Loader is built: Lightning calls it
        on every rank as it builds a checkpoint)."""
        if self.loader is not None:
            return {STATE_KEY: self.loader.state_dict()}
        return {STATE_KEY: self._saved} if self._saved is not None else {}

    def load_state_dict(self, state_dict: dict) -> None:
        state = state_dict.get(STATE_KEY)
        if state is None:
            return
        if self.loader is not None:
            self.loader.load_state_dict(state, where="the Lightning checkpoint")
        else:
            self._saved = state
