"""GPU evidence for the recipe in one call: ``scripts/gpu_check.sh --all`` (docs/gpu.md).

The parts run in priority order under one deadline (``--budget`` seconds from the call's start,
``--started-at``), each in its own process with a time box (``PARTS``: the box, the deadline's
remainder, whichever is smaller; a part that runs out is killed and recorded as such, and the
next part starts). Every finished measurement appends one JSON line to each ``--results`` file
at once, so a part cut short keeps what it finished. Every line records the fla autotune rule
its process ran under (``fla_autotune``): fla's autotune never decides whether the call
finishes, because the correctness parts keep each fla kernel's smallest config and the timing
parts fla's first (``scripts/gpu_autotune.py``); only ``autotune_reuse`` autotunes fully.

Parts (``PARTS``, in order):

* ``environment`` and ``imports``: versions (torch, CUDA, triton, ptxas, driver, device, fla,
  tilelang, nvcc), which kernels run GDN's backward and why (one line), the CUDA path's imports.
* ``correctness``: ``pytest -m gpu_check`` (tests/test_gpu_parity.py): fla against the torch
  kernels and the CP gradients of every simulated rank, for every registered recurrence and the
  conv; one line per test with its measured errors (scripts/gpu_check_pytest.py).
* ``trainer_sync``: the real trainer (``configs/debug_cpu.toml``, head_dim 64, 4 steps, one
  process) on the host routing with the configured backend (``auto``: fla where it runs) and
  with ``backend = "torch"``, then the readback routing and torchtitan 0.3.0's own
  ``train_step``: steps 2-3 under ``torch.cuda.set_sync_debug_mode("warn")``, every
  synchronisation listed with the project, fla or torchtitan frame that made it; the host path
  must list none, the other two must list some. The log step (4) is listed too.
* ``timing``: host vs readback step time of the 150M model (KKKA x 3) at 16k tokens.
* ``cp_op_ms``: the delta-rule CP op in milliseconds (KDA, bfloat16, H 16, K = V = 128, T = 32k
  and 128k, W = 4 ranks simulated on the world-1 path with the spans in reverse order): the
  local kernel alone on the same tokens with entry states, the CP op, the unsharded kernel.
* ``compile``: the same model with every block compiled against eager (frames after warm-up: 0).
* ``autotune_reuse``: fla's full autotune kept across processes
  (``torchtitan_cp.ops.common.fla_autotune``): two fresh processes run the same kernels; the
  second must tune nothing.
* ``cuda_tests``: the remaining CUDA-only tests (``CUDA_TESTS``), with what time is left.

``--part NAME`` runs one part (what ``--all`` starts per part). ``--device cpu`` is the dry run
the test suite executes: the same parts, the trainer's steps watched by
``torchtitan_cp.trainer.host_sync.HostSyncRecorder`` instead of CUDA's sync debug mode, fla's
kernels skipped (CUDA only), small shapes. Flex attention is compiled without ``max_autotune``
throughout (torchtitan's default autotunes for minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
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
from typing import Any, NamedTuple

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_autotune  # noqa: E402

from torchtitan_cp.models import model_config  # noqa: E402
from torchtitan_cp.models.sequence import SequencePreprocessor  # noqa: E402
from torchtitan_cp.routing.host_metadata import HostMetadata  # noqa: E402

# The trainer run of trainer_sync: the debug config, head_dim 64 (the parity tests' fla shapes,
# so their compiled kernels serve it), a log step only at 1 (warm-up) and 4.
TRAINER_ARGS = (
    "--config_file",
    str(ROOT / "configs/debug_cpu.toml"),
    "--model.head_dim",
    "64",
    "--training.steps",
    "4",
    "--metrics.log_freq",
    "4",
    "--metrics.no-enable_wandb",
    "--validator.no-enable",
    "--checkpoint.no-enable",
)
STRICT_STEPS = (2, 3)  # must not synchronise on the host path
LOG_STEP = 4
PARITY_TESTS = ("tests/test_gpu_parity.py",)
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
    """Appends one JSON line per finished measurement to every file given (created as
    needed); each line names its part and the fla autotune rule of this process."""

    def __init__(self, paths: list[str], part: str, device: str, call: float) -> None:
        self.paths = [Path(p) for p in paths]
        self.part = part
        self.call = call  # the call's start (epoch seconds): which lines are this call's
        self.device = device
        self.ok = True
        for p in self.paths:
            p.parent.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, ok: bool, seconds: float, **data: Any) -> None:
        self.ok &= ok
        row = {
            "part": self.part,
            "name": name,
            "ok": ok,
            "seconds": round(seconds, 1),
            "call": self.call,
            "device": self.device,
            "torch": torch.__version__,
            "fla_autotune": gpu_autotune.applied()["rule"],
            **data,
        }
        line = json.dumps(row, default=str)
        for p in self.paths:
            with open(p, "a") as f:
                f.write(line + "\n")
        label = self.part if name == self.part else f"{self.part}/{name}"
        print(f"gpu_check: {label}: {'ok' if ok else 'FAILED'} ({seconds:.0f} s)", flush=True)


@contextlib.contextmanager
def timed() -> Iterator[Callable[[], float]]:
    t0 = time.perf_counter()
    yield lambda: time.perf_counter() - t0


def no_flex_max_autotune() -> None:
    """Compile torchtitan's flex attention without max_autotune and coordinate descent (the
    defaults of ``FlexAttention.inductor_configs`` cost minutes of autotuning per shape). Once
    per process, so every trainer and model of the process shares one compile."""
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


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Step:
    """One optimizer step of the model on one microbatch, through a SequencePreprocessor."""

    def __init__(self, args, source: str, compile_backend: str | None = None) -> None:
        self.device = torch.device(args.device)
        self.dtype = _dtype(args)
        torch.manual_seed(0)
        cfg = model_config(
            args.flavor,
            layer_pattern=args.pattern,
            attention_backend=args.attention_backend,
            **({"head_dim": args.head_dim} if args.head_dim else {}),
        )
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
                load_balancer="headtail",
                batch_size=args.batch,
                seq_len=args.seq_len,
                cp_degree=1,
                ptrr_block_size=128,
                max_subsequences=args.max_subsequences,
            )
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


def _frame(frames: list[traceback.FrameSummary]) -> str:
    """``file:line function`` of the innermost project, fla or torchtitan frame (where to look),
    else the innermost frame."""
    ours = [
        f for f in frames
        if any(s in f.filename.replace("\\", "/") for s in ("torchtitan_cp/", "/fla/", "/torchtitan/"))
    ]  # fmt: skip # a table, laid out by hand to read across
    # Else the innermost frame outside the warnings machinery, this script and torch.
    skip = (os.path.dirname(warnings.__file__) + os.sep, __file__, os.path.dirname(torch.__file__))
    others = [f for f in frames if not f.filename.startswith(skip)]
    f = (ours or others or frames or [None])[-1]
    if f is None:
        return "?"
    parts = f.filename.replace("\\", "/").split("/")
    # From the package root on (our modules nest up to ops/<family>/), else the last three parts.
    root = next((i for i in range(len(parts) - 1, -1, -1) if parts[i] == "torchtitan_cp"), None)
    return f"{'/'.join(parts[-3:] if root is None else parts[root:])}:{f.lineno} {f.name}"


def sync_site(exc: BaseException) -> str:
    """``_frame`` of the traceback of ``exc`` (an error's site, e.g. a failed part)."""
    return _frame(traceback.extract_tb(exc.__traceback__))


@contextlib.contextmanager
def sync_warnings() -> Iterator[list[str]]:
    """Collect every warning about a synchronising CUDA operation inside, in order, as
    ``"frame: message"``: the Python stack at the moment torch warns names the frame that
    made it (``_frame``); other warnings pass through."""
    found: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            text = str(message)
            if "synchroniz" not in text:
                return shown(message, category, filename, lineno, file, line)
            found.append(f"{_frame(traceback.extract_stack()[:-1])}: {text.splitlines()[0][:100]}")

        warnings.showwarning = show
        yield found


@contextlib.contextmanager
def cuda_syncs() -> Iterator[list[str]]:
    """Every synchronisation inside under ``set_sync_debug_mode("warn")`` (``sync_warnings``):
    all of them, where ``"error"`` mode gives only the first. A synchronisation inside a C++
    backward formula is replayed by the autograd engine when ``backward()`` returns (its
    ``DelayWarningHandler``), so its frame is the backward call; Python backward code (custom
    Functions, the custom ops' bodies) keeps its own frame."""
    torch.cuda.synchronize()
    with sync_warnings() as found:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()  # outside the mode: the step's own work, not the next one's


def _counted(lines: list[str]) -> list[str]:
    """Distinct lines, first-seen order, ``"Nx ..."`` where one repeats."""
    counts: dict[str, int] = {}
    for line in lines:
        counts[line] = counts.get(line, 0) + 1
    return [f"{n}x {e}" if n > 1 else e for e, n in counts.items()]


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
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
    }.items():
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


