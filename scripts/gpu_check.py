"""GPU evidence for the host routing path, in stages (scripts/gpu_check.sh runs one per call).

Every stage appends one JSON line per finished part to each ``--results`` file, so a stage cut
short by a timeout keeps what it finished. Stages (estimates for an H200 in docs/gpu.md):

* ``path``: the first stage, enough alone to prove the path. The imports of the CUDA path; fla
  against the pure-PyTorch backend at the shapes of the trainer's model (KDA, GDN, conv, forward
  and backward, float32) and the CP gradients of every simulated rank against the unsharded
  computation (KDA, GDN; ``cp_gradient_check``), each in its own process at the same time
  (their Triton compiles and the flex compile fill the on-disk caches the trainer then reads;
  fla's autotune keeps one config per kernel in this stage, ``scripts/gpu_autotune.py``,
  recorded with each part); then the real trainer
  (``configs/debug_cpu.toml``, head_dim 64, 4 steps, one process) with its whole steps 2 and 3
  under ``torch.cuda.set_sync_debug_mode("error")``: the host routing path must not
  synchronise, the readback path and torchtitan 0.3.0's own ``train_step`` must. The log step
  (4) runs in ``"warn"`` mode and lists its synchronisations. A trainer that cannot run on this
  torch says why in one line, and the stage checks the model step instead.
* ``tests``: the CUDA-only tests (pytest).
* ``timing``: fla against torch at the 150M model's shapes in bfloat16, then one step of that
  model at CP=1 on packed documents, host vs readback routing, a new packing every step.
* ``compile``: the same steps with every block ``torch.compile``d (``fullgraph=True``, routing
  padded to fixed caps) against eager: compile time and frames compiled after warm-up (0).

Flex attention is compiled without ``max_autotune`` throughout (torchtitan's default autotunes
for minutes). ``--device cpu`` is the dry run the test suite executes: the same code, the
trainer's steps watched by ``torchtitan_cp.trainer.host_sync.HostSyncRecorder`` instead of CUDA's sync
debug mode, no fla kernels (CUDA only), small shapes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_autotune  # noqa: E402

from torchtitan_cp.data.host_metadata import HostMetadata  # noqa: E402
from torchtitan_cp.models import model_config  # noqa: E402
from torchtitan_cp.trainer.sequence import SequencePreprocessor  # noqa: E402

# The trainer run of the path stage: the debug config, head_dim 64 (the CUDA tests' fla shapes,
# so one autotune serves both stages), a log step only at 1 (warm-up) and 4.
TRAINER_ARGS = (
    "--config_file", str(ROOT / "configs/debug_cpu.toml"), "--model.head_dim", "64",
    "--training.steps", "4", "--metrics.log_freq", "4", "--metrics.no-enable_wandb",
    "--validator.no-enable", "--checkpoint.no-enable",
)  # fmt: skip
STRICT_STEPS = (2, 3)  # must not synchronise on the host path
LOG_STEP = 4
CUDA_TESTS = (
    "tests/test_kernels_fla.py",
    "tests/test_cp_delta_rule.py::test_fla_backend_out_of_order_span",
    "tests/test_cp_flex_attention.py::test_flex_matches_sdpa_on_cuda_forward_and_backward",
    "tests/test_compile.py::test_fla_ops_opcheck_cuda",
    "tests/test_compile.py::test_fla_conv_op_opcheck_cuda",
    "tests/test_qwen35_cuda.py",
    # pass-KV's flex pair backward against the math kernel, float32 and bfloat16.
    "tests/test_pass_kv_schedule.py::test_flex_pair_kernel_block_gradients_match_the_math_kernel_on_cuda",
)


class Results:
    """Appends one JSON line per finished part to every file given (created as needed)."""

    def __init__(self, paths: list[str], stage: str, device: str) -> None:
        self.paths = [Path(p) for p in paths]
        self.stage = stage
        self.device = device
        self.ok = True
        for p in self.paths:
            p.parent.mkdir(parents=True, exist_ok=True)

    def add(self, part: str, ok: bool, seconds: float, **data: Any) -> None:
        self.ok &= ok
        row = {"stage": self.stage, "part": part, "ok": ok, "seconds": round(seconds, 1),
               "device": self.device, "torch": torch.__version__, **data}  # fmt: skip
        line = json.dumps(row, default=str)
        for p in self.paths:
            with open(p, "a") as f:
                f.write(line + "\n")
        print(f"gpu_check: {self.stage}/{part}: {'ok' if ok else 'FAILED'} ({seconds:.0f} s)")


@contextlib.contextmanager
def timed() -> Iterator[Callable[[], float]]:
    t0 = time.perf_counter()
    yield lambda: time.perf_counter() - t0


def no_flex_max_autotune() -> None:
    """Compile torchtitan's flex attention without max_autotune and coordinate descent (the
    defaults of ``FlexAttention.inductor_configs`` cost minutes of autotuning per shape). Once
    per process (``main``), so every trainer and model of the process shares one compile."""
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention

    opts = {**FlexAttention.inductor_configs, "max_autotune": False}
    opts["coordinate_descent_tuning"] = False
    FlexAttention.inductor_configs = opts  # also what a regional sub-compile of flex uses
    FlexAttention._compiled_flex_attn = torch.compile(flex_attention, options=opts)


def packed_batch(gen: torch.Generator, bsz: int, seqlen: int, vocab: int, mean_doc: int):
    """Random tokens and positions: documents of 1..2*mean_doc tokens packed into rows."""
    lengths = torch.randint(1, 2 * mean_doc, (bsz * seqlen // mean_doc * 2 + 8,), generator=gen)
    pos = torch.empty(bsz, seqlen, dtype=torch.int64)
    it = 0
    for b in range(bsz):
        t = 0
        while t < seqlen:
            n = min(int(lengths[it]), seqlen - t)
            pos[b, t : t + n] = torch.arange(n)
            t, it = t + n, it + 1
    tokens = torch.randint(0, vocab, (bsz, seqlen), generator=gen)
    return tokens, pos


def _dtype(args) -> torch.dtype:
    if args.dtype == "auto":
        return torch.bfloat16 if args.device == "cuda" else torch.float32
    return getattr(torch, args.dtype)


class Step:
    """One optimizer step of the model on one microbatch, through a SequencePreprocessor."""

    def __init__(self, args, source: str, compile_backend: str | None = None) -> None:
        self.device = torch.device(args.device)
        self.dtype = _dtype(args)
        torch.manual_seed(0)
        cfg = model_config(
            args.flavor, layer_pattern=args.pattern, attention_backend=args.attention_backend,
            **({"head_dim": args.head_dim} if args.head_dim else {}),
        )  # fmt: skip
        with torch.device(self.device):
            self.model = cfg.build()
        self.model.init_states()
        self.model.to(self.dtype)
        self.vocab = cfg.vocab_size
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=True)
        caps = None
        if compile_backend is not None:
            # What parallelize does for --compile.enable: fixed routing shapes, every block
            # compiled on its own with fullgraph=True.
            from torchtitan_cp.trainer.compile import routing_caps

            caps = routing_caps(
                load_balancer="headtail", batch_size=args.batch, seq_len=args.seq_len,
                cp_degree=1, ptrr_block_size=128, max_subsequences=args.max_subsequences,
            )  # fmt: skip
            torch._dynamo.config.automatic_dynamic_shapes = False
            for block in self.model.layers.values():
                block.compile(fullgraph=True, backend=compile_backend)
        self.pre = SequencePreprocessor(
            device=self.device,
            cp_group=None,
            load_balancer="headtail",
            routing_source=source,
            conv_history=cfg.conv_width - 1,
            flex_attention=cfg.uses_flex_attention(self.device),
            caps=caps,
        )

    def __call__(self, tokens_cpu, positions_cpu) -> None:
        host = HostMetadata(positions_cpu)
        tokens = tokens_cpu.to(self.device, non_blocking=True)
        positions = positions_cpu.to(self.device, non_blocking=True)
        labels = torch.roll(tokens, -1, 1)
        inputs, labels, positions, ctx = self.pre(tokens, labels, positions, host)
        logits = self.model(inputs, positions, ctx)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


def sync_site(exc: BaseException) -> str:
    """``file:line function`` of the innermost project or fla frame that raised (where to look)."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [
        f for f in frames
        if any(s in f.filename for s in ("torchtitan_cp", "/fla/", "/torchtitan/"))
    ]  # fmt: skip
    f = (ours or frames or [None])[-1]
    if f is None:
        return "?"
    parts = f.filename.replace("\\", "/").split("/")
    # From the package root on (our modules nest up to ops/<family>/), else the last three parts.
    root = next((i for i in range(len(parts) - 1, -1, -1) if parts[i] == "torchtitan_cp"), None)
    return f"{'/'.join(parts[-3:] if root is None else parts[root:])}:{f.lineno} {f.name}"


