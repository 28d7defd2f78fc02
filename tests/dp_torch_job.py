"""A real (tiny) PyTorch data-parallel training job on CPU, timed by `instrument_torch`.

``--ranks`` processes started by ``torch.multiprocessing.spawn`` join one gloo process
group (a ``FileStore`` rendezvous, so nothing listens but gloo's own loopback sockets;
``GLOO_SOCKET_IFNAME=lo``) and train the same MLP under ``DistributedDataParallel``: per
step one forward, one backward whose gradient bucket DDP all-reduces through gloo, and
an SGD step. The training loop has no timing code: `fabricwatch.rank.instrument_torch`
hooks the DDP module (forward pre-hook, comm hook around DDP's own ``allreduce_hook``)
and the optimizer (step pre/post hooks). From step ``--slow-from`` on, rank
``--slow-rank`` runs its hidden layer ``--slow-factor`` times per forward (the extra
passes are wasted work, as on a fail-slow GPU).

Each rank sets the variables torchrun would (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) and
builds its reporter with `RankReporter.from_env`, as a training script does under torchrun::

    FABRICWATCH_GATEWAY=127.0.0.1:50051 FABRICWATCH_JOB_ID=dp-torch-1 \\
        python tests/dp_torch_job.py --ranks 4 --steps 20 --slow-rank 2 --slow-from 10 --out /tmp/dpt

With ``--out DIR`` each rank writes ``DIR/rank<r>.json`` at exit, after the SDK's exit
flush: its identity, per-step start times, losses and the SDK's split, and its stats.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import tempfile
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--slow-rank", type=int, default=2, help="-1: nobody is slow")
    p.add_argument("--slow-from", type=int, default=10, help="first slowed step")
    p.add_argument("--slow-factor", type=int, default=12, help="hidden-layer passes of the slow rank")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--eval-every", type=int, default=5, help="a no-grad evaluation forward after every N steps")
    p.add_argument("--pin-cpu", type=int, default=-1,
                   help="after start-up, run every rank on this one CPU (fair busy times when the "
                        "ranks outnumber the free cores); -1: no pinning")
    p.add_argument("--out", default="", help="directory for rank<r>.json reports")
    return p.parse_args(argv)


def build_model(torch, dim: int, hidden: int):
    """A 3-layer MLP whose middle layer can be run several times (the slow rank's waste)."""

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(dim, hidden)
            self.mid = torch.nn.Linear(hidden, hidden)
            self.out = torch.nn.Linear(hidden, 1)
            self.passes = 1

        def forward(self, x):
            h = torch.tanh(self.inp(x))
            if self.passes > 1:
                with torch.no_grad():                 # wasted work: a slow GPU, same result
                    for _ in range(self.passes - 1):
                        torch.tanh(self.mid(h))
            h = torch.tanh(self.mid(h))
            return self.out(h)

    return MLP()


def run_rank(rank: int, args: argparse.Namespace, store_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)          # one core per rank: the ranks share the machine's cores
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank))   # as torchrun
    report: dict = {"rank": rank, "world_size": args.ranks, "steps": [], "torch": torch.__version__}
    reporter = None

    def write_report() -> None:       # registered before the reporter: runs after its exit flush
        if args.out:
            report["stats"] = reporter.stats if reporter is not None else {}
            path = os.path.join(args.out, f"rank{rank}.json")
            with open(path + ".tmp", "w") as fh:
                json.dump(report, fh)
            os.replace(path + ".tmp", path)

    atexit.register(write_report)
    from fabricwatch.rank import RankReporter, instrument_torch

    reporter = RankReporter.from_env(flush_interval_s=0.5)
    ident = reporter.identity
    report["identity"] = {"job_id": ident.job_id, "rank": ident.rank, "world_size": ident.world_size,
                          "node": ident.node, "local_gpu": ident.local_gpu, "launcher": ident.launcher}
    if args.pin_cpu >= 0:             # imports done on every core; the training shares one
        os.sched_setaffinity(0, {args.pin_cpu})
    dist.init_process_group("gloo", store=dist.FileStore(store_path, args.ranks), rank=rank,
                            world_size=args.ranks)
    torch.manual_seed(1234)                       # same initial weights on every rank
    model = build_model(torch, args.dim, args.hidden)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    report["hooks"] = len(instrument_torch(reporter, ddp, optimizer))
    data = torch.Generator().manual_seed(rank)    # each rank its own shard
    teacher = torch.randn(args.dim, 1, generator=torch.Generator().manual_seed(99))
    dist.barrier()
    loss = torch.zeros(())
    for step in range(args.steps):
        model.passes = args.slow_factor if (rank == args.slow_rank and step >= args.slow_from) else 1
        x = torch.randn(args.batch, args.dim, generator=data)
        y = torch.tanh(x @ teacher)
        report["steps"].append([step, time.time_ns()])
        optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(ddp(x), y)     # forward pre-hook: the step opens
        loss.backward()                                    # comm hook: DDP's allreduce of the bucket
        optimizer.step()                                   # pre-hook: collectives over; post: step over
        own_step_s = time.perf_counter() - t0              # the job's own clock, to check the SDK's
        last = reporter.last_step
        report["steps"][-1] += [float(loss), *((last.step, last.step_seconds, last.busy_seconds,
                                                last.collective_wait_seconds) if last is not None else ()),
                                own_step_s]
        if args.eval_every and (step + 1) % args.eval_every == 0:
            with torch.no_grad():                          # validation: a forward that is no training step
                x_val = torch.randn(4 * args.batch, args.dim, generator=data)
                report.setdefault("eval_loss", []).append(
                    float(torch.nn.functional.mse_loss(ddp(x_val), torch.tanh(x_val @ teacher))))
    dist.barrier()
    # every rank holds the same weights after the all-reduced steps: the collective was real
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(args.ranks)]
    dist.all_gather(gathered, flat)
    report["weights_equal"] = all(torch.equal(flat, g) for g in gathered)
    if rank == 0:
        print(f"dp_torch_job: torch {torch.__version__}, {args.steps} steps on {args.ranks} gloo ranks, "
              f"final loss {float(loss):.4f}", flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # gloo's pair sockets on loopback only
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="fw-dp-torch-") as tmp:
        mp.spawn(run_rank, args=(args, os.path.join(tmp, "store")), nprocs=args.ranks, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
