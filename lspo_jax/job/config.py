"""The run's whole config: the core sections of ``train_config`` and each method's own section, composed here, on
the top floor, where the methods are known. ``load_config`` is the one the commands read a run with."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lspo_jax import train_config
from lspo_jax.job import config_io
from lspo_jax.methods.first_mistake.config import FirstMistakeConfig
from lspo_jax.methods.l2rr import config as l2rr_config
from lspo_jax.methods.l2rr.config import L2RRConfig


@dataclasses.dataclass(frozen=True)
class RunConfig(train_config.TrainConfig):
    """``TrainConfig`` with the methods' sections: ``first_mistake`` (token advantages from a teacher's judgment)
    and ``l2rr`` (a learned prompt sampler), each off by default."""

    first_mistake: FirstMistakeConfig = dataclasses.field(default_factory=FirstMistakeConfig)
    l2rr: L2RRConfig = dataclasses.field(default_factory=L2RRConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        l2rr_config.check_run(self)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """A run's config from a YAML file (None: the defaults) and dotted overrides, every section included."""
    return config_io.load_config(path, overrides, cls=RunConfig)
