"""Point-to-point through torch.distributed, timed as `fairring-bench
--collective send_recv` times fairring's own: a ping-pong between two processes
(`dist.send` then `dist.recv` on rank 0, the reverse on rank 1), the median over
iterations of half the round trip, algbw = bytes / that.

    python torch_send_recv.py fairring [ITERS]   # 1x2: one machine, shared memory
    LAYOUT=2x1 python torch_send_recv.py fairring  # two simulated machines (tcp)
    python torch_send_recv.py gloo
"""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [4096, 64 << 20]


def run(rank, backend, port, iters, results):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if os.environ.get("LAYOUT") == "2x1":
        os.environ["FAIRRING_HOST_ID"] = f"machine-{rank}"
    if backend == "fairring":
        import fairring  # noqa: F401  (registers the backend)
    dist.init_process_group(backend, rank=rank, world_size=2)
    torch.set_num_threads(1)
    medians = {}
    for n in SIZES:
        t = torch.ones(n // 4)
        times = []
        for i in range(iters + 5):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)
            if i >= 5:
                times.append((time.perf_counter() - start) / 2)
        medians[n] = statistics.median(times)
    if rank == 0:
        results.put(medians)
    dist.destroy_process_group()


def main():
    backend = sys.argv[1] if len(sys.argv) > 1 else "fairring"
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = 29000 + os.getpid() % 1000
    procs = [ctx.Process(target=run, args=(r, backend, port, iters, results)) for r in range(2)]
    for p in procs:
        p.start()
    medians = results.get()
    for p in procs:
        p.join()
    layout = os.environ.get("LAYOUT", "1x2")
    for n, t in medians.items():
        print(f"{backend} {layout} {n} B: {t * 1e6:.1f} us one way, {n / t / 1e9:.3f} GB/s")


if __name__ == "__main__":
    main()
