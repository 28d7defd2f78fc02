"""A real (tiny) synchronous data-parallel training job over MPI, instrumented with the rank SDK.

Each rank trains the same 2-layer MLP on its own data shard: per step it runs
``--micro`` micro-batches of numpy forward/backward (its own compute), then a real
``comm.Allreduce`` of the flattened gradient (the data-parallel collective), then an SGD
update. From step ``--slow-from`` on, rank ``--slow-rank`` does ``--slow-factor`` times
the compute (a fail-slow GPU). Every rank reports through `fabricwatch.rank`, configured
from the environment exactly as in production (``FABRICWATCH_GATEWAY``, ``FABRICWATCH_JOB_ID``,
rank and world size from Open MPI's variables)::

    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \\
    FABRICWATCH_GATEWAY=127.0.0.1:50051 FABRICWATCH_JOB_ID=dp-test-1 \\
    mpirun -np 4 --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 \\
        python tests/dp_job.py --steps 30 --slow-rank 2 --slow-from 10 --out /tmp/dp

With ``--hang-rank R --hang-at S`` rank R stops before the all-reduce of step S and sleeps
forever (its peers wait inside that all-reduce; the test kills the job).

With ``--out DIR`` each rank writes ``DIR/rank<r>.json`` at exit, after the SDK's exit flush:
its identity, per-step start times and losses, and the reporter's stats.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import time

if __name__ == "__main__":   # before numpy loads its BLAS; not when pytest imports this file
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")   # one core per rank: 4 ranks share 2 cores in CI

import numpy as np  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--slow-rank", type=int, default=2, help="-1: nobody is slow")
    p.add_argument("--slow-from", type=int, default=10, help="first slowed step")
    p.add_argument("--slow-factor", type=float, default=6.0, help="compute multiplier of the slow rank")
    p.add_argument("--micro", type=int, default=24, help="micro-batches of compute per step")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--out", default="", help="directory for rank<r>.json reports")
    p.add_argument("--hang-rank", type=int, default=-1, help="this rank stops before the all-reduce of --hang-at")
    p.add_argument("--hang-at", type=int, default=10, help="the step whose all-reduce --hang-rank never enters")
    return p.parse_args(argv)


def forward_backward(w1: np.ndarray, w2: np.ndarray, x: np.ndarray, y: np.ndarray):
    """Mean-squared-error MLP: loss and gradients of both layers."""
    h = np.tanh(x @ w1)
    err = h @ w2 - y
    loss = float(np.mean(err * err))
    g_out = (2.0 / len(x)) * err
    g_w2 = h.T @ g_out
    g_h = (g_out @ w2.T) * (1.0 - h * h)
    g_w1 = x.T @ g_h
    return loss, g_w1, g_w2


def main(argv=None) -> int:
    args = parse_args(argv)
    from mpi4py import MPI   # here, so that importing this file (pytest's doctest collection) needs no MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    report: dict = {"rank": rank, "world_size": world, "steps": []}
    reporter = None

    def write_report() -> None:   # registered before the reporter: runs after its exit flush
        if args.out:
            report["stats"] = reporter.stats if reporter is not None else {}
            path = os.path.join(args.out, f"rank{rank}.json")
            with open(path + ".tmp", "w") as fh:
                json.dump(report, fh)
            os.replace(path + ".tmp", path)

    atexit.register(write_report)
    from fabricwatch.rank import RankReporter
    reporter = RankReporter.from_env(flush_interval_s=0.5)
    ident = reporter.identity
    report["identity"] = {"job_id": ident.job_id, "rank": ident.rank, "world_size": ident.world_size,
                          "node": ident.node, "local_gpu": ident.local_gpu, "launcher": ident.launcher}
    if (ident.rank, ident.world_size) != (rank, world):
        print(f"rank {rank}: the SDK read rank {ident.rank}/{ident.world_size} from the environment",
              file=sys.stderr)
        return 2

    rng = np.random.default_rng(1234)             # same initial weights on every rank
    w1 = rng.standard_normal((args.dim, args.hidden)) / np.sqrt(args.dim)
    w2 = rng.standard_normal((args.hidden, 1)) / np.sqrt(args.hidden)
    data = np.random.default_rng(rank)            # each rank its own shard
    teacher = np.random.default_rng(99).standard_normal((args.dim, 1))
    n1 = w1.size
    grad = np.empty(n1 + w2.size)                 # the flattened gradient: Allreduce'd every step
    total = np.empty_like(grad)
    comm.Barrier()
    for step in range(args.steps):
        slow = rank == args.slow_rank and step >= args.slow_from
        passes = int(round(args.micro * args.slow_factor)) if slow else args.micro
        report["steps"].append([step, time.time_ns()])
        with reporter.step(step):
            grad[:] = 0.0
            loss = 0.0
            for i in range(passes):
                x = data.standard_normal((args.batch, args.dim))
                y = np.tanh(x @ teacher)
                mb_loss, g_w1, g_w2 = forward_backward(w1, w2, x, y)
                if i < args.micro:                # the extra passes of a slow rank are wasted work
                    loss += mb_loss / args.micro
                    grad[:n1] += g_w1.ravel() / args.micro
                    grad[n1:] += g_w2.ravel() / args.micro
            if rank == args.hang_rank and step == args.hang_at:
                print(f"rank {rank}: hanging before the all-reduce of step {step}", flush=True)
                while True:                       # a stuck process: alive, never enters the collective
                    time.sleep(1.0)
            with reporter.collectives():
                comm.Allreduce(grad, total, op=MPI.SUM)
            total /= world
            w1 -= args.lr * total[:n1].reshape(w1.shape)
            w2 -= args.lr * total[n1:].reshape(w2.shape)
        last = reporter.last_step
        report["steps"][-1] += [loss, *((last.step_seconds, last.busy_seconds, last.collective_wait_seconds)
                                        if last is not None else ())]
    comm.Barrier()
    if rank == 0:
        print(f"dp_job: {args.steps} steps on {world} ranks, final loss {loss:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