def model_step_sync_check(args, gen) -> dict[str, str]:
    """The fallback where the trainer cannot run: one model step (no trainer loop) under the
    sync debug mode, host vs readback."""
    out = {}
    for source in ("host", "device_readback"):
        step = Step(args, source)
        batch = packed_batch(gen, args.batch, args.seq_len, step.vocab, args.mean_doc)
        step(*(t.pin_memory() for t in batch))  # warm-up: kernel compilation, allocator
        torch.cuda.synchronize()
        batch = packed_batch(gen, args.batch, args.seq_len, step.vocab, args.mean_doc)
        pinned = [t.pin_memory() for t in batch]
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(*pinned)
            out[source] = "no synchronisation"
        except RuntimeError as e:
            out[source] = f"synchronised at {sync_site(e)}: " + str(e).splitlines()[0][:120]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    return out


# ---------------------------------------------------------------------------------------------
# The trainer's whole steps
# ---------------------------------------------------------------------------------------------


class TrainerUnavailable(Exception):
    """The trainer refuses this torch or configuration; the message is its one line."""


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def build_trainer(argv: list[str], dump_folder: str):
    """The recipe's trainer for one process, as ``python -m torchtitan_cp.train`` builds it."""
    from torchtitan_cp import compat
    from torchtitan_cp.trainer.config import ConfigError

    try:
        compat.require_torch(compat.LIBRARY_TORCH_FLOOR, "the trainer (torchtitan 0.3.0)")
        compat.apply()
        from torchtitan_cp.train import load_config
        from torchtitan_cp.trainer.validate import validate

        config = load_config([*argv, "--dump_folder", dump_folder])
        validate(config, 1, compat.device_type(), scan_data=False)
    except (compat.TorchVersionError, ConfigError) as e:
        raise TrainerUnavailable(str(e)) from None
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():  # fmt: skip
        os.environ[key] = value
    os.environ["MASTER_PORT"] = _free_port()
    if not compat.accelerator_available():
        # The dry run's device: the CPU named cpu:0, apart from the host's "cpu" (host_sync.py).
        import torchtitan.tools.utils as titan_utils

        titan_utils.get_local_device = lambda: torch.device("cpu", 0)
    return config.build()


