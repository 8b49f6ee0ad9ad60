"""wds-distributed: train image classifiers from WebDataset shards on many GPUs and nodes."""

from wdsdist.errors import UserError

__all__ = ["UserError"]
