"""``--compile.enable``: fixed routing shapes and the pre-launch check (docs/configuration.md).

torchtitan compiles every block with ``fullgraph=True``. What makes that work here:

* the local kernels run as opaque custom ops while compiling (``ops/<family>/custom_ops.py``),
  the CP collectives as torch's functional collectives (``ops.cp.collectives``), pass-KV
  attention (``model.attention_cp = "pass_kv"``: point-to-point rounds over the host schedule)
  as one custom op that gets the schedule through a handle tensor
  (``ops.pass_kv_attention_op``);
* every routing tensor a block reads has a shape that does not depend on the microbatch's
  document layout: ``RoutingCaps`` pads them (``routing_caps`` below), so a new layout is new
  data for the same graph, never a recompile.

Caps, per CP rank and microbatch of ``B`` rows of ``L`` tokens over ``W`` ranks:

* ``slots`` (fragments of a rank) and ``predecessors`` (earlier pieces of a fragment's
  document) are exact bounds of the load balancer's geometry: ``runs`` contiguous token runs
  per row and rank (``LoadBalancer.runs_per_row``: contiguous 1, head-tail 2, ptrr
  ``ceil(L / (W * ptrr_block_size)) + 1``; 1 without CP), slots = ``B * runs``, predecessors
  = ``W * runs - 1``. No layout can exceed them.
* ``subsequences`` (document pieces on a rank, N) has no useful bound (every token could be a
  document), and it sizes per-layer state buffers ``[N, HV, K, V]`` under CP (KDA 1B: 0.9 MB
  per subsequence and layer in float32), so it is the config key
  ``linear_attention.max_subsequences`` (capped at the tokens per rank); ``terminal`` uses the
  same value. A microbatch with more subsequences stops with an error naming that key.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from torchtitan_cp import compat
from torchtitan_cp.routing import LoadBalancer, RoutingCaps, get_balancer
from torchtitan_cp.trainer.config import ConfigError

__all__ = ["CAP_KEYS", "check_compile", "compile_counters", "routing_caps"]

# The config key behind each cap, for the error a too-large microbatch raises.
CAP_KEYS = {
    "subsequences": "linear_attention.max_subsequences",
    "terminal": "linear_attention.max_subsequences",
    "slots": "(a bug: the slot cap is derived from the load balancer's geometry)",
    "predecessors": "(a bug: the predecessor cap is derived from the load balancer's geometry)",
}


def _runs_per_row(balancer: LoadBalancer, seq_len: int, world: int) -> int:
    """Most contiguous token runs one rank owns in one row."""
    if world == 1:  # without CP no balancer reorders the row
        return 1
    return balancer.runs_per_row(seq_len, world)


def routing_caps(
    *,
    load_balancer: str | LoadBalancer | None,
    batch_size: int,
    seq_len: int,
    cp_degree: int,
    ptrr_block_size: int,
    max_subsequences: int,
) -> RoutingCaps:
    """The ``RoutingCaps`` that fix every routing shape of this run (see module docstring)."""
    balancer = get_balancer(load_balancer, ptrr_block_size=ptrr_block_size)
    runs = _runs_per_row(balancer, seq_len, cp_degree)
    tokens = batch_size * seq_len // cp_degree
    runs = min(runs, max(1, seq_len // cp_degree))
    subs = min(max_subsequences, tokens)
    return RoutingCaps(
        slots=batch_size * runs,
        subsequences=subs,
        predecessors=cp_degree * runs - 1,
        terminal=subs,
    )


def _has_cxx_compiler() -> bool:
    names = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
    return any(n and shutil.which(n) for n in names)


def check_compile(config: Any, model_cfg: Any) -> RoutingCaps | None:
    """The routing caps a compiled model needs, or None without ``compile.enable`` (then the
    routing keeps its exact, layout-dependent shapes). A ConfigError, before any process group
    exists, for a combination that cannot compile."""
    cc = config.compile
    if not cc.enable or "model" not in cc.components:
        return None
    import torch._dynamo

    backends = torch._dynamo.list_backends(exclude_tags=())
    if cc.backend not in backends:
        raise ConfigError(
            f"compile.backend {cc.backend!r} is not a torch.compile backend; use one of "
            f"{', '.join(sorted(backends))}"
        )
    from torchtitan_cp.models.hybrid.layers import LAYERS

    eager_only = [
        c
        for c in dict.fromkeys(getattr(model_cfg, "layer_pattern", ""))
        if c in LAYERS and not LAYERS[c].compiles
    ]
    if eager_only:
        kinds = ", ".join(f"{c} ({LAYERS[c].description})" for c in eager_only)
        raise ConfigError(
            f"compile.enable: model.layer_pattern has layers without torch.compile custom ops: "
            f"{kinds}; use compile.enable = false or other layer letters"
        )
    device = compat.device_type()
    if model_cfg.uses_flex_attention(device) and cc.backend not in ("inductor", "aot_eager"):
        raise ConfigError(
            f"compile.backend {cc.backend!r} cannot compile flex attention (model."
            "attention_backend resolves to flex here): use 'inductor' or 'aot_eager'"
        )
    if device == "cpu" and cc.backend == "inductor" and not _has_cxx_compiler():
        raise ConfigError(
            "compile.enable with compile.backend 'inductor' on CPU needs a C++ compiler (g++, "
            "c++ or clang++, or $CXX); install one or use --compile.backend aot_eager"
        )
    la = config.linear_attention
    par = config.parallelism
    cp = max(1, par.context_parallel_degree)
    caps = routing_caps(
        load_balancer=par.context_parallel_load_balancer,
        batch_size=config.training.local_batch_size,
        seq_len=config.training.seq_len,
        cp_degree=cp,
        ptrr_block_size=la.ptrr_block_size,
        max_subsequences=la.max_subsequences,
    )
    assert caps.slots is not None and caps.subsequences is not None
    if caps.subsequences < caps.slots:
        raise ConfigError(
            f"linear_attention.max_subsequences = {la.max_subsequences} is below the "
            f"{caps.slots} fragments a CP rank can own with this layout (every fragment holds "
            "at least one subsequence); raise it"
        )
    return caps


def compile_counters() -> dict[str, int]:
    """dynamo's running totals: frames compiled (first compiles and recompiles) and graphs."""
    from torch._dynamo.utils import counters

    return {
        "compile/frames": int(counters["frames"]["total"]),
        "compile/graphs": int(counters["stats"]["unique_graphs"]),
    }
