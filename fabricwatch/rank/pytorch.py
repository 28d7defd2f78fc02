"""`instrument_torch`: times a PyTorch DDP training loop through hooks, without touching it.

A forward pre-hook opens the step, a wrapped DDP comm hook marks the entry into the
collectives (and counts each bucket in the progress heartbeat), optimizer step hooks mark
their end and the step's. Separate from the reporter because it is the only code that
knows torch, which is imported only when this is called.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .reporter import RankReporter


def instrument_torch(reporter: RankReporter, model: Any = None, optimizer: Any = None, *,
                     comm_hook: Callable | None = None, comm_state: Any = None,
                     sync_cuda: bool = False) -> list:
    """Time a PyTorch DDP training loop without touching it; returns the hook handles.

    * ``model`` (a ``DistributedDataParallel``): a forward pre-hook opens a step when none
      is open and autograd is on (a ``torch.no_grad()`` forward, e.g. validation between
      steps, is no training step: it would open one that runs into the next); the DDP comm hook is wrapped so that the first gradient bucket handed to
      the collectives marks the entry into them. ``comm_hook`` defaults to DDP's own
      ``allreduce_hook``; pass yours (PowerSGD, fp16 compression...) to keep it. Each
      bucket's collective also counts in the progress heartbeat (entered when handed to
      the hook, completed when its future completes: `collective_begin`/`collective_end`).
    * ``optimizer``: a step pre-hook marks the end of the collectives (DDP's backward has
      waited for them) and a step post-hook ends the step.

    On CUDA the CPU runs ahead of the GPU, so the split then follows kernel *launches*
    unless ``sync_cuda=True`` (a ``torch.cuda.synchronize()`` at those two points, which
    costs the CPU-GPU overlap there). For GPU-true collective times use NCCL's Inspector
    and `ingest_nccl_inspector`. torch is imported only here.
    """
    handles: list = []
    sync = None
    if sync_cuda:
        import torch

        if torch.cuda.is_available():
            sync = torch.cuda.synchronize
    if model is not None:
        grad_enabled = _grad_mode()

        def _forward_pre_hook(module, args):
            if reporter._t0 is None and grad_enabled():
                reporter.step_begin()
            return None

        handles.append(model.register_forward_pre_hook(_forward_pre_hook))
        if comm_hook is None:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook as comm_hook
        inner = comm_hook

        def _done(fut):
            reporter.collective_end()       # the bucket's all-reduce left (done or failed)
            return fut.value()

        def _comm_hook(state, bucket):
            if reporter._coll_t is None and reporter._t0 is not None:
                if sync is not None:
                    sync()
                reporter.collectives_begin()
            reporter.collective_begin()     # one progress sequence number per gradient bucket
            fut = inner(state, bucket)
            then = getattr(fut, "then", None)
            if then is None:                # not a torch Future (a synchronous hook): left already
                reporter.collective_end()
                return fut
            return then(_done)

        model.register_comm_hook(comm_state, _comm_hook)
    if optimizer is not None:
        def _pre_step(opt, args, kwargs):
            if sync is not None and reporter._coll_t is not None:
                sync()
            reporter.collectives_end()
            return None

        def _post_step(opt, args, kwargs):
            if sync is not None:
                sync()
            reporter.step_end()

        handles.append(optimizer.register_step_pre_hook(_pre_step))
        handles.append(optimizer.register_step_post_hook(_post_step))
    return handles


def _grad_mode() -> Callable[[], bool]:
    """``torch.is_grad_enabled``; without torch (stand-in modules) every forward trains."""
    try:
        from torch import is_grad_enabled
    except ImportError:
        return lambda: True
    return is_grad_enabled
