"""GPU evidence for the host-metadata routing (run by scripts/gpu_check.sh on one GPU).

1. Sync check: one training step (preprocessing, forward, backward, AdamW) of the hybrid model
   under ``torch.cuda.set_sync_debug_mode("error")`` on the host path must not synchronise; the
   same step on the device-readback path must (its document offsets are read back).
2. Kernel accuracy: fla-core against the pure-PyTorch backend for KDA, GDN and the causal conv,
   forward and backward, in float32 and bfloat16 (CUDA only).
3. Step time at CP=1 on packed documents, host vs readback, a new packing every step.
4. Compiled vs eager step time (every block ``torch.compile``d with ``fullgraph=True`` as
   torchtitan does, routing padded to fixed caps), with the compile time of the first step and
   the frames dynamo compiled after it (0: no recompile across layouts).

``--device cpu`` runs the same code without the sync check and the kernel comparison (a dry run
for CI machines; ``--compile-backend aot_eager`` keeps its compile short). Prints markdown
tables; ``--json PATH`` also writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import torch

from torchtitan_cp.data.host_metadata import HostMetadata
from torchtitan_cp.models import model_config
from torchtitan_cp.trainer.sequence import SequencePreprocessor


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


class Step:
    """One optimizer step of the model on one microbatch, through a SequencePreprocessor."""

    def __init__(self, args, source: str, compile_backend: str | None = None) -> None:
        self.device = torch.device(args.device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        torch.manual_seed(0)
        cfg = model_config(
            args.flavor, layer_pattern=args.pattern, attention_backend=args.attention_backend
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
    ours = [f for f in frames if "torchtitan_cp" in f.filename or "/fla/" in f.filename]
    f = (ours or frames or [None])[-1]
    if f is None:
        return "?"
    parts = f.filename.replace("\\", "/").split("/")
    # From the package root on (our modules nest up to ops/<family>/), else the last three parts.
    root = next((i for i in range(len(parts) - 1, -1, -1) if parts[i] == "torchtitan_cp"), None)
    return f"{'/'.join(parts[-3:] if root is None else parts[root:])}:{f.lineno} {f.name}"


def sync_check(args, gen) -> dict[str, str]:
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


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((a.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()


def kernel_accuracy(args, gen) -> list[dict]:
    """fla against the torch backend on the same inputs (the torch backend computes in float32
    from them), KDA / GDN / conv, forward and backward: max relative error per tensor."""
    import torch.nn.functional as F

    from torchtitan_cp.ops import causal_conv1d, chunk_delta_rule

    dev = torch.device("cuda")
    lengths = torch.randint(1, 2 * args.mean_doc, (64,), generator=gen).tolist()
    cu = [0]
    for n in lengths:
        if cu[-1] + n > args.seq_len:
            break
        cu.append(cu[-1] + n)
    cu.append(args.seq_len)
    cu_cpu = torch.tensor(cu, dtype=torch.int32)
    T, H, K, V = args.seq_len, 4, 128, 128
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for kind in ("kda", "gdn"):
            q = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
            k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
            v = torch.randn(1, T, H, V, generator=gen)
            gshape = (1, T, H, K) if kind == "kda" else (1, T, H)
            g = -0.1 * torch.rand(*gshape, generator=gen)
            beta = torch.rand(1, T, H, generator=gen)
            inputs = [x.to(dev, dtype) for x in (q, k, v)] + [g.to(dev), beta.to(dev, dtype)]
            out = {}
            for backend in ("fla", "torch"):
                xs = [x.detach().clone().requires_grad_() for x in inputs]
                o, ht = chunk_delta_rule(
                    *xs, kind=kind, output_final_state=True, cu_seqlens=cu_cpu.to(dev),
                    cu_seqlens_cpu=cu_cpu, backend=backend,
                )  # fmt: skip
                assert ht is not None
                do = torch.ones_like(o) / o.numel() ** 0.5
                grads = torch.autograd.grad((o * do).sum() + ht.sum() * 1e-3, xs)
                out[backend] = [o, ht, *grads]
            names = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta")
            errs = {n: _rel_err(a, b) for n, a, b in zip(names, out["fla"], out["torch"])}
            rows.append({"kernel": kind, "dtype": str(dtype).split(".")[-1], **errs})
        x = torch.randn(1, T, 3 * H * K, generator=gen).to(dev, dtype)
        w = torch.randn(3 * H * K, 4, generator=gen).to(dev, dtype)
        out = {}
        for backend in ("fla", "torch"):
            xs = [x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()]
            y = causal_conv1d(
                *xs, None, cu_seqlens=cu_cpu.to(dev), cu_seqlens_cpu=cu_cpu, backend=backend
            )
            out[backend] = [y, *torch.autograd.grad(y.float().square().mean(), xs)]
        names = ("o", "dx", "dweight")
        errs = {n: _rel_err(a, b) for n, a, b in zip(names, out["fla"], out["torch"])}
        rows.append({"kernel": "conv", "dtype": str(dtype).split(".")[-1], **errs})
    return rows


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--flavor", default="150M")
    p.add_argument("--pattern", default="KKKAKKKAKKKA")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "flex", "sdpa"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--mean-doc", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of the compiled-vs-eager timing",
    )
    p.add_argument("--no-compile", action="store_true", help="skip the compiled-vs-eager timing")
    p.add_argument(
        "--max-subsequences",
        type=int,
        default=256,
        help="routing cap of the compiled run (linear_attention.max_subsequences)",
    )
    p.add_argument("--json", default="")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device; use --device cpu for a dry run")
    gen = torch.Generator().manual_seed(0)
    result: dict = {"args": vars(args), "torch": torch.__version__}
    if args.device == "cuda":
        result["device_name"] = torch.cuda.get_device_name()
        result["sync_check"] = sync_check(args, gen)
        print("\n## Sync check (torch.cuda.set_sync_debug_mode('error'), one training step)\n")
        print("| routing_source | result |\n| --- | --- |")
        for k, v in result["sync_check"].items():
            print(f"| {k} | {v} |")
    if args.device == "cuda":
        result["kernel_accuracy"] = kernel_accuracy(args, gen)
        print("\n## fla vs the torch backend (max relative error, same inputs)\n")
        for row in result["kernel_accuracy"]:
            errs = ", ".join(f"{k} {v:.1e}" for k, v in row.items() if k not in ("kernel", "dtype"))
            print(f"- {row['kernel']} {row['dtype']}: {errs}")
    result["timing"] = timing(args, gen)
    print(
        f"\n## Step time, CP=1, {args.flavor} {args.pattern} (attention "
        f"{args.attention_backend}), {args.batch}x{args.seq_len} "
        f"tokens, documents of mean {args.mean_doc} tokens, new packing each step\n"
    )
    print("| routing_source | median ms | min ms | tokens/s | readbacks/step |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for k, v in result["timing"].items():
        print(
            f"| {k} | {v['median_ms']:.2f} | {v['min_ms']:.2f} | {v['tokens_per_s']:,.0f} | "
            f"{v['readbacks_per_step']:.1f} |"
        )
    if not args.no_compile:
        result["compile"] = compile_timing(args, gen)
        print(f"\n## Compiled ({args.compile_backend}, fullgraph blocks) vs eager, host path\n")
        print("| mode | first step ms | median ms | tokens/s | frames compiled after warm-up |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for k, v in result["compile"].items():
            print(
                f"| {k} | {v['first_step_ms']:.0f} | {v['median_ms']:.2f} | "
                f"{v['tokens_per_s']:,.0f} | {v['frames_compiled_after_warmup']} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
