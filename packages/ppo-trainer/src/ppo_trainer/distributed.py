"""Data-parallel training over `torch.distributed`: N ranks compute the update of one process.

Every rank holds a group-aligned shard of each step's batch (`shard_groups`). The minibatch
shuffle is drawn over the *global* rows with the same seeded generator on every rank, so
each optimizer step sees exactly the sequences one process would; loss denominators (tokens
and sequences per minibatch), GAE whitening statistics and metrics are all-reduced, and the
per-rank gradients are *summed* (each rank's loss is already divided by the global counts).

Two strategies (see the README, "Data parallel"):

- `"ddp"`: every rank holds the full parameters; after each minibatch's backward passes the
  gradients are all-reduced (sum) in one flat buffer. This is DDP's algorithm, done by hand
  rather than with `DistributedDataParallel` because ranks hold uneven numbers of
  micro-batches (groups are never split), which DDP's per-backward hooks cannot express.
- `"fsdp2"`: `torch.distributed.fsdp.fully_shard` on each decoder layer and the root;
  parameters, gradients and optimizer state are sharded. Every rank runs the same number
  of forward/backward passes (a rank short of rows runs a zero-weighted dummy pass) because
  each pass all-gathers and reduce-scatters.

This module imports torch; `shard_groups` and `GroupShard` need nothing but Python.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "DPStrategy",
    "DataParallel",
    "GroupShard",
    "listen_for_ranks",
    "masked_whiten_global",
    "shard_groups",
]

logger = logging.getLogger(__name__)

DPStrategy = Literal["auto", "ddp", "fsdp2"]
_G = TypeVar("_G")


@dataclass(frozen=True, slots=True)
class GroupShard:
    """One rank's share of a step's batch of groups.

    The global row order is the concatenation of the groups in batch order; rank r holds
    rows `[row_offset, row_offset + rank_rows[r])`, whole groups only.
    """

    groups: list[Any]
    """This rank's groups (possibly none when there are fewer groups than ranks)."""
    rank: int
    world_size: int
    rank_rows: tuple[int, ...]
    """Rows (sequences) of every rank, in rank order; sums to `total_rows`."""

    @property
    def row_offset(self) -> int:
        return sum(self.rank_rows[: self.rank])

    @property
    def total_rows(self) -> int:
        return sum(self.rank_rows)

    @property
    def rows(self) -> int:
        return self.rank_rows[self.rank]


