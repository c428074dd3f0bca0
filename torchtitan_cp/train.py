"""Entry point: ``torchrun ... -m torchtitan_cp.train --config_file configs/NAME.toml [--a.b v]``.

Precedence: command line > TOML > recipe defaults (``torchtitan_cp.trainer.recipe_config``).
"""

from __future__ import annotations

import os
import sys

from torchtitan_cp.config import ConfigError, apply_table, read_toml, split_config_file

DEFAULT_CONFIG = "configs/debug_cpu.toml"


def load_config(argv: list[str]):
    """Recipe defaults, then the TOML file, then the command line (tyro, as torchtitan does)."""
    import tyro
    from torchtitan.config.manager import ConfigManager, custom_registry

    from torchtitan_cp.trainer import recipe_config

    path, rest = split_config_file(argv, DEFAULT_CONFIG)
    config = recipe_config()
    if path:
        table = read_toml(path)
        apply_table(config, table, where=path)
    ConfigManager.register_tyro_rules(custom_registry)
    description = (
        "Train a hybrid KDA/GDN/attention model. --config_file PATH.toml sets any option below "
        f"(default {DEFAULT_CONFIG}); flags given here override the file."
    )
    config = tyro.cli(
        type(config), args=rest, default=config, registry=custom_registry, description=description
    )
    # Validate the model recipe now so a bad flavor or layer letter fails before any process
    # group is created.
    from torchtitan_cp.trainer import check_model

    check_model(config)
    return config


def _single_process_defaults() -> None:
    """Without torchrun, run as a world of one process instead of failing in rendezvous."""
    if "RANK" in os.environ:
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    for key, value in env.items():
        os.environ.setdefault(key, value)


def main(argv: list[str] | None = None) -> int:
    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    try:
        config = load_config(sys.argv[1:] if argv is None else argv)
    except (ConfigError, ValueError) as e:
        print(f"torchtitan_cp.train: error: {e}", file=sys.stderr)
        return 2

    import torch

    _single_process_defaults()

    if config.checkpoint.create_seed_checkpoint:
        if int(os.environ.get("WORLD_SIZE", "1")) != 1 or not config.checkpoint.enable:
            print(
                "torchtitan_cp.train: error: --checkpoint.create_seed_checkpoint needs one "
                "process and --checkpoint.enable",
                file=sys.stderr,
            )
            return 2
    trainer = None
    try:
        trainer = config.build()
        if config.checkpoint.create_seed_checkpoint:
            # One unsharded initialisation that runs of any sharding can start from.
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    except Exception:
        if trainer is not None:
            trainer.close()
        raise
    else:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        logger.info("Process group destroyed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
