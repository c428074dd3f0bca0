"""GPU evidence for the host-metadata routing (run by scripts/gpu_check.sh on one GPU).

1. Sync check: one training step (preprocessing, forward, backward, AdamW) of the hybrid model
   under ``torch.cuda.set_sync_debug_mode("error")`` on the host path must not synchronise; the
   same step on the device-readback path must (its document offsets are read back).
2. Step time at CP=1 on packed documents, host vs readback, a new packing every step.

``--device cpu`` runs the same code without the sync check (a dry run for CI machines).
Prints markdown tables; ``--json PATH`` also writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import torch

from torchtitan_cp.host_metadata import HostMetadata
from torchtitan_cp.models import model_config
from torchtitan_cp.sequence import SequencePreprocessor


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

    def __init__(self, args, source: str) -> None:
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
        self.pre = SequencePreprocessor(
            device=self.device,
            cp_group=None,
            load_balancer="headtail",
            routing_source=source,
            conv_history=cfg.conv_width - 1,
            flex_attention=cfg.uses_flex_attention(self.device),
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
    return f"{'/'.join(parts[-3:])}:{f.lineno} {f.name}"


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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