def run_trainer(argv: list[str], watch: Callable[[Any, int], Any], control: bool) -> None:
    """Train ``argv``'s steps with each ``train_step`` inside ``watch(trainer, step)``.
    ``control``: torchtitan 0.3.0's own ``Trainer.train_step`` instead of the recipe's."""
    import torch.distributed as dist
    from torchtitan.trainer import Trainer

    with tempfile.TemporaryDirectory() as dump:
        trainer = build_trainer(argv, dump)
        step_fn = (lambda it: Trainer.train_step(trainer, it)) if control else trainer.train_step

        def train_step(data_iterator):
            with watch(trainer, trainer.step):
                return step_fn(data_iterator)

        trainer.train_step = train_step
        try:
            trainer.train()
        finally:
            trainer.close()
            if dist.is_initialized():
                dist.destroy_process_group()


def trainer_sync_check(device: str, source: str, *, control: bool = False) -> dict[str, Any]:
    """The recipe's trainer (or, ``control``, torchtitan's own step) on ``source`` routing:
    steps 2-3 watched for synchronisations (CUDA: ``set_sync_debug_mode("error")``, the first
    one raises; CPU: every one recorded), the log step listed. Returns ``{"steps": {step:
    [sync, ...]}, ...}``."""
    argv = [*TRAINER_ARGS, "--linear_attention.routing_source", source]
    steps: dict[int, list[str]] = {}

    @contextlib.contextmanager
    def watch_cpu(trainer, step):
        from torchtitan_cp.trainer.host_sync import event_lines, recorded

        with recorded(trainer) as rec:
            try:
                yield
            finally:
                steps[step] = event_lines(rec.events)

    @contextlib.contextmanager
    def watch_cuda(trainer, step):
        if step not in (*STRICT_STEPS, LOG_STEP):
            yield
            return
        torch.cuda.synchronize()
        if step == LOG_STEP:  # every synchronisation of a log step, as warnings
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    yield
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            steps[step] = [
                f"{Path(w.filename).parent.name}/{Path(w.filename).name}:{w.lineno}"
                for w in caught if "synchroniz" in str(w.message)
            ]  # fmt: skip
            return
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
            steps[step] = []
        except RuntimeError as e:
            if "synchroniz" not in str(e):
                raise
            steps[step] = [f"synchronised at {sync_site(e)}: {str(e).splitlines()[0][:100]}"]
            raise
        finally:
            torch.cuda.set_sync_debug_mode(0)

    watch = watch_cuda if device == "cuda" else watch_cpu
    error = None
    try:
        run_trainer(argv, watch, control)
    except TrainerUnavailable:
        raise
    except RuntimeError as e:
        if device != "cuda" or "synchroniz" not in str(e):
            raise
        error = str(e).splitlines()[0][:200]  # the CUDA check raised at the first sync
    strict = {s: steps.get(s, ["(step not reached)"]) for s in STRICT_STEPS}
    return {
        "source": source,
        "step": "torchtitan" if control else "recipe",
        "steps": {str(s): v for s, v in sorted(steps.items())},
        "synchronised": any(strict.values()),
        "stopped_by": error,
    }