def trainer_sync_check(
    device: str, source: str, *, control: bool = False, backend: str | None = None
) -> dict[str, Any]:
    """The recipe's trainer (or, ``control``, torchtitan's own step) on ``source`` routing, the
    linear layers on ``backend`` (None: the config's): every synchronisation of steps 2-3 and
    of the log step, with its frame (CUDA: ``cuda_syncs``; CPU: ``HostSyncRecorder``).
    Returns ``{"steps": {step: [sync, ...]}, "synchronised": any in steps 2-3, ...}``."""
    argv = [*TRAINER_ARGS, "--linear_attention.routing_source", source]
    if backend is not None:
        argv += ["--linear_attention.backend", backend]
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
        with cuda_syncs() as found:
            try:
                yield
            finally:
                steps[step] = _counted(found)

    watch = watch_cuda if device == "cuda" else watch_cpu
    run_trainer(argv, watch, control)
    strict = {s: steps.get(s, ["(step not reached)"]) for s in STRICT_STEPS}
    return {
        "source": source,
        "backend": backend or "config",
        "step": "torchtitan" if control else "recipe",
        "steps": {str(s): v for s, v in sorted(steps.items())},
        "synchronised": any(strict.values()),
    }


def model_step_sync_check(args, gen) -> dict[str, list[str]]:
    """The fallback where the trainer cannot run: one model step (no trainer loop) after a
    warm-up, every synchronisation listed, host vs readback."""
    out = {}
    for source in ("host", "device_readback"):
        step = Step(args, source)
        step(
            *(
                t.pin_memory()
                for t in packed_batch(gen, args.batch, args.seq_len, step.vocab, args.mean_doc)
            )
        )
        pinned = [
            t.pin_memory()
            for t in packed_batch(gen, args.batch, args.seq_len, step.vocab, args.mean_doc)
        ]
        with cuda_syncs() as found:
            step(*pinned)
        out[source] = _counted(found)
    return out


