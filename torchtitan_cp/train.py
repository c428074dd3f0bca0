"""Entry point: ``torchrun ... -m torchtitan_cp.train --config_file configs/NAME.toml [--a.b v]``.

Precedence: command line > TOML > recipe defaults (``torchtitan_cp.trainer.trainer.recipe_config``).

``--check [--nproc N] [--nnodes M]`` validates the configuration for a launch of N processes
per node (``auto``: one per GPU, else 2) on M nodes (default 1) in this one process, prints N and
exits: 0 when the launch can start, 2 with one line on stderr when not. ``./scripts/train.sh``
runs it before torchrun. Every rank of a real launch runs the same validation
(``torchtitan_cp.trainer.validate``) before building the trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import io
import logging
import os
import re
import sys
import traceback
from typing import Any

from torchtitan_cp.data.jsonl import DataError
from torchtitan_cp.run.errors import LAUNCHER_ENV, RUN_INFO_ENV
from torchtitan_cp.trainer.config import (
    ConfigError,
    allowed_text,
    apply_table,
    field_annotation,
    literal_values,
    read_toml,
    split_config_file,
)

DEFAULT_CONFIG = "configs/debug_cpu.toml"


def load_config(argv: list[str]):
    """Recipe defaults, then the TOML file, then the command line (tyro, as torchtitan does)."""
    import tyro
    from torchtitan.config.manager import ConfigManager, custom_registry

    from torchtitan_cp.trainer.trainer import recipe_config

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
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            config = tyro.cli(
                type(config),
                args=rest,
                default=config,
                registry=custom_registry,
                description=description,
            )
    except SystemExit as e:
        if e.code:  # tyro's boxed error message, folded into one line
            message = _one_line(captured.getvalue())
            message = _choice_message(message, type(config))
            stray = re.fullmatch(r"Unrecognized options: ([^-\s]\S*)", message)
            if stray:  # a positional argument: most often a config file without the flag
                message = (
                    f"unexpected argument {stray[1]!r}; a config file is passed as "
                    f"--config_file {stray[1]}"
                )
            raise ConfigError(f"command line: {message}") from None
        sys.stderr.write(captured.getvalue())
        raise
    except (AssertionError, ValueError) as e:
        # A section's own __post_init__ check (torchtitan asserts some): name the section.
        if isinstance(e, ConfigError):
            raise
        section = _failing_section(e, config)
        raise ConfigError(f"{section}{e}" if section else str(e)) from None
    sys.stderr.write(captured.getvalue())
    # Validate the model recipe now so a bad flavor or layer letter fails before any process
    # group is created.
    from torchtitan_cp.trainer.compile import check_compile
    from torchtitan_cp.trainer.validate import check_model

    spec, _ = check_model(config)
    check_compile(config, spec.model)
    return config


def _failing_section(exc: BaseException, config: Any) -> str:
    """``"[validator] "`` when ``exc`` came from the ``__post_init__`` of the config section at
    that path (found by type in ``config``), else ``""``."""
    failing, tb = None, exc.__traceback__
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if tb.tb_frame.f_code.co_name == "__post_init__" and dataclasses.is_dataclass(obj):
            failing = type(obj)
        tb = tb.tb_next
    if failing is None:
        return ""

    def find(node: Any, prefix: str) -> str | None:
        for f in dataclasses.fields(node):
            child = getattr(node, f.name, None)
            if dataclasses.is_dataclass(child) and not isinstance(child, type):
                path = f"{prefix}{f.name}"
                if type(child) is failing:
                    return path
                found = find(child, f"{path}.")
                if found:
                    return found
        return None

    path = find(config, "")
    return f"[{path}] " if path else ""


def _choice_message(message: str, cls: type) -> str:
    """tyro's "invalid choice 'x' for argument '--a.b-c'. Expected one of (...)" (its order
    changes between runs) as ``--a.b_c must be one of ...`` in the key's declared order, the
    TOML error's order."""
    found = re.match(r"invalid choice (.*) for argument '--([\w.-]+)'\.", message)
    if not found:
        return message
    dotted = found[2].replace("-", "_")
    enum = literal_values(field_annotation(cls, dotted))
    if enum is None:
        return message
    return f"--{dotted} must be one of {allowed_text(*enum)}, got {found[1]}"


