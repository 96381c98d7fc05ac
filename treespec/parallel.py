"""Tensor parallelism on torch.distributed: one model over several processes, launched by torchrun.

    torchrun --nproc-per-node N -m treespec generate ...      (docs/parallel.md)

Every rank runs the same program: the same engine loop, the same seeds, the same trees and the
same coins. Only the target's forward is split (`backends.native`, Megatron-style): each rank
holds 1/N of the query and KV heads (and their KV cache) and 1/N of the MLP columns; the o and
down products are row-parallel, each followed by one all-reduce, so every rank ends each
layer with the same full hidden state and computes the same logits. The draft runs replicated.
Nothing but those sums crosses ranks while decoding, except what is decided from a clock or
from a file only one machine may have (goodput switches, cost measurements, a server's
requests): rank 0 decides and `agree` hands its decision to every rank, so ranks cannot
diverge and then hang in a collective.

    init(tp)           join the process group torchrun describes (WORLD_SIZE, RANK, MASTER_ADDR ...)
    current()          this process's `TensorParallel`, or None (a single process)
    leader()           whether this process prints and serves (rank 0, or no group)
    agree(value)       rank 0's `value` on every rank (the identity in a single process)
    check_same(...)    one clear error on every rank where the ranks' settings differ

A rank that dies ends the others' next collective with an error; one that hangs, after
`timeout` seconds ($TREESPEC_TP_TIMEOUT, default 120): never a silent hang.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch

DEFAULT_TIMEOUT_S = 120.0  # a collective waits this long for a rank before every rank fails


class ParallelError(RuntimeError):
    """A tensor-parallel run cannot go on: a rank failed, hung, or differs from the others."""


@dataclass(frozen=True)
class TensorParallel:
    """A rank's place in a tensor-parallel group: it holds slice `rank` of `world` of every
    sharded dimension."""

    rank: int
    world: int
    group: object = None  # the torch.distributed process group (None: the default one)

    def block(self, n: int, what: str) -> slice:
        """This rank's slice of a dimension of `n` (heads, MLP columns), which `world` must
        divide."""
        if n % self.world:
            raise ValueError(
                f"tensor parallelism over {self.world} ranks needs {what} divisible by {self.world}, "
                f"and the model has {n}; launch a number of ranks that divides it"
            )
        size = n // self.world
        return slice(self.rank * size, (self.rank + 1) * size)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (a row-parallel product's partial results), the same
        bits on every rank; `x` may be overwritten. In place where it runs eagerly (the
        functional call is slower on gloo, docs/parallel.md); functional where inductor traces
        it into a compiled forward."""
        import torch.distributed as dist

        if torch.compiler.is_compiling():
            from torch.distributed import _functional_collectives as funcol

            return funcol.wait_tensor(funcol.all_reduce(x, "sum", self.group or dist.group.WORLD))
        dist.all_reduce(x, group=self.group)
        return x


def _dist():
    import torch.distributed as dist

    return dist


_joined: TensorParallel | None = None  # the group `init` joined; None: one process


def current() -> TensorParallel | None:
    """This process's tensor-parallel group (`init` joined one of more than one rank), or None.
    A process group its caller made for something else (data parallelism) is not treespec's:
    with `tp=1` every rank stays a process of its own."""
    return _joined


def leader() -> bool:
    """Whether this process speaks for the group: prints, writes caches, serves (rank 0)."""
    tp = current()
    return tp is None or tp.rank == 0


def launched_world() -> int:
    """The world size torchrun (or any launcher that sets WORLD_SIZE) started this process in."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number") from None


def launched_rank() -> int | None:
    """This process's rank where a launcher (torchrun) started several, else None; known from
    the environment before any group is joined."""
    if launched_world() <= 1:
        return None
    return int(os.environ.get("RANK", "0") or 0)


def init(tp: int | None = None, device: torch.device | None = None, timeout_s: float | None = None):
    """Join the process group of a torchrun launch and return this rank's `TensorParallel`
    (None: a single process, no group). `tp`: the number of ranks the caller expects (None:
    whatever was launched; 1: none, each process alone); another number than the launch's is
    a ValueError, on every rank, before anything loads. gloo on CPUs, NCCL on CUDA (each
    rank on cuda:LOCAL_RANK)."""
    world = launched_world()
    if tp == 1:
        return None  # each process a whole model
    if tp is not None and tp != world:
        hint = (
            f"launch with `torchrun --nproc-per-node {tp} -m treespec ...`"
            if world == 1
            else f"drop --tp, or launch {tp} ranks"
        )
        raise ValueError(
            f"--tp {tp} asks for {tp} ranks, and this process was launched in a world of {world}; {hint}"
        )
    global _joined
    if world == 1:
        return None
    dist = _dist()
    if not dist.is_initialized():
        if timeout_s is None:
            timeout_s = float(os.environ.get("TREESPEC_TP_TIMEOUT", DEFAULT_TIMEOUT_S))
        cuda = device is not None and device.type == "cuda"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        try:
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
        except Exception as e:  # noqa: BLE001 - a rendezvous failure has many types
            raise ParallelError(f"cannot join the tensor-parallel group: {type(e).__name__}: {e}") from e
    _joined = TensorParallel(dist.get_rank(), dist.get_world_size())
    return _joined


def agree(value):
    """Rank 0's `value`, on every rank (each rank passes its own; the others' are ignored).
    Every rank must call it at the same point: it is a collective."""
    tp = current()
    if tp is None:
        return value
    box = [value if tp.rank == 0 else None]
    try:
        _dist().broadcast_object_list(box, src=0)
    except Exception as e:  # noqa: BLE001
        raise lost(e) from e
    return box[0]


def check_same(what: str, value) -> None:
    """A ValueError on every rank, naming the ranks that differ, unless every rank passed an
    equal `value` (a dict: the keys that differ are named)."""
    tp = current()
    if tp is None:
        return
    values = [None] * tp.world
    try:
        _dist().all_gather_object(values, value)
    except Exception as e:  # noqa: BLE001
        raise lost(e) from e
    differ = [r for r in range(tp.world) if pickle.dumps(values[r]) != pickle.dumps(values[0])]
    if not differ:
        return
    detail = ""
    if all(isinstance(v, dict) for v in values):
        keys = sorted(
            {
                k
                for r in differ
                for k in set(values[r]) | set(values[0])
                if values[r].get(k) != values[0].get(k)
            }
        )
        detail = ": " + "; ".join(
            f"{k}: rank 0 {values[0].get(k)!r}, "
            + ", ".join(f"rank {r} {values[r].get(k)!r}" for r in differ)
            for k in keys
        )
    ranks = ", ".join(map(str, differ))
    raise ValueError(
        f"the ranks were started with different {what} (rank(s) {ranks} differ from rank 0)"
        f"{detail}; launch every rank with the same command and files"
    )


def lost(error: BaseException) -> ParallelError:
    """A collective's failure, as what it means: a rank died, hung past the timeout, or ran
    another program."""
    tp = current()
    rank = f"rank {tp.rank} of {tp.world}" if tp is not None else "this rank"
    first = (str(error).splitlines() or [""])[0]
    return ParallelError(
        f"{rank}: a tensor-parallel collective failed ({type(error).__name__}: {first}); "
        "another rank died, hung past $TREESPEC_TP_TIMEOUT, or diverged. Every rank stops"
    )


def shutdown() -> None:
    """Leave the process group (end of a torchrun program)."""
    global _joined
    _joined = None
    dist = _dist()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