def shard_groups(groups: Sequence[Sequence[_G]], rank: int, world_size: int) -> GroupShard:
    """Split `groups` into `world_size` contiguous, group-aligned shards; return `rank`'s.

    Groups are never split. Boundaries balance sequences: group g goes to the rank whose
    equal share of the rows contains the group's first row, so shards differ by at most
    one group's size; any batch size works (with fewer groups than ranks some shards are
    empty, and those ranks still take part in every collective).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a world of {world_size}")
    total = sum(len(g) for g in groups)
    owners: list[int] = []
    start = 0
    for group in groups:
        # Centre of the group decides the owner: balances uneven group sizes better than
        # its first row, and stays monotone, so shards are contiguous.
        centre = start + len(group) / 2
        owners.append(min(world_size - 1, int(centre * world_size / total)) if total else 0)
        start += len(group)
    rank_rows = [0] * world_size
    for owner, group in zip(owners, groups, strict=True):
        rank_rows[owner] += len(group)
    mine = [list(g) for owner, g in zip(owners, groups, strict=True) if owner == rank]
    return GroupShard(groups=mine, rank=rank, world_size=world_size, rank_rows=tuple(rank_rows))


class DataParallel:
    """One rank of a data-parallel trainer: its process group, strategy and collectives.

    Create one per process (or Ray actor), after or instead of `dist.init_process_group`:

        dp = DataParallel.init(rank, world_size, init_method="tcp://host:port")
        trainer = PPOTrainer(model, config, data_parallel=dp, weight_sink=sink_on_rank_0)

    then call `train(source)` on every rank at the same time: rank 0 reads `source` and
    sends each step's groups to the others (their `source` is ignored); rank 0 pushes the
    weights. Every rank must make the same calls in the same order (`train`,
    `save_checkpoint`, `load_checkpoint`, `full_state_dict`): they are collective.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        strategy: DPStrategy = "auto",
        device: torch.device | str | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised (use DataParallel.init)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        if strategy == "auto":
            strategy = "fsdp2" if self.backend == "nccl" else "ddp"
        if strategy not in ("ddp", "fsdp2"):
            raise ValueError(f"strategy must be 'auto', 'ddp' or 'fsdp2', got {strategy!r}")
        self.strategy: Literal["ddp", "fsdp2"] = strategy
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if self.backend == "nccl"
                else torch.device("cpu")
            )
        self.device = torch.device(device)
        self._mesh: Any = None

    @classmethod
    def init(
        cls,
        rank: int,
        world_size: int,
        *,
        init_method: str | None = None,
        backend: str | None = None,
        strategy: DPStrategy = "auto",
        timeout_s: float = 600.0,
        store_socket: socket.socket | None = None,
    ) -> DataParallel:
        """`dist.init_process_group` (gloo on CPU, NCCL when CUDA is available) + a rank.

        `init_method` e.g. `"tcp://10.0.0.1:29500"` (rank 0's address; any free port);
        None reads MASTER_ADDR / MASTER_PORT from the environment. `store_socket` (rank 0,
        with `tcp://`): the socket `listen_for_ranks` opened at that address, which rank 0's
        store serves on (the store torch makes itself listens on every interface, and a
        port picked then released can be taken before it is bound again). The store
        authenticates no one and `broadcast_object` unpickles: keep it on loopback when
        every rank is on one machine.
        """
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local % max(torch.cuda.device_count(), 1))
        timeout = timedelta(seconds=timeout_s)
        if init_method is not None and init_method.startswith("tcp://"):
            store = _tcp_store(init_method, rank, world_size, timeout, store_socket)
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size, timeout=timeout
            )
        else:
            if store_socket is not None:
                raise ValueError("store_socket needs a tcp:// init_method (its address)")
            dist.init_process_group(
                backend,
                init_method=init_method or "env://",
                rank=rank,
                world_size=world_size,
                timeout=timeout,
            )
        return cls(strategy=strategy)

    @property
    def is_leader(self) -> bool:
        """Rank 0: reads the source, pushes weights, writes checkpoints."""
        return self.rank == 0

    def close(self) -> None:
        """Destroy the default process group (call once per process, at the end)."""
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- model --------------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Make every rank start from rank 0's weights, then shard them (fsdp2).

        Call before creating the optimizer (`PPOTrainer` does): with fsdp2 the optimizer
        must see the sharded parameters.
        """
        with torch.no_grad():
            for tensor in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(tensor.data, src=0, group=self.group)
        if self.strategy == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import FSDPModule, fully_shard

            self._mesh = init_device_mesh(self.device.type, (self.world_size,))
            for layer in _decoder_layers(model):
                fully_shard(layer, mesh=self._mesh)
            fully_shard(model, mesh=self._mesh)
            # Each rank's loss is already normalised by the global counts: sum, not average
            # (plain SUM collectives: gloo has no PREMUL_SUM).
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)
        return model

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The full policy weights (detached CPU copies, tied tensors once) on rank 0, None
        on the others. Collective: every rank must call it."""
        # Tied tensors are found by object identity (the same on every rank), not by data
        # pointer (a rank's shard may be empty): every rank must skip the same names.
        owners = dict(model.named_parameters(remove_duplicate=False))
        owners.update(dict(model.named_buffers(remove_duplicate=False)))
        weights: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, tensor in model.state_dict().items():
            owner = id(owners.get(name, tensor))
            if owner in seen:
                continue
            seen.add(owner)
            full = _full(tensor)  # collective for sharded tensors
            if self.is_leader:
                weights[name] = full.detach().to("cpu", copy=True)
        return weights if self.is_leader else None

    def full_model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """`model.state_dict()` with full tensors on rank 0 (checkpoint format of one
        process), None elsewhere. Collective."""
        state = {name: _full(t) for name, t in model.state_dict().items()}
        return {k: v.detach().cpu() for k, v in state.items()} if self.is_leader else None

    def load_model_state(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load a full state dict (every rank holds it) into this rank's (sharded) model."""
        own = model.state_dict()
        with torch.no_grad():
            for name, tensor in own.items():
                _local(tensor).copy_(_local(self._shard_like(state[name], tensor)))

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """`optimizer.state_dict()` with full tensors on rank 0, None elsewhere. Collective."""
        state = optimizer.state_dict()
        full_state = {
            idx: {k: _full(v) if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
            for idx, entry in sorted(state["state"].items())
        }
        if not self.is_leader:
            return None
        cpu = {
            idx: {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in e.items()}
            for idx, e in full_state.items()
        }
        return {"state": cpu, "param_groups": state["param_groups"]}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a full optimizer state dict (every rank holds it), sharding it like the
        parameters."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        sharded: dict[int, dict[str, Any]] = {}
        for idx, entry in state["state"].items():
            param = params[int(idx)]
            sharded[idx] = {
                k: self._shard_like(v, param)
                if isinstance(v, torch.Tensor) and k != "step" and v.shape == param.shape
                else v
                for k, v in entry.items()
            }
        optimizer.load_state_dict({"state": sharded, "param_groups": state["param_groups"]})

    # -- collectives --------------------------------------------------------------------

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled; for small control messages and batches)."""
        box = [obj if self.is_leader else None]
        dist.broadcast_object_list(box, src=0, group=self.group, device=self._object_device())
        return box[0]

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce (sum or max) of a CPU or device tensor; returns it."""
        reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        if self.backend == "nccl" and tensor.device.type != "cuda":
            moved = tensor.to(self.device)
            dist.all_reduce(moved, op=reduce_op, group=self.group)
            tensor.copy_(moved.cpu())
            return tensor
        dist.all_reduce(tensor, op=reduce_op, group=self.group)
        return tensor

    def sync_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum the gradients of replicated parameters over ranks, in one flat buffer (a
        rank without a gradient contributes zeros). With fsdp2 the sharded parameters were
        reduce-scattered in backward; only plain (replicated) ones, e.g. the value head,
        are summed here."""
        plain = [p for p in params if not _is_dtensor(p)]
        if not plain:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in plain]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.all_reduce(flat)
        offset = 0
        for p in plain:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def clip_grad_norm(self, params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
        """Global L2 gradient norm over every parameter (shards all-reduced), clipped in
        place to `max_norm` like `torch.nn.utils.clip_grad_norm_`; returns the norm."""
        sharded_sq = torch.zeros((), dtype=torch.float64, device=self.device)
        plain_sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in params:
            if p.grad is None:
                continue
            if _is_dtensor(p.grad):
                sharded_sq += _local(p.grad).double().square().sum().to(self.device)
            else:
                plain_sq += p.grad.double().square().sum().to(self.device)
        if self.strategy == "fsdp2":
            self.all_reduce(sharded_sq)
        total = math.sqrt(float(sharded_sq + plain_sq))
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        _local(p.grad).mul_(coef)
        return total

    # -- internals ----------------------------------------------------------------------

    def _shard_like(self, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """`full` as the local shard of `like` (a DTensor), or `full` for plain tensors."""
        if not _is_dtensor(like):
            return full.to(like.device)
        from torch.distributed.tensor import distribute_tensor

        # src_data_rank=None: every rank holds the full tensor and slices its own shard.
        full = full.to(like.device)
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)

    def _object_device(self) -> torch.device | None:
        return self.device if self.backend == "nccl" else None


def listen_for_ranks(host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket listening on `host` alone, on a port the OS picks: rank 0 passes it to
    `DataParallel.init(store_socket=...)` and tells the other ranks its address
    (`tcp://host:port`, `socket.getsockname()`). It stays open from the moment the port is
    picked, so no other process can take the port in between."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def _tcp_store(
    init_method: str,
    rank: int,
    world_size: int,
    timeout: timedelta,
    store_socket: socket.socket | None,
) -> dist.Store:
    """The group's store at `tcp://host:port`: rank 0 serves it (on `store_socket` if given),
    the others connect. Prefixed as torch's own `tcp://` rendezvous prefixes it, so ranks
    that join through `dist.init_process_group(init_method=...)` meet these."""
    from urllib.parse import urlparse

    address = urlparse(init_method)
    if address.hostname is None or address.port is None:
        raise ValueError(f"init_method {init_method!r}: expected tcp://host:port")
    options: dict[str, Any] = {"wait_for_workers": False, "multi_tenant": True}
    if store_socket is not None:
        if rank != 0:
            raise ValueError("store_socket is rank 0's (it serves the store)")
        if store_socket.getsockname()[1] != address.port:
            raise ValueError(f"store_socket is not listening at {init_method}")
        # The store owns the descriptor from here (it closes it): detach it from `sock`.
        options = {"wait_for_workers": False, "master_listen_fd": store_socket.detach()}
    store = dist.TCPStore(address.hostname, address.port, world_size, rank == 0, timeout, **options)
    return dist.PrefixStore("default_pg", store)


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks (HF: the largest `nn.ModuleList`), sharded one unit
    each so only one layer's parameters are gathered at a time."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        return []
    return list(max(lists, key=len))


def _is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if _is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if _is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def masked_whiten_global(
    values: torch.Tensor, mask: torch.Tensor, dp: DataParallel, *, eps: float = 1e-8
) -> torch.Tensor:
    """`advantages.masked_whiten` with mean and variance over the valid positions of every
    rank's tensor (two all-reduces); equal to whitening the concatenated batch."""
    valid = mask.bool()
    x = torch.where(valid, values.to(torch.float32), 0.0)
    first = dp.all_reduce(torch.tensor([float(x.sum()), float(valid.sum())], dtype=torch.float64))
    total, count = float(first[0]), float(first[1])
    if count < 2:
        return torch.zeros_like(x)
    mean = total / count
    centred = torch.where(valid, x - mean, 0.0)
    second = dp.all_reduce(
        torch.tensor([float(centred.double().square().sum())], dtype=torch.float64)
    )
    var = float(second[0]) / (count - 1)
    return centred * (1.0 / math.sqrt(var + eps))