def _one_line(box: str) -> str:
    """tyro's error box (title, message, sections split by rules) as one line: the message,
    plus the first suggestion of a "Perhaps you meant" section. Box characters differ with the
    terminal, so only the rules between sections are relied on."""
    sections: list[list[str]] = [[]]
    boxed = False  # a top border holds the title
    for raw in box.splitlines():
        line = raw.strip().strip("│|").strip()  # rich draws ASCII boxes on non-UTF-8 streams
        if not line or line[0] in "╭╰+":
            boxed = boxed or line[:1] in ("╭", "+")
            continue
        if set(line) <= set("─━-= "):
            sections.append([])
            continue
        sections[-1].append(line)
    texts = [" ".join(section) for section in sections if section]
    # Without a box (stderr not a terminal, or not UTF-8) the title is a section of its own:
    # skip it. (Found by tests/test_failure_modes.py: an invalid choice, whose message has no
    # colon, came out as "command line: Invalid choice", its title.)
    if not boxed and len(texts) > 1:
        texts = texts[1:]
    message = next((t for t in texts if ":" in t), texts[0] if texts else "invalid arguments")
    for section in sections[1:]:
        if len(section) > 1 and section[0].startswith("Perhaps you meant"):
            message += f" (did you mean {section[1].split()[0]}?)"
            break
    return message


def _split_launch_args(argv: list[str]) -> tuple[bool, str, str, list[str]]:
    """Pull ``--check``, ``--nproc N`` and ``--nnodes M`` (not trainer options) out of
    ``argv``; returns (check, N, M, the rest)."""
    check, values, rest = False, {"--nproc": "auto", "--nnodes": "1"}, []
    i = 0
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        if a == "--check":
            check = True
        elif a in values:
            if i + 1 >= len(argv):
                raise ConfigError(f"{a} needs a number")
            values[a] = argv[i + 1]
            i += 1
        elif name in values:
            values[name] = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return check, values["--nproc"], values["--nnodes"], rest


def _single_process_defaults() -> None:
    """Without torchrun, run as a world of one process instead of failing in rendezvous."""
    if "RANK" in os.environ:
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    for key, value in env.items():
        os.environ.setdefault(key, value)


def _record_for_torchrun(line: str, callstack: str | None = None) -> None:
    """Under torchrun, write this worker's error file, which torchrun then shows as the root
    cause: the one-line message (replacing the traceback torchtitan's ``@record`` may have left
    there), or with ``callstack`` a traceback, as ``@record`` writes it."""
    import json
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {
            "message": line,
            "extraInfo": {"py_callstack": callstack or line, "timestamp": str(int(time.time()))},
        }
    }
    # Written aside, then renamed over the file: torchrun stops the other ranks (SIGTERM) when
    # one fails, and a rank stopped between truncating and writing its error file left it empty,
    # which torchrun's failure report then failed to parse (JSONDecodeError: no root cause).
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        pass


def _write_run_info(config: Any) -> None:
    """Under the recipe's launcher, on each node's local rank 0: where this run keeps its
    checkpoints (None: checkpointing off), for the launcher's line when a signal stops it."""
    import json

    path = os.environ.get(RUN_INFO_ENV)
    if not path or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    ckpt = config.checkpoint
    folder = os.path.abspath(os.path.join(config.dump_folder, ckpt.folder))
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump({"checkpoint_folder": folder if ckpt.enable else None}, f)
        os.replace(tmp, path)
    except OSError:  # the launcher then says less: nothing of the run depends on it
        pass


def _fail(line: str) -> None:
    """Report a one-line error of this rank: stderr (unless the launcher prints it) and the
    torchrun error file."""
    if not os.environ.get(LAUNCHER_ENV):
        print(line, file=sys.stderr)
    _record_for_torchrun(line)