def part_trainer_sync(args, res: Results, gen) -> None:
    import gpu_imports

    error = gpu_imports.check(gpu_imports.TRAINER_IMPORTS)
    if error is not None:  # the trainer cannot even import here: the model step instead
        res.add("trainer_imports", False, 0.0, error=error)
        fallback_model_step(args, res, gen)
        return
    runs = (
        ("host", False, None),
        ("host", False, "torch"),
        ("device_readback", False, None),
        ("host", True, None),
    )
    for source, control, backend in runs:
        with timed() as t:
            try:
                out = trainer_sync_check(args.device, source, control=control, backend=backend)
            except TrainerUnavailable as e:  # the trainer's one line: this torch cannot run it
                res.add("trainer", False, t(), unavailable=str(e))
                fallback_model_step(args, res, gen)
                return
        expect_sync = source != "host" or control
        name = "torchtitan_step" if control else source + ("_torch" if backend else "")
        res.add(name, out["synchronised"] == expect_sync, t(), expect_sync=expect_sync, **out)


def fallback_model_step(args, res: Results, gen) -> None:
    if args.device != "cuda":
        res.add("model_step_sync", True, 0.0, skipped="the model-step check needs CUDA")
        return
    a = argparse.Namespace(
        **{
            **vars(args),
            "flavor": "debug",
            "pattern": "KGKA",
            "head_dim": 64,
            "dtype": "float32",
            "batch": 2,
            "seq_len": 256,
            "mean_doc": 40,
        }
    )
    with timed() as t:
        out = model_step_sync_check(a, gen)
    res.add("model_step_sync", out["host"] == [] and out["device_readback"] != [], t(), **out)