# ---------------------------------------------------------------------------------------------
# fla against the torch backend
# ---------------------------------------------------------------------------------------------


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((a.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()


def _cu_seqlens(gen: torch.Generator, total: int, mean_doc: int) -> torch.Tensor:
    lengths = torch.randint(1, 2 * mean_doc, (total // mean_doc * 2 + 8,), generator=gen).tolist()
    cu = [0]
    for n in lengths:
        if cu[-1] + n >= total:
            break
        cu.append(cu[-1] + n)
    return torch.tensor([*cu, total], dtype=torch.int32)


ACCURACY_TOL = {torch.float32: 5e-3, torch.bfloat16: 5e-2}


def kernel_accuracy(
    kind: str, heads: int, head_dim: int, value_dim: int, conv_dim: int, tokens: int,
    dtype: torch.dtype, gen: torch.Generator, mean_doc: int,
) -> dict[str, Any]:  # fmt: skip
    """fla against the torch backend on the same inputs (``kind``: kda, gdn or conv), forward
    and backward, varlen: max relative error per tensor (the torch backend computes in float32
    from the same inputs)."""
    import torch.nn.functional as F

    from torchtitan_cp.ops import causal_conv1d, chunk_delta_rule

    dev = torch.device("cuda")
    cu = _cu_seqlens(gen, tokens, mean_doc)
    T, H, K, V = tokens, heads, head_dim, value_dim
    out = {}
    if kind == "conv":
        x = torch.randn(1, T, conv_dim, generator=gen).to(dev, dtype)
        w = torch.randn(conv_dim, 4, generator=gen).to(dev, dtype)
        for backend in ("fla", "torch"):
            xs = [x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()]
            y = causal_conv1d(*xs, None, cu_seqlens=cu.to(dev), cu_seqlens_cpu=cu, backend=backend)
            out[backend] = [y, *torch.autograd.grad(y.float().square().mean(), xs)]
        names = ("o", "dx", "dweight")
    else:
        q = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
        k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
        v = torch.randn(1, T, H, V, generator=gen)
        g = -0.1 * torch.rand(*((1, T, H, K) if kind == "kda" else (1, T, H)), generator=gen)
        beta = torch.rand(1, T, H, generator=gen)
        inputs = [x.to(dev, dtype) for x in (q, k, v)] + [g.to(dev), beta.to(dev, dtype)]
        from torchtitan_cp.ops.common.fla_refusals import fla_gdn_backward_refusal

        # fla refuses GDN's backward on Hopper with 3.4.0 <= triton < 3.7.1 (fla #640): there
        # GDN is checked forward only, and says so in one line (not a failure of the recipe).
        refused = fla_gdn_backward_refusal() if kind == "gdn" else None
        for backend in ("fla", "torch"):
            xs = [x.detach().clone().requires_grad_(refused is None) for x in inputs]
            o, ht = chunk_delta_rule(
                *xs, kind=kind, output_final_state=True, cu_seqlens=cu.to(dev),
                cu_seqlens_cpu=cu, backend=backend,
            )  # fmt: skip
            assert ht is not None
            if refused is not None:
                out[backend] = [o, ht]
                continue
            do = torch.ones_like(o) / o.numel() ** 0.5
            grads = torch.autograd.grad((o * do).sum() + ht.sum() * 1e-3, xs)
            out[backend] = [o, ht, *grads]
        names = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta")
        if refused is not None:
            print(f"gpu_check: GDN checked forward only here: {refused}")
            out["note"] = [f"forward only: {refused}"]
    errs = {n: _rel_err(a, b) for n, a, b in zip(names, out["fla"], out["torch"])}
    return {"kernel": kind, "dtype": str(dtype).split(".")[-1], "shape": [T, H, K, V],
            "conv_dim": conv_dim, "max_rel_err": errs, **({"note": out["note"][0]}
            if "note" in out else {}),
            "within_tol": max(errs.values()) <= ACCURACY_TOL[dtype]}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# CP gradients on every rank (FLA #1115: exact forwards, wrong gradients on every non-last rank)
# ---------------------------------------------------------------------------------------------

CP_GRAD_WORLD = 4
# Relative to the largest reference gradient of each tensor. torch: float32 CP vs float64
# unsharded; fla: float32 with TF32 matmuls, as ACCURACY_TOL.
CP_GRAD_TOL = {"torch": 1e-4, "fla": 5e-3}
CP_GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta")


def cp_grad_layout(
    world: int, tokens_per_rank: int
) -> tuple[list[int], list[list[tuple[int, int]]]]:
    """Documents over ``world`` contiguous rank spans of ``L = tokens_per_rank`` tokens: a
    one-token document, one over the first boundary, a 5-token one, one from rank 1 to the
    last rank (every later boundary, pass-through ranks between), the rest on the last rank.
    Every rank boundary falls inside a document, so every rank but the last publishes a
    summary. Returns ``(cu_seqlens, table)``; ``table[r]`` is rank ``r``'s fragments."""
    from torchtitan_cp.routing import contiguous_fragments

    L = tokens_per_rank
    total = world * L
    cuts = {0, 1, L + L // 3, L + L // 3 + 5, (world - 1) * L + L // 3, total}
    cu = sorted(cuts)
    table = [list(f) for f in contiguous_fragments(total, 1, world)]
    return cu, table


def cp_gradients(
    kind: str, backend: str, device: torch.device, *, world: int, tokens_per_rank: int,
    heads: int, head_dim: int, gen: torch.Generator, cp_op: Callable | None = None,
) -> dict[str, Any]:  # fmt: skip
    """``world`` ranks' spans simulated in one process: the CP op (``cp_op``, default
    ``context_parallel_delta_rule``) on the world-1 path over one span that holds every
    simulated rank's fragment in **reverse** rank order, so no fragment follows its
    predecessor in the span and every continuation goes through a published summary, the
    all-gather's buffer and the fold, as across ranks (world 1: the all-gather is the
    identity, its backward no reduce-scatter). Inputs float32; the reference is the unsharded
    torch kernel in float64 over the whole stream, same inputs and output cotangent (the loss
    reads the outputs, as training does). Returns the comparison's inputs: per simulated rank
    its outputs and input gradients (q, k, v, g, beta; the CP op takes no initial state) next
    to the reference's on the same tokens, and the reference's whole gradients (the scale)."""
    from torchtitan_cp.ops import chunk_delta_rule, context_parallel_delta_rule
    from torchtitan_cp.routing import RoutingPlan

    cp_op = cp_op or context_parallel_delta_rule
    cu, table = cp_grad_layout(world, tokens_per_rank)
    T, H, K = cu[-1], heads, head_dim

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    F = torch.nn.functional
    q, k, v = rnd(1, T, H, K), F.normalize(rnd(1, T, H, K), dim=-1), rnd(1, T, H, K)
    g = -F.softplus(rnd(1, T, H, K) if kind == "kda" else rnd(1, T, H)) * 0.3
    beta = torch.sigmoid(rnd(1, T, H))
    full = [x.to(device) for x in (q, k, v, g, beta)]
    d_o = rnd(1, T, H, K).to(device)

    cu_t = torch.tensor(cu, dtype=torch.int32)
    leaves = [x.clone().requires_grad_(True) for x in full]
    o_ref, _ = chunk_delta_rule(*leaves, kind=kind, cu_seqlens=cu_t.to(device),
                                cu_seqlens_cpu=cu_t, backend="torch")  # fmt: skip
    ref_grads = torch.autograd.grad((o_ref * d_o).sum(), leaves)

    span_frags = [f for r in reversed(range(world)) for f in table[r]]
    routing = RoutingPlan.build(cu, [span_frags], 0).to_device(device)
    span = torch.tensor([t for a, b in span_frags for t in range(a, b)], device=device)
    loc = [x.index_select(1, span).float().requires_grad_(True) for x in full]
    o, _ = cp_op(*loc, kind=kind, routing=routing, group=None, backend=backend)
    grads = torch.autograd.grad((o.double() * d_o.index_select(1, span)).sum(), loc)

    where = {t: i for i, t in enumerate(span.tolist())}  # global token -> span position
    ranks = []
    for r in range(world):
        ids = [t for a, b in table[r] for t in range(a, b)]
        tokens = torch.tensor(ids, device=device)
        pos = torch.tensor([where[t] for t in ids], device=device)
        ranks.append({
            "o": (o.index_select(1, pos), o_ref.index_select(1, tokens)),
            **{n: (gr.index_select(1, pos), ref.index_select(1, tokens))
               for n, gr, ref in zip(CP_GRAD_NAMES, grads, ref_grads)},
        })  # fmt: skip
    return {
        "ranks": ranks,
        "scale": {"o": o_ref.detach(), **dict(zip(CP_GRAD_NAMES, ref_grads))},
        "published_summaries": routing.summary_cu_seqlens.numel() - 1,
        "shape": [T, H, K, K],
        "cu_seqlens": cu,
    }


def compare_cp_gradients(cmp: dict[str, Any], tol: float) -> dict[str, Any]:
    """Worst relative error per simulated rank (``max |cp - ref| / max |ref|`` over the whole
    tensor, worst over the input gradients; forward separately) and the verdict: every
    rank's gradients and outputs within ``tol``."""

    def rel(name: str, pair) -> float:
        a, ref = pair
        return ((a.double() - ref.double()).abs().max() / cmp["scale"][name].abs().max()
                .clamp(min=1e-12)).item()  # fmt: skip

    grad = [max(rel(n, rank[n]) for n in CP_GRAD_NAMES) for rank in cmp["ranks"]]
    fwd = [rel("o", rank["o"]) for rank in cmp["ranks"]]
    return {
        "max_rel_grad_err_per_rank": grad,
        "max_rel_out_err_per_rank": fwd,
        "tol": tol,
        "within_tol": max(grad + fwd) <= tol,
    }


def cp_gradient_check(kind: str, device: torch.device, backends: list[str], gen, *,
                      world: int = CP_GRAD_WORLD, tokens_per_rank: int, heads: int,
                      head_dim: int) -> dict[str, Any]:  # fmt: skip
    """One record per kind: ``cp_gradients`` + ``compare_cp_gradients`` for each backend.
    fla's GDN backward where fla refuses it (fla #640) is skipped with its one line."""
    from torchtitan_cp.ops.common.fla_refusals import fla_gdn_backward_refusal

    out: dict[str, Any] = {"kind": kind, "world": world, "tokens_per_rank": tokens_per_rank,
                           "layout": "contiguous spans, simulated in one process (world-1 "
                           "path, spans in reverse rank order)"}  # fmt: skip
    ok = True
    for backend in backends:
        refused = fla_gdn_backward_refusal() if (kind, backend) == ("gdn", "fla") else None
        if refused is not None:
            out[backend] = {"skipped": f"fla refuses GDN's backward here: {refused}"}
            continue
        cmp = cp_gradients(kind, backend, device, world=world, tokens_per_rank=tokens_per_rank,
                           heads=heads, head_dim=head_dim, gen=gen)  # fmt: skip
        tol = CP_GRAD_TOL[backend]
        if backend == "torch" and torch.get_float32_matmul_precision() != "highest":
            tol = CP_GRAD_TOL["fla"]  # TF32 matmuls turned on in this process: fla's bound
        res = compare_cp_gradients(cmp, tol)
        out.update(shape=cmp["shape"], cu_seqlens=cmp["cu_seqlens"],
                   published_summaries=cmp["published_summaries"])  # fmt: skip
        out[backend] = res
        ok &= res["within_tol"]
    out["within_tol"] = ok
    return out


def model_shapes(flavor: str, head_dim: int | None) -> dict[str, int]:
    cfg = model_config(flavor, **({"head_dim": head_dim} if head_dim else {}))
    v = getattr(cfg, "value_head_dim", None) or cfg.head_dim
    h, k = cfg.n_heads, cfg.head_dim
    return {"heads": h, "head_dim": k, "value_dim": v, "conv_dim": 2 * h * k + h * v}


def run_parallel(cmds: list[list[str]], timeout: float) -> list[int]:
    """Start every command at once (each its own Python: autotuning and compiling in parallel,
    results shared through the on-disk Triton and inductor caches); their exit codes."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    procs = [subprocess.Popen(cmd, env=env) for cmd in cmds]
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(-9)
    return codes


def warm_up_and_check_kernels(args, shapes: dict[str, int], kinds: list[str], dtype: str,
                              tokens: int, flex: list[str],
                              cp_kinds: tuple[str, ...] = ()) -> list[int]:  # fmt: skip
    """fla vs torch per kind, the CP gradient check per ``cp_kinds`` kind, and one model step
    (``flex``: its extra arguments) to compile flex attention, all at once in worker processes
    that append their own results."""
    me = [sys.executable, str(Path(__file__).resolve()), "--device", args.device,
          "--fla-autotune", args.fla_autotune]  # fmt: skip
    res = [a for p in args.results for a in ("--results", p)]
    cmds = [
        [*me, "--worker", f"accuracy:{kind}", "--stage", args.stage, "--dtype", dtype,
         "--tokens", str(tokens), "--shapes", json.dumps(shapes), *res]
        for kind in kinds
    ]  # fmt: skip
    cmds += [
        [*me, "--worker", f"cp_grad:{kind}", "--stage", args.stage, "--shapes",
         json.dumps(shapes), *res]
        for kind in cp_kinds
    ]  # fmt: skip
    if flex:
        cmds.append([*me, "--worker", "model_step", "--stage", args.stage, *flex, *res])
    return run_parallel(cmds, timeout=args.worker_timeout)


# ---------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------


def stage_path(args, res: Results, gen) -> None:
    with timed() as t:
        import gpu_imports

        error = gpu_imports.check()
    res.add("imports", error is None, t(), error=error, count=len(gpu_imports.CUDA_PATH_IMPORTS))
    if error is not None:
        return
    with timed() as t:
        trainer_error = gpu_imports.check(gpu_imports.TRAINER_IMPORTS)
    res.add("trainer_imports", trainer_error is None, t(), error=trainer_error)
    cuda = args.device == "cuda"
    if cuda:
        shapes = model_shapes("debug", 64)
        # The trainer's model at those shapes: float32 (the debug config), flex attention.
        flex = ["--flavor", "debug", "--pattern", "A", "--head-dim", "64", "--dtype",
                "float32", "--batch", "2", "--seq-len", "256"]  # fmt: skip
        with timed() as t:
            codes = warm_up_and_check_kernels(args, shapes, ["kda", "gdn", "conv"], "float32",
                                              512, flex, cp_kinds=("kda", "gdn"))  # fmt: skip
        res.add("kernels_and_flex_workers", not any(codes), t(), exit_codes=codes)
    else:
        res.add("kernel_accuracy", True, 0.0, skipped="fla's Triton kernels need CUDA")
        # The CP gradient check's workers as on CUDA, on the torch kernels and small shapes
        # (fla's need CUDA, or the interpreter: tests/test_gpu_check_fla.py).
        with timed() as t:
            codes = warm_up_and_check_kernels(args, {"heads": 2, "head_dim": 16}, [],
                                              "float32", 0, [], cp_kinds=("kda", "gdn"))  # fmt: skip
        res.add("cp_gradient_workers", not any(codes), t(), exit_codes=codes)
    if trainer_error is not None:
        fallback_model_step(args, res, gen)
        return
    for source, control in (("host", False), ("device_readback", False), ("host", True)):
        with timed() as t:
            try:
                out = trainer_sync_check(args.device, source, control=control)
            except TrainerUnavailable as e:  # the trainer's one line: this torch cannot run it
                res.add("trainer", False, t(), unavailable=str(e))
                fallback_model_step(args, res, gen)
                return
        expect_sync = source != "host" or control
        part = f"trainer_{'torchtitan_step' if control else source}"
        res.add(part, out["synchronised"] == expect_sync, t(), expect_sync=expect_sync, **out)


def fallback_model_step(args, res: Results, gen) -> None:
    if args.device != "cuda":
        res.add("model_step_sync", True, 0.0, skipped="the model-step check needs CUDA")
        return
    a = argparse.Namespace(**{**vars(args), "flavor": "debug", "pattern": "KGKA",
                              "head_dim": 64, "dtype": "float32", "batch": 2, "seq_len": 256,
                              "mean_doc": 40})  # fmt: skip
    with timed() as t:
        out = model_step_sync_check(a, gen)
    ok = out["host"] == "no synchronisation" and out["device_readback"] != out["host"]
    res.add("model_step_sync", ok, t(), **out)


def stage_tests(args, res: Results, gen) -> None:
    # pytest-xdist spreads the tests (and their autotuning) over processes where it is there.
    xdist = subprocess.run([sys.executable, "-c", "import xdist"], capture_output=True)
    par = ["-n", "8"] if xdist.returncode == 0 and args.device == "cuda" else []
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "scripts"), str(ROOT), env.get("PYTHONPATH", "")]
    )
    with timed() as t:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
             "gpu_check_pytest", "-rs", *par, *CUDA_TESTS],
            cwd=ROOT, capture_output=True, text=True, env=env,
        )  # fmt: skip
    sys.stdout.write(proc.stdout[-6000:])
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    res.add("cuda_tests", proc.returncode == 0, t(), exit_code=proc.returncode, summary=summary)


def stage_timing(args, res: Results, gen) -> None:
    if args.device == "cuda":
        shapes = model_shapes(args.flavor, args.head_dim)
        flex = ["--flavor", args.flavor, "--pattern", "A", "--dtype", "bfloat16",
                "--batch", str(args.batch), "--seq-len", str(args.seq_len)]  # fmt: skip
        with timed() as t:
            codes = warm_up_and_check_kernels(args, shapes, ["kda", "conv"], "bfloat16",
                                              args.seq_len * args.batch, flex)  # fmt: skip
        res.add("kernels_and_flex_workers", not any(codes), t(), exit_codes=codes)
    with timed() as t:
        out = timing(args, gen)
    ok = out["host"]["readbacks_per_step"] == 0 and out["device_readback"]["readbacks_per_step"] > 0
    res.add("step_time", ok, t(), flavor=args.flavor, pattern=args.pattern,
            tokens=args.batch * args.seq_len, **out)  # fmt: skip
    print(f"\n| routing_source | median ms | min ms | tokens/s | readbacks/step |  "
          f"({args.flavor} {args.pattern}, {args.batch}x{args.seq_len})")  # fmt: skip
    for k, v in out.items():
        print(f"| {k} | {v['median_ms']:.2f} | {v['min_ms']:.2f} | {v['tokens_per_s']:,.0f} | "
              f"{v['readbacks_per_step']:.1f} |")  # fmt: skip


def stage_compile(args, res: Results, gen) -> None:
    with timed() as t:
        out = compile_timing(args, gen)
    ok = out["compiled"]["frames_compiled_after_warmup"] == 0
    res.add("compile", ok, t(), backend=args.compile_backend, **out)
    for k, v in out.items():
        print(f"| {k} | first step {v['first_step_ms']:.0f} ms | median {v['median_ms']:.2f} ms "
              f"| {v['tokens_per_s']:,.0f} tokens/s | {v['frames_compiled_after_warmup']} |")  # fmt: skip


STAGES: dict[str, Callable[[Any, Results, torch.Generator], None]] = {
    "path": stage_path,
    "tests": stage_tests,
    "timing": stage_timing,
    "compile": stage_compile,
}


def timing(args, gen) -> dict[str, dict[str, float]]:
    out = {}
    cuda = args.device == "cuda"
    for source in ("host", "device_readback"):
        step = Step(args, source)
        batches = [
            packed_batch(gen, args.batch, args.seq_len, step.vocab, args.mean_doc)
            for _ in range(args.steps + args.warmup)
        ]
        if cuda:
            batches = [tuple(t.pin_memory() for t in b) for b in batches]
        times = []
        for i, batch in enumerate(batches):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(*batch)
            if cuda:
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        ms = statistics.median(times)
        out[source] = {
            "median_ms": ms,
            "min_ms": min(times),
            "tokens_per_s": args.batch * args.seq_len / ms * 1e3,
            "readbacks_per_step": step.pre.stats.take()["readbacks"] / len(batches),
        }
    return out


def compile_timing(args, gen) -> dict[str, dict[str, float]]:
    """Host-path step time eager vs compiled (same batches), compile time, later recompiles."""
    from torchtitan_cp.trainer.compile import compile_counters

    cuda = args.device == "cuda"
    batches = [
        packed_batch(gen, args.batch, args.seq_len, 1, args.mean_doc)[1]
        for _ in range(args.steps + args.warmup)
    ]
    out = {}
    for mode in ("eager", "compiled"):
        step = Step(args, "host", args.compile_backend if mode == "compiled" else None)
        toks = [torch.randint(0, step.vocab, p.shape, generator=gen) for p in batches]
        times, frames_after_warmup = [], 0
        for i, (tok, pos) in enumerate(zip(toks, batches)):
            if cuda:
                tok, pos = tok.pin_memory(), pos.pin_memory()
                torch.cuda.synchronize()
            if i == args.warmup:
                frames_after_warmup = compile_counters()["compile/frames"]
            t0 = time.perf_counter()
            step(tok, pos)
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        ms = statistics.median(times[args.warmup :])
        out[mode] = {
            "first_step_ms": times[0],
            "median_ms": ms,
            "tokens_per_s": args.batch * args.seq_len / ms * 1e3,
            "frames_compiled_after_warmup": compile_counters()["compile/frames"]
            - frames_after_warmup,
        }
    return out


def _tool_version(cmd: list[str]) -> str | None:
    """The last line of ``cmd``'s answer (``ptxas --version``, ``nvidia-smi ...``), or None."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    return lines[-1] if out.returncode == 0 and lines else None


def environment(device: str) -> dict[str, Any]:
    """What decides correctness on the GPU, recorded with every stage: torch, its CUDA build,
    triton, the ptxas Triton compiles with (FLA #1262: wrong Hopper state gradients with ptxas
    12.8.93), the driver, the device and its capability, and fla's refusal of GDN's backward
    here (``fla_refusals``: Hopper with 3.4.0 <= triton < 3.7.1, fla #640)."""
    from torchtitan_cp.ops.common.fla_refusals import device_facts, fla_gdn_backward_refusal

    facts = device_facts()
    env: dict[str, Any] = {"torch_version": torch.__version__, "cuda": torch.version.cuda,
                           "triton": facts.triton, "tilelang": facts.tilelang}  # fmt: skip
    try:
        from importlib.metadata import version

        env["fla_core"] = version("fla-core")
    except Exception:  # noqa: BLE001 - not installed: recorded as missing
        env["fla_core"] = None
    ptxas = os.environ.get("TRITON_PTXAS_PATH")
    if not ptxas and facts.triton is not None:
        import triton

        cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        ptxas = str(cand) if cand.exists() else None
    env["ptxas"] = _tool_version([ptxas, "--version"]) if ptxas else None
    if device == "cuda":
        env["device_name"] = torch.cuda.get_device_name()
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        env["driver"] = _tool_version(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        )
    env["fla_gdn_backward"] = fla_gdn_backward_refusal(facts) or "runs"
    return env


def run_worker(args, res: Results, gen) -> None:
    """One part of a stage in its own process (see ``warm_up_and_check_kernels``)."""
    if args.worker.startswith("accuracy:"):
        kind = args.worker.split(":", 1)[1]
        shapes = json.loads(args.shapes)
        with timed() as t:
            out = kernel_accuracy(kind, tokens=args.tokens, dtype=_dtype(args), gen=gen,
                                  mean_doc=args.mean_doc, **shapes)  # fmt: skip
        res.add(f"fla_vs_torch_{kind}_{out['dtype']}", out["within_tol"], t(), **out,
                fla_autotune=gpu_autotune.applied())  # fmt: skip
    elif args.worker.startswith("cp_grad:"):
        kind = args.worker.split(":", 1)[1]
        shapes = json.loads(args.shapes)
        # CUDA: 4 x 128 tokens, the accuracy workers' 512 at their head sizes (fla reuses their
        # kernels; the summary pass adds value width V + K). The dry run: torch, 4 x 32.
        cuda = args.device == "cuda"
        with timed() as t:
            out = cp_gradient_check(kind, torch.device(args.device),
                                    ["torch", "fla"] if cuda else ["torch"], gen,
                                    tokens_per_rank=128 if cuda else 32, heads=shapes["heads"],
                                    head_dim=shapes["head_dim"])  # fmt: skip
        res.add(f"cp_gradients_{kind}", out["within_tol"], t(), **out,
                fla_autotune=gpu_autotune.applied())  # fmt: skip
    elif args.worker == "model_step":
        with timed() as t:
            step = Step(args, "host")
            step(*packed_batch(gen, args.batch, args.seq_len, step.vocab, args.mean_doc))
            if args.device == "cuda":
                torch.cuda.synchronize()
        res.add(f"model_step_{args.flavor}_{args.pattern}", True, t(), dtype=args.dtype)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", required=True, choices=sorted(STAGES))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--results", action="append", default=[],
                   help="JSON-lines file to append to (repeatable)")  # fmt: skip
    p.add_argument("--flavor", default="150M")
    p.add_argument("--pattern", default="KKKAKKKAKKKA")
    p.add_argument("--head-dim", type=int, default=0, help="override the flavor's head_dim")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--attention-backend", default="auto", choices=["auto", "flex", "sdpa"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--mean-doc", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compile stage")  # fmt: skip
    p.add_argument("--max-subsequences", type=int, default=256,
                   help="routing cap of the compiled run (linear_attention.max_subsequences)")  # fmt: skip
    p.add_argument("--worker-timeout", type=float, default=230.0)
    p.add_argument("--fla-autotune", default="auto", choices=["auto", "one", "full"],
                   help="fla-core's Triton autotune: one = one config per kernel "
                   "(scripts/gpu_autotune.py); auto: one in the path stage, else full")  # fmt: skip
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=int, default=512, help=argparse.SUPPRESS)
    p.add_argument("--shapes", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --device cpu for a dry run", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    res = Results(args.results, args.stage, args.device)
    if args.fla_autotune == "one" or (args.fla_autotune == "auto" and args.stage == "path"):
        # Before fla's kernel modules load (this process and its workers, which see the same
        # stage): the cold autotune of every candidate config cannot pass the worker timeout.
        gpu_autotune.prune()
    if args.device == "cuda":
        no_flex_max_autotune()
    if args.worker:
        run_worker(args, res, gen)
        return 0 if res.ok else 1
    res.add("environment", True, 0.0, **environment(args.device),
            fla_autotune=gpu_autotune.applied()["rule"])  # fmt: skip
    with timed() as t:
        try:
            STAGES[args.stage](args, res, gen)
        except Exception as e:  # recorded, so the next stage still has this one's parts
            res.add("error", False, t(), error=f"{type(e).__name__}: {str(e)[:300]}",
                    site=sync_site(e))  # fmt: skip
            traceback.print_exc()
    res.add("done", res.ok, t())
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
