"""The trainer's config composed as Hydra composes it, through the typed schema."""

from __future__ import annotations

from tests.conftest import ROOT


def compose_config(overrides):
    """The trainer's config composed with these overrides, through its own typed schema."""
    from hydra import compose, initialize_config_dir

    from wdsdist.train import config

    config.register()
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        return compose("train", overrides=overrides)