# ---------------------------------------------------------------------------------------------
# pytest parts
# ---------------------------------------------------------------------------------------------


def _pytest(args, res: Results, targets: tuple[str, ...], extra: list[str], rule: str) -> None:
    """Run ``targets`` with pytest in a child process; scripts/gpu_check_pytest.py appends one
    line per test to the results files and prunes fla's autotune by ``rule`` there."""
    xdist = subprocess.run([sys.executable, "-c", "import xdist"], capture_output=True)
    par = ["-n", "8"] if xdist.returncode == 0 and args.device == "cuda" else []
    env = dict(
        os.environ,
        GPU_CHECK_RESULTS=os.pathsep.join(args.results),
        GPU_CHECK_PART=res.part,
        GPU_CHECK_FLA_AUTOTUNE=rule,
        GPU_CHECK_CALL=str(res.call),
    )
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "scripts"), str(ROOT), env.get("PYTHONPATH", "")]
    )
    with timed() as t:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-p",
                "gpu_check_pytest",
                "-rs",
                *par,
                *extra,
                *targets,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=env,
        )
    sys.stdout.write(proc.stdout[-6000:])
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    res.add(res.part, proc.returncode == 0, t(), exit_code=proc.returncode, summary=summary)


def part_correctness(args, res: Results, gen) -> None:
    # On CPU only what the fast loop runs: fla's kernels need CUDA (or the interpreter tier).
    extra = ["-m", "gpu_check" if args.device == "cuda" else "gpu_check and not slow"]
    _pytest(args, res, PARITY_TESTS, extra, "smallest")


def part_cuda_tests(args, res: Results, gen) -> None:
    _pytest(args, res, CUDA_TESTS, [], "smallest")


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def part_timing(args, res: Results, gen) -> None:
    with timed() as t:
        out = timing(args, gen)
    ok = out["host"]["readbacks_per_step"] == 0 and out["device_readback"]["readbacks_per_step"] > 0
    res.add(
        "step_time",
        ok,
        t(),
        flavor=args.flavor,
        pattern=args.pattern,
        tokens=args.batch * args.seq_len,
        **out,
    )
    print(
        f"\n| routing_source | median ms | min ms | tokens/s | readbacks/step |  "
        f"({args.flavor} {args.pattern}, {args.batch}x{args.seq_len})"
    )
    for k, v in out.items():
        print(
            f"| {k} | {v['median_ms']:.2f} | {v['min_ms']:.2f} | {v['tokens_per_s']:,.0f} | "
            f"{v['readbacks_per_step']:.1f} |"
        )


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
            _sync(args.device)
            t0 = time.perf_counter()
            step(*batch)
            _sync(args.device)
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


