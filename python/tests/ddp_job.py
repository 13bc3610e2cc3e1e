"""A DDP training job on the fairring backend, one process per rank: run by
the tests under torchrun and as plain processes (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT in the environment either way).

Prints ``STEP n`` after each step and, at the end, ``DONE <rank> <checksum>``
and ``THREADS <before> <after> <names>`` (the process's OS threads before
init_process_group and after destroy_process_group, and the names of those
after that fairring started, comma-separated, or ``-``). If a collective fails it
prints ``RAISED <type>: <message>`` and exits 3.

Options: --steps N, --kill-rank R --kill-step S (rank R kills itself with
SIGKILL before step S), --timeout SECONDS, --device cuda (the model and data on
GPU 0).
"""

import argparse
import datetime
import gc
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fairring  # noqa: F401


def threads():
    """The names of this process's OS threads."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # it ended meanwhile
            pass
    return names


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    before = threads()
    dist.init_process_group("fairring", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    torch.manual_seed(0)
    dev = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    net = net.to(dev)
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    try:
        for step in range(args.steps):
            if rank == args.kill_rank and step == args.kill_step:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            g = torch.Generator().manual_seed(rank * 1000 + step)
            x, y = torch.randn(64, 32, generator=g), torch.randn(64, 4, generator=g)
            x, y = x.to(dev), y.to(dev)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            if dev.type == "cuda":
                # The step's collectives have finished (or failed) on the GPU.
                torch.cuda.synchronize()
            print(f"STEP {step}", flush=True)
    except Exception as e:
        print(f"RAISED {type(e).__name__}: {e}", flush=True)
        del ddp, opt
        gc.collect()
        dist.destroy_process_group()
        sys.exit(3)
    checksum = sum(p.double().sum().item() for p in net.parameters())
    del ddp, opt
    gc.collect()
    dist.destroy_process_group()
    gc.collect()
    print(f"DONE {rank} {checksum!r}", flush=True)
    after = threads()
    # fairring names its threads "fairring-..." (torch's own, such as its
    # store's, outlive the group as they do under gloo).
    ours = [n for n in after if n.startswith("fairring")]
    print(f"THREADS {len(before)} {len(after)} {','.join(ours) or '-'}", flush=True)


if __name__ == "__main__":
    main()
