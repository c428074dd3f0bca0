"""The trainer's metrics and logging: torchtitan's ``MetricsProcessor`` plus ``metrics.jsonl``
(``JsonlLogger``: one JSON row per log step at full precision, its history kept by
``run.start``) with the extra metrics the trainer supplies (the routing counters), parameter and
gradient checksums (``[debug] param_checksums``), and wandb without credentials (offline, with
the line saying how to upload the run later).
"""

from __future__ import annotations

import hashlib
import json
import netrc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.components.metrics import (
    BaseLogger,
    LoggerContainer,
    MetricsProcessor,
    _get_metrics_rank,
)
from torchtitan.config import DebugConfig as _TitanDebugConfig
from torchtitan.tools.logging import logger

from torchtitan_cp.run.start import HEADER_KEY, repair_jsonl, supersede_rows

__all__ = [
    "DebugConfig",
    "HybridMetricsProcessor",
    "JsonlLogger",
    "tensors_sha256",
    "wandb_offline_fallback",
]


@dataclass(kw_only=True, slots=True)
class DebugConfig(_TitanDebugConfig):
    param_checksums: bool = False
    """Log ``params_sha256`` (every parameter after the optimizer step, gathered to rank 0)
    and ``grads_sha256`` (the step's gradients) at each log step, to compare runs bit for bit."""


def tensors_sha256(model_parts: list[torch.nn.Module], *, grads: bool) -> str:
    """SHA-256 over every parameter's (or its gradient's) full value, in name order.
    Collective under FSDP: every rank must call it."""
    h = hashlib.sha256()
    for part in model_parts:
        for name, p in sorted(part.named_parameters(), key=lambda kv: kv[0]):
            t = p.grad if grads else p
            if t is None:
                continue
            t = t.full_tensor() if isinstance(t, DTensor) else t
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class JsonlLogger(BaseLogger):
    """One JSON object per log call in ``<dump_folder>/metrics.jsonl``; floats at full
    precision (``json`` writes ``repr``), for scripts and bitwise comparisons. ``start_run``
    moves rows past the resume step aside and writes the run's header line (see runs.py)."""

    ALIASES = {
        "loss_metrics/global_avg_loss": "loss",
        "grad_norm": "grad_norm",
        "throughput(tps)": "tokens_per_s",
        "validation_metrics/loss": "validation_loss",
    }

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        # Opened by start_run (or the first log), after the checkpoint load.
        self._f: IO[str] | None = None

    def start_run(self, header: dict[str, Any], resumed_from: int) -> None:
        repaired = repair_jsonl(self.path, header[HEADER_KEY]["run_id"])
        if repaired:
            logger.warning(repaired)
        moved = supersede_rows(self.path, resumed_from)
        if moved:
            logger.info(
                f"Moved {moved} rows past step {resumed_from} from {self.path} to its "
                ".superseded.jsonl: this run replaces them"
            )
        self._open().write(json.dumps(header) + "\n")

    def _open(self) -> IO[str]:
        if self._f is None:
            self._f = open(self.path, "a", buffering=1)  # noqa: SIM115 - kept open for the run
        return self._f

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row: dict[str, Any] = {"step": step}
        for k, v in metrics.items():
            if k in self.ALIASES:
                row[self.ALIASES[k]] = v
            if k.startswith("lr"):
                row.setdefault("lr", v)
            row[k] = v
        self._open().write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def _has_wandb_credentials() -> bool:
    """Whether wandb will find credentials: the environment, a netrc entry for its host, or an
    api_key in wandb's settings file (the places ``wandb login`` writes)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    home = Path("~").expanduser()
    candidates = [os.environ.get("NETRC", ""), home / ".netrc", home / "_netrc"]
    for path in filter(None, candidates):
        if Path(path).is_file():
            try:
                if netrc.netrc(str(path)).authenticators(host):
                    return True
            except (netrc.NetrcParseError, OSError):
                return True  # wandb reads it its own way: do not second-guess
    config_dir = Path(os.environ.get("WANDB_CONFIG_DIR", home / ".config" / "wandb"))
    try:
        return "api_key" in (config_dir / "settings").read_text()
    except OSError:
        return False


def wandb_offline_fallback(offline_runs: str) -> str | None:
    """With wandb logging online but no credentials, set ``WANDB_MODE=offline`` (wandb would
    otherwise prompt or fail inside the run) and return the line saying so and how to upload
    the run later (``offline_runs``: where its offline runs land); None when nothing changes."""
    if os.environ.get("WANDB_MODE", "online") not in ("online", "run", ""):
        return None
    if _has_wandb_credentials():
        return None
    os.environ["WANDB_MODE"] = "offline"
    return (
        "wandb: no credentials (WANDB_API_KEY, `wandb login` or a netrc entry): logging "
        f"offline instead; upload the run later with `wandb sync {offline_runs}`"
    )


class HybridMetricsProcessor(MetricsProcessor):
    """torchtitan's metrics plus metrics.jsonl and the extra metrics the trainer supplies."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        jsonl_file: str = "metrics.jsonl"
        """File under dump_folder written by the metrics rank; empty string disables it."""

        wandb_mode: str = ""
        """WANDB_MODE for this run ("offline" leaves a run to `wandb sync` later); empty keeps
        the environment's setting."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        dump_folder = kwargs.get("dump_folder", "./outputs")
        rank = _get_metrics_rank(
            parallel_dims=kwargs["parallel_dims"], pp_schedule=kwargs.get("pp_schedule", "1F1B")
        )
        if config.enable_wandb:
            if config.wandb_mode:
                os.environ["WANDB_MODE"] = config.wandb_mode
            runs = os.path.join(dump_folder, config.save_tb_folder, "*", "wandb", "offline-run-*")
            line = wandb_offline_fallback(runs)
            if line and dist.get_rank() == rank:
                logger.warning(line)
        super().__init__(config, **kwargs)
        self.extra_metrics_fn = None
        self.validation_metrics_fn = None
        self.jsonl: JsonlLogger | None = None
        if config.jsonl_file and dist.get_rank() == rank:
            container = LoggerContainer()
            container.add_logger(self.logger)
            self.jsonl = JsonlLogger(os.path.join(dump_folder, config.jsonl_file))
            container.add_logger(self.jsonl)
            self.logger = container

    def start_run(self, header: dict[str, Any], resumed_from: int) -> None:
        """A new run in metrics.jsonl: earlier rows past ``resumed_from`` move aside, then the
        run's header line (no-op off the metrics rank)."""
        if self.jsonl is not None:
            self.jsonl.start_run(header, resumed_from)

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        extra = dict(extra_metrics or {})
        if self.extra_metrics_fn is not None:
            extra.update(self.extra_metrics_fn())
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)
        if "routing/source" in extra:
            logger.info(
                f"step: {step:2}  routing: {extra['routing/source']}  "
                f"readbacks: {extra['routing/readbacks']}  "
                f"build: {extra['routing/build_ms']:.2f}ms  "
                f"cache: {extra['routing/cache_hits']} hits / {extra['routing/cache_misses']} "
                f"misses / {extra['routing/cache_evictions']} evictions"
            )

    def log_validation(self, loss, step, extra_metrics=None):
        extra = dict(extra_metrics or {})
        if self.validation_metrics_fn is not None:
            extra.update(self.validation_metrics_fn())
        super().log_validation(loss, step, extra_metrics=extra)