def part_compile(args, res: Results, gen) -> None:
    with timed() as t:
        out = compile_timing(args, gen)
    ok = out["compiled"]["frames_compiled_after_warmup"] == 0
    res.add("compile", ok, t(), backend=args.compile_backend, **out)
    for k, v in out.items():
        print(
            f"| {k} | first step {v['first_step_ms']:.0f} ms | median {v['median_ms']:.2f} ms "
            f"| {v['tokens_per_s']:,.0f} tokens/s | {v['frames_compiled_after_warmup']} |"
        )


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
            _sync(args.device)
            if i == args.warmup:
                frames_after_warmup = compile_counters()["compile/frames"]
            t0 = time.perf_counter()
            step(tok, pos)
            _sync(args.device)
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


# ---------------------------------------------------------------------------------------------
# The CP op in milliseconds
# ---------------------------------------------------------------------------------------------

CP_OP_WORLD = 4
# FLA #691 (GDN, 32k tokens, CP over 4 H800s): 5.73 ms per rank against 15.56 ms unsharded.
FLA_691 = {
    "kernel": "gdn",
    "tokens": 32768,
    "world": 4,
    "cp_ms_per_rank": 5.73,
    "unsharded_ms": 15.56,
    "gpu": "H800",
}


def _bench_ms(device: str, fn: Callable[[], Any], reps: int) -> float:
    """Median milliseconds of ``fn`` (after two warm-up calls): CUDA events on CUDA."""
    for _ in range(2):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cp_op_timing(
    device: str,
    T: int,
    *,
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    backend: str,
    world: int = CP_OP_WORLD,
    reps: int = 5,
) -> dict[str, Any]:
    """KDA over one document of ``T`` tokens cut into ``world`` contiguous rank spans, simulated
    in one process as ``cp_gradients`` does (the spans in reverse order in one span on the
    world-1 path, so every continuation goes through a summary and the fold): forward and
    forward + backward milliseconds of the local kernel alone on the same tokens with given
    entry states (what a rank runs without CP's summaries and fold), of the CP op, and of the
    unsharded kernel over the whole document. The simulated span holds every rank's tokens,
    so ``*_per_rank`` is a W-th of it (the all-gather, an identity here, is not counted)."""
    import torch.nn.functional as F

    from torchtitan_cp.ops import chunk_delta_rule, context_parallel_delta_rule
    from torchtitan_cp.routing import RoutingPlan, contiguous_fragments

    dev = torch.device(device)
    H, K = heads, head_dim
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=dev)

    table = [list(f) for f in contiguous_fragments(T, 1, world)]
    span = [f for r in reversed(range(world)) for f in table[r]]
    routing = RoutingPlan.build([0, T], [span], 0).to_device(dev)
    q = F.normalize(rnd(1, T, H, K), dim=-1).to(dtype)
    k = F.normalize(rnd(1, T, H, K), dim=-1).to(dtype)
    v = rnd(1, T, H, K).to(dtype)
    g = (-F.softplus(rnd(1, T, H, K)) * 0.1).float()  # log gates stay float32
    beta = torch.sigmoid(rnd(1, T, H)).to(dtype)
    leaves = [x.requires_grad_(True) for x in (q, k, v, g, beta)]
    n_sub = routing.cu_seqlens.numel() - 1
    h0 = torch.zeros(n_sub, H, K, K, device=dev)  # the entry states a rank would receive
    ones = None

    def kernel(plan: RoutingPlan, initial_state: torch.Tensor | None = None) -> torch.Tensor:
        return chunk_delta_rule(
            *leaves,
            kind="kda",
            initial_state=initial_state,
            cu_seqlens=plan.cu_seqlens,
            cu_seqlens_cpu=plan.cu_seqlens_cpu,
            chunk_indices=plan.chunk_indices,
            chunk_offsets=plan.chunk_offsets,
            backend=backend,
        )[0]

    def cp() -> torch.Tensor:
        return context_parallel_delta_rule(
            *leaves, kind="kda", routing=routing, group=None, backend=backend
        )[0]

    whole = RoutingPlan.build([0, T], [[(0, T)]], 0).to_device(dev)  # its chunk tables
    local = functools.partial(kernel, routing, h0)
    unsharded = functools.partial(kernel, whole)

    out: dict[str, Any] = {
        "tokens": T,
        "world": world,
        "heads": H,
        "head_dim": K,
        "dtype": str(dtype).split(".")[-1],
        "backend": backend,
    }
    for name, fn in (("local", local), ("cp", cp), ("unsharded", unsharded)):
        with torch.no_grad():
            out[f"{name}_fwd_ms"] = _bench_ms(device, fn, reps)

        def fwd_bwd(fn=fn) -> None:
            nonlocal ones
            o = fn()
            ones = torch.ones_like(o) if ones is None or ones.shape != o.shape else ones
            torch.autograd.backward(o, ones)
            for x in leaves:
                x.grad = None

        out[f"{name}_fwd_bwd_ms"] = _bench_ms(device, fwd_bwd, reps)
    for kind in ("fwd", "fwd_bwd"):
        for name in ("local", "cp"):
            out[f"{name}_{kind}_ms_per_rank"] = out[f"{name}_{kind}_ms"] / world
        out[f"cp_over_local_{kind}"] = out[f"cp_{kind}_ms"] / out[f"local_{kind}_ms"]
    return out