def main(argv: list[str] | None = None) -> int:
    from torchtitan_cp import compat

    try:  # before any torchtitan import, which fails on an older torch
        compat.require_torch(compat.LIBRARY_TORCH_FLOOR, "the trainer (torchtitan 0.3.0)")
        # torchtitan 0.3.0's shims (on torch < 2.14 also the names torchtitan imports), before
        # any of torchtitan's trainer code runs.
        compat.apply()
    except compat.TorchVersionError as e:
        print(f"torchtitan_cp.train: error: {e}", file=sys.stderr)
        return 2
    from torchtitan.tools.logging import init_logger, logger

    from torchtitan_cp.trainer.validate import (
        mesh_text,
        parse_nnodes,
        parse_nproc,
        pipeline_text,
        validate,
    )

    args = list(sys.argv[1:] if argv is None else argv)
    check = False
    try:
        check, nproc_text, nnodes_text, args = _split_launch_args(args)
        nnodes = parse_nnodes(nnodes_text)
        if check and nproc_text not in ("", "auto"):
            parse_nproc(nproc_text, device_type="cpu")  # a bad NPROC fails before the imports
        if check:
            # The check's output is the verdict alone: torchtitan's config warnings (also shown
            # by the run itself) would bury it.
            logging.disable(logging.WARNING)
        else:
            init_logger()
        config = load_config(args)
        device_type = compat.device_type()
        if check:
            nproc = parse_nproc(nproc_text, device_type=device_type)
            validate(config, nproc * nnodes, device_type, local_world_size=nproc)
            # stdout is the process count train.sh reads; the mesh is for the reader.
            print(f"[mesh] {mesh_text(config, nproc * nnodes)}", file=sys.stderr)
            stages = pipeline_text(config, nproc * nnodes)
            if stages is not None:
                print(f"[pipeline] {stages}", file=sys.stderr)
            print(nproc)
            return 0
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        # The data files were scanned by --check (or are checked by the loader when they fail).
        validate(config, world, device_type, local_world_size=local_world, scan_data=False)
        _write_run_info(config)
    except (ConfigError, ValueError) as e:
        line = f"torchtitan_cp.train: error: {e}"
        if check:
            print(line, file=sys.stderr)
        else:
            _fail(line)
        return 2
    finally:
        if check:
            logging.disable(logging.NOTSET)

    import torch

    # A rank killed by a fatal signal (a segfault or an abort in C++: gloo, NCCL, a compiled
    # kernel) leaves no traceback and no torchrun error file; its Python stacks, every
    # thread's, on its stderr are then all that names where it died (launch.py shows them).
    faulthandler.enable(all_threads=True)
    _single_process_defaults()

    from torch.distributed.checkpoint.api import CheckpointException

    from torchtitan_cp.run import rank_timeout
    from torchtitan_cp.run.errors import RunError

    trainer = None
    try:
        trainer = config.build()
        if config.checkpoint.create_seed_checkpoint:
            # One unsharded initialisation that runs of any sharding can start from.
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    except (RunError, ConfigError, DataError) as e:
        # A bad value or data file every rank meets alike, a busy dump folder, an unusable
        # checkpoint, a loss spike: one line, no traceback.
        if trainer is not None:
            trainer.close()
        _fail(f"torchtitan_cp.train: error: {e}")
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return getattr(e, "exit_code", 2)
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        if not rank_timeout.is_timeout(e) or not torch.distributed.is_initialized():
            if trainer is not None:
                trainer.close()
            raise
        # Another rank stopped answering: name it (its peers' groups are broken now, so no
        # clean shutdown of the process group).
        started = trainer is not None and trainer.step > 0
        key = "comm.train_timeout_seconds" if started else "comm.init_timeout_seconds"
        seconds = config.comm.train_timeout_seconds if started else config.comm.init_timeout_seconds
        err = rank_timeout.timeout_error(
            torch.distributed.get_rank(),
            torch.distributed.get_world_size(),
            key=key,
            seconds=seconds,
        )
        _fail(f"torchtitan_cp.train: error: {err}")
        return err.exit_code
    else:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        logger.info("Process group destroyed")
    return 0


def run_worker(argv: list[str] | None = None) -> int:
    """``main`` as a launched process runs it: an exception that escapes it, outside torchtitan's
    ``@record``-ed ``train`` (building the trainer, closing it, the process group's teardown)
    or one ``@record`` lets through (DCP's ``CheckpointException``, a load that raised), is
    printed and written to torchrun's error file as ``@record`` writes it, and the status is
    1. Without this, torchrun's report named no error for that rank ("To enable traceback
    see ..."), and ``train.sh``, which shows rank 0's output only, showed none at all; and the
    rank would leave through interpreter finalization, where gloo's threads can abort it."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return main(argv)
    # DCP's CheckpointException (a load or save that failed on a rank) is a BaseException,
    # which neither torchtitan's @record nor an ``except Exception`` records: torchrun then
    # reported "error_file: <N/A>" for a rank that raised.
    except (Exception, CheckpointException) as e:
        callstack = traceback.format_exc()
        print(callstack, file=sys.stderr, end="", flush=True)
        _record_for_torchrun(f"{type(e).__name__}: {e}", callstack)
        return 1


if __name__ == "__main__":
    from torchtitan_cp.run.process_exit import exit_process

    exit_process(run_worker())
