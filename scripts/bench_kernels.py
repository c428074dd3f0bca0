"""Throughput of the pure-PyTorch local kernels (forward and forward+backward), as a markdown table.

    .venv/bin/python scripts/bench_kernels.py [--sizes debug small] [--repeats 3] [--threads 1]

Inputs are float32, q/k l2-normalised, KDA/GDN log gates in [-1, 0), packed documents of mixed
length. Timings are the median over ``--repeats`` runs after one warm-up; wall time, plus the
process CPU time (a steadier measure on a shared machine when running one thread).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from torchtitan_cp.ops.conv.local import causal_conv1d
from torchtitan_cp.ops.delta_rule.local import chunk_delta_rule

# name -> (H, K = V, document lengths); T = sum of the lengths.
SIZES = {
    "debug": (2, 32, [700, 1, 300, 517, 17, 130, 383]),  # T = 2048
    "small": (8, 64, [1500, 1000, 1, 799, 500, 200, 96]),  # T = 4096
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, repeats: int, device: torch.device) -> tuple[float, float]:
    """Median (wall seconds, process CPU seconds). On a shared CPU the wall time includes
    waiting for a core; the CPU time is what the kernel itself costs."""
    fn()  # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        _sync(device)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def bench_delta_rule(kind: str, size: str, repeats: int, device: torch.device, backend: str):
    H, K, lengths = SIZES[size]
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    q = F.normalize(rnd(1, T, H, K), dim=-1).requires_grad_()
    k = F.normalize(rnd(1, T, H, K), dim=-1).requires_grad_()
    v = rnd(1, T, H, K).requires_grad_()
    gshape = (1, T, H, K) if kind == "kda" else (1, T, H)
    g = (-torch.rand(*gshape, generator=gen)).to(device).requires_grad_()
    beta = torch.rand(1, T, H, generator=gen).to(device).requires_grad_()
    kw = dict(kind=kind, cu_seqlens=cu.to(device), cu_seqlens_cpu=cu, backend=backend)

    def fwd():
        with torch.no_grad():
            chunk_delta_rule(q, k, v, g, beta, **kw)

    def fwd_bwd():
        o, _ = chunk_delta_rule(q, k, v, g, beta, **kw)
        o.sum().backward()

    return T, len(lengths), _time(fwd, repeats, device), _time(fwd_bwd, repeats, device)


def bench_conv(size: str, repeats: int, device: torch.device, backend: str):
    H, K, lengths = SIZES[size]
    T, D = sum(lengths), 3 * H * K  # q, k and v share one conv in a fused layer
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(1, T, D, device=device, requires_grad=True)
    w = torch.randn(D, 4, device=device, requires_grad=True)
    kw = dict(cu_seqlens=cu.to(device), cu_seqlens_cpu=cu, backend=backend)

    def fwd():
        with torch.no_grad():
            causal_conv1d(x, w, **kw)

    def fwd_bwd():
        causal_conv1d(x, w, **kw).sum().backward()

    return T, len(lengths), _time(fwd, repeats, device), _time(fwd_bwd, repeats, device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="torch", choices=["torch", "fla", "auto"])
    # One intra-op thread by default: on a small shared CPU, OpenMP threads that spin-wait for
    # a busy core can make batched LAPACK calls (solve_triangular) 100x slower.
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"device={device} backend={args.backend} torch={torch.__version__} "
        f"threads={torch.get_num_threads()} dtype=float32\n"
    )
    print(
        "| op | size | H | K=V | T | docs | fwd ms | fwd+bwd ms | fwd+bwd tokens/s "
        "| fwd+bwd CPU ms | fwd+bwd tokens/CPU-s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for size in args.sizes:
        H, K, _ = SIZES[size]
        for op in ("kda", "gdn", "conv"):
            if op == "conv":
                T, n, tf, tfb = bench_conv(size, args.repeats, device, args.backend)
                hk = f"D={3 * H * K}, W=4"
            else:
                T, n, tf, tfb = bench_delta_rule(op, size, args.repeats, device, args.backend)
                hk = str(K)
            (tf, _), (tfb, cfb) = tf, tfb
            print(
                f"| {op} | {size} | {H} | {hk} | {T} | {n} | {tf * 1e3:.1f} | {tfb * 1e3:.1f} "
                f"| {T / tfb:,.0f} | {cfb * 1e3:.1f} | {T / cfb:,.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