def part_cp_op_ms(args, res: Results, gen) -> None:
    cuda = args.device == "cuda"
    lengths = args.cp_tokens if cuda else [256, 512]
    for T in lengths:
        with timed() as t:
            out = cp_op_timing(
                args.device,
                T,
                heads=16 if cuda else 2,
                head_dim=128 if cuda else 16,
                dtype=torch.bfloat16 if cuda else torch.float32,
                backend="fla" if cuda else "torch",
            )
        res.add(f"kda_{T}", True, t(), **out, reference=FLA_691)
        print(
            f"| KDA {T} W={out['world']} | local {out['local_fwd_bwd_ms_per_rank']:.2f} | CP "
            f"{out['cp_fwd_bwd_ms_per_rank']:.2f} ms/rank ({out['cp_over_local_fwd_bwd']:.2f}x) "
            f"| unsharded {out['unsharded_fwd_bwd_ms']:.2f} ms |"
        )


# ---------------------------------------------------------------------------------------------
# fla's autotune across processes
# ---------------------------------------------------------------------------------------------


def part_autotune_reuse(args, res: Results, gen) -> None:
    """Two fresh processes run fla's causal conv (bfloat16, the 150M model's width) forward and
    backward with fla's full autotune kept in one new folder (``fla_autotune.persist``): the
    first tunes, the second must tune nothing; each records its first call's seconds."""
    if args.device != "cuda":
        res.add(
            "autotune_reuse",
            True,
            0.0,
            skipped="Triton's autotuner benchmarks on a GPU; "
            "on CPU tests/test_fla_autotune.py checks the mechanism",
        )
        return
    me = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--device",
        "cuda",
        "--part",
        "autotune_probe",
        *(a for p in args.results for a in ("--results", p)),
    ]
    with tempfile.TemporaryDirectory() as folder, timed() as t:
        codes = [subprocess.run([*me, "--autotune-dir", folder]).returncode for _ in range(2)]
    res.add("autotune_reuse", not any(codes), t(), exit_codes=codes)


