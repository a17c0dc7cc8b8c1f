"""A vLLM engine's surroundings, set before it starts: a model its CPU attention cannot run refused early
(``check_model``), and its log lines sent to the run directory (``route_logs``)."""

from __future__ import annotations

import json
import logging
import os
import sys

from lspo_jax.config import ModelConfig


def check_model(config: ModelConfig) -> None:
    """Refuse, before an engine starts, a model that vLLM's CPU attention cannot run (it would fail deep inside
    engine start-up, after the rest of the run has loaded). On a GPU vLLM picks a backend that fits."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if config.head_dim not in sizes:
        raise ValueError(f"vLLM's CPU attention does not support head_dim {config.head_dim} (it supports "
                         f"{', '.join(map(str, sizes))}); use rollout.engine: jax")  # fmt: skip


def route_logs(path: str) -> None:
    """Send vLLM's log lines to ``path`` (a file in the run directory) and only its errors to the console, where
    its INFO and WARNING lines would break into the progress bar.

    vLLM applies its logging config at import and again when an engine starts; a config file of its own
    (``VLLM_LOGGING_CONFIG_PATH``, written beside ``path``) is the setting both of them read.
    """
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
        "handlers": {
            "file": {"class": "logging.FileHandler", "filename": os.path.abspath(path), "formatter": "plain"},
            "console": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "level": "ERROR"},
        },
        "loggers": {"vllm": {"handlers": ["file", "console"], "level": "INFO", "propagate": False}},
    }
    config_path = os.path.splitext(path)[0] + "_logging.json"
    with open(config_path, "w") as f:
        json.dump(config, f, indent=1)
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = config_path
    # The same for the loggers vLLM has already made, by hand: dictConfig here would close every handler of the
    # process, the user's own included.
    logger = logging.getLogger("vllm")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    to_file = logging.FileHandler(os.path.abspath(path))
    to_file.setFormatter(logging.Formatter(config["formatters"]["plain"]["format"]))
    to_console = logging.StreamHandler(sys.stderr)
    to_console.setLevel(logging.ERROR)
    for handler in (to_file, to_console):
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