def part_autotune_probe(args, res: Results, gen) -> None:
    from torchtitan_cp.ops import causal_conv1d
    from torchtitan_cp.ops.common import fla_autotune

    fla_autotune.persist(args.autotune_dir)
    shapes = model_shapes(args.flavor, args.head_dim)
    T, D = args.seq_len, shapes["conv_dim"]
    x = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(D, 4, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, T // 3, T], dtype=torch.int32)
    with timed() as t:
        y = causal_conv1d(x, w, None, cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu, backend="fla")
        y.float().square().mean().backward()
        torch.cuda.synchronize()
    stats = fla_autotune.stats()
    first = not stats["loaded"]
    ok = stats["tuned"] > 0 if first else stats["tuned"] == 0
    res.add(
        "first_process" if first else "second_process",
        ok,
        t(),
        first_call_s=t(),
        conv_dim=D,
        tokens=T,
        **stats,
    )


def model_shapes(flavor: str, head_dim: int | None) -> dict[str, int]:
    cfg = model_config(flavor, **({"head_dim": head_dim} if head_dim else {}))
    v = getattr(cfg, "value_head_dim", None) or cfg.head_dim
    h, k = cfg.n_heads, cfg.head_dim
    return {"heads": h, "head_dim": k, "value_dim": v, "conv_dim": 2 * h * k + h * v}


# ---------------------------------------------------------------------------------------------
# The environment
# ---------------------------------------------------------------------------------------------


def _tool_version(cmd: list[str]) -> str | None:
    """The last line of ``cmd``'s answer (``ptxas --version``, ``nvidia-smi ...``), or None."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    return lines[-1] if out.returncode == 0 and lines else None


def environment(device: str) -> dict[str, Any]:
    """What decides correctness on the GPU: torch, its CUDA build, triton, the ptxas Triton
    compiles with (FLA #1262: wrong Hopper state gradients with ptxas 12.8.93), the driver, the
    device and its capability, fla-core, tilelang and nvcc, and which kernels run the gated
    backward (GDN, Mamba2, retention) and why (``fla_refusals``: Hopper with 3.4.0 <= triton <
    3.7.1, fla #640; fla's TileLang route needs an nvcc, fla #1026)."""
    from torchtitan_cp.ops.common.fla_refusals import (
        device_facts,
        fla_gated_backward_path,
        fla_gated_backward_refusal,
    )

    facts = device_facts()
    env: dict[str, Any] = {
        "torch_version": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": facts.triton,
        "tilelang": facts.tilelang,
        "nvcc": facts.nvcc,
    }
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
    env["fla_gated_backward"] = fla_gated_backward_refusal(facts) or "runs"
    env["gated_backward"] = fla_gated_backward_path(facts)
    return env


# ---------------------------------------------------------------------------------------------
# Parts and the one call
# ---------------------------------------------------------------------------------------------


class Part(NamedTuple):
    """One part of the call: its function, its time box in seconds on the H200 (docs/gpu.md:
    measured or estimated durations with room), and the fla autotune rule of its process."""

    run: Callable[[Any, Results, torch.Generator], None]
    box_s: float
    fla_autotune: str | None  # gpu_autotune rule, None: fla's own full autotune


# Priority order: what proves the CUDA path first, then what measures it.
PARTS: dict[str, Part] = {
    "correctness": Part(part_correctness, 150, "smallest"),
    "trainer_sync": Part(part_trainer_sync, 120, "smallest"),
    "timing": Part(part_timing, 130, "first"),
    "cp_op_ms": Part(part_cp_op_ms, 90, "first"),
    "compile": Part(part_compile, 150, "first"),
    "autotune_reuse": Part(part_autotune_reuse, 90, None),
    "cuda_tests": Part(part_cuda_tests, 300, "smallest"),
}
HELPERS: dict[str, Part] = {"autotune_probe": Part(part_autotune_probe, 60, None)}
MIN_PART_S = 15.0  # a part with less time than this left is skipped, not started


def run_all(args, res: Results) -> None:
    """Every part of ``PARTS`` in order, each its own process, killed at its box or the
    deadline; one line (under the part's name) per part that did not finish by itself."""
    deadline = args.started_at + args.budget
    me = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--device",
        args.device,
        "--started-at",
        str(args.started_at),
        "--budget",
        str(args.budget),
    ]
    passthrough = []
    for flag in (
        "flavor",
        "pattern",
        "head_dim",
        "dtype",
        "attention_backend",
        "batch",
        "seq_len",
        "mean_doc",
        "steps",
        "warmup",
        "compile_backend",
        "max_subsequences",
    ):
        passthrough += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    passthrough += ["--cp-tokens", *map(str, args.cp_tokens)]
    results = [a for p in args.results for a in ("--results", p)]
    for name, part in PARTS.items():
        if args.skip and name in args.skip:
            continue
        mine = Results([str(p) for p in res.paths], name, args.device, res.call)
        left = deadline - time.time()
        if left < MIN_PART_S:
            mine.add(name, False, 0.0, skipped=f"no time left ({left:.0f} s before the deadline)")
            continue
        box = min(part.box_s * args.box_scale, left)
        with timed() as t:
            proc = subprocess.Popen([*me, "--part", name, *passthrough, *results])
            try:
                code = proc.wait(timeout=box)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                code = None
        if code is None:
            mine.add(
                name,
                False,
                t(),
                timed_out=f"killed after its {box:.0f} s box "
                f"({'the deadline' if box < part.box_s * args.box_scale else 'its own'})",
            )
        elif code != 0:
            mine.add(name, False, t(), exit_code=code)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--all", action="store_true", help="every part, in order (the one call)")
    which.add_argument("--part", choices=sorted({*PARTS, *HELPERS}))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument(
        "--results", action="append", default=[], help="JSON-lines file to append to (repeatable)"
    )
    p.add_argument(
        "--started-at",
        type=float,
        default=None,
        help="epoch seconds the call started (gpu_check.sh); default now",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=480.0,
        help="seconds from --started-at to the deadline of every part",
    )
    p.add_argument(
        "--box-scale",
        type=float,
        default=1.0,
        help="scale every part's time box (the CPU dry run is slower)",
    )
    p.add_argument("--skip", action="append", default=[], help="a part --all leaves out")
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
    p.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend of the compile part"
    )
    p.add_argument(
        "--max-subsequences",
        type=int,
        default=256,
        help="routing cap of the compiled run (linear_attention.max_subsequences)",
    )
    p.add_argument(
        "--cp-tokens",
        type=int,
        nargs="+",
        default=[32768, 131072],
        help="stream lengths of the cp_op_ms part",
    )
    p.add_argument("--autotune-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --device cpu for a dry run", file=sys.stderr)
        return 2
    if args.started_at is None:
        args.started_at = time.time()
    gen = torch.Generator().manual_seed(0)
    if args.all:
        res = Results(args.results, "call", args.device, args.started_at)
        env = environment(args.device)
        res.add("environment", True, 0.0, **env)
        print(f"gpu_check: {env['gated_backward']}", flush=True)
        with timed() as t:
            import gpu_imports

            error = gpu_imports.check()
        res.add(
            "imports", error is None, t(), error=error, count=len(gpu_imports.CUDA_PATH_IMPORTS)
        )
        if error is None:
            run_all(args, res)
        ok = _all_ok(args.results, args.started_at)
        res.add("done", ok, time.time() - args.started_at)
        return 0 if ok else 1
    part = {**PARTS, **HELPERS}[args.part]
    if part.fla_autotune is not None:
        # Before fla's kernel modules load: one config per autotuner (scripts/gpu_autotune.py).
        gpu_autotune.prune(part.fla_autotune)
    if args.device == "cuda":
        no_flex_max_autotune()
    res = Results(args.results, args.part, args.device, args.started_at)
    with timed() as t:
        try:
            part.run(args, res, gen)
        except Exception as e:  # recorded, so the next part still runs
            res.add(
                "error", False, t(), error=f"{type(e).__name__}: {str(e)[:300]}", site=sync_site(e)
            )
            traceback.print_exc()
    return 0 if res.ok else 1


def _all_ok(paths: list[str], call: float) -> bool:
    """Every line this call appended (its parts' own lines included) says ok."""
    if not paths:
        return True
    rows = [json.loads(line) for line in Path(paths[0]).read_text().splitlines() if line]
    return all(r["ok"] for r in rows if r.get("call") == call)


if __name__ == "__main__":
    sys.exit(main())
