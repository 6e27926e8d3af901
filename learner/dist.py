"""The learner on one device or many: device placement, torch.distributed, FSDP2.

One process (`learner run`): the model on `--device` (auto: CUDA when available).

Several (`torchrun --nproc-per-node N -m learner.cli run ...`, one process per GPU, or
per CPU with the gloo backend): every rank holds a shard of the model, FSDP2's
`fully_shard` on each decoder layer and at the root, so a model that does not fit one
device trains; only rank 0 reads the weights (the others build the model on the meta
device and receive their shards, `fill_from_rank0`); frozen base weights and LoRA
parameters are sharded alike, and the LoRA gradients are reduce-scattered across ranks
in the backward. Rank 0 alone is the
learner the rest of the system sees: it talks to the queue, the store and the metrics,
acknowledges, publishes and checkpoints. The other ranks follow it (`follow`): rank 0
broadcasts a command (a small int64 tensor) and every rank then runs the same
collectives:

- STEP: the step's sequences (tensors, built and scored by rank 0) and each row's
  rank, balanced by token count; every rank trains on its rows (`learner.train`).
- ADAPTER: the full adapter gathered from the shards (to publish it).
- SAVE: the adapter and the full optimizer state gathered (a checkpoint).
- RESTORE: rank 0's checkpoint broadcast into every rank's shards (`--resume`).
- AUDIT: an audited group's sequences, and the same no-grad forward pass on every rank,
  with the audited version's adapter broadcast in and the live one put back
  (`learner.audit`).
- STOP.

Nothing is pickled by us on the way (commands and batches are tensors, the scheduler's
state is JSON); torch's own state-dict helpers broadcast their key lists with its object
collectives. A rank that dies makes the others' next collective fail (or time out):
the process exits non-zero, torchrun stops the rest, and since acknowledgement follows
the checkpoint, `--resume` (at any world size: checkpoints hold full tensors) trains
every group exactly once.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NoReturn, cast

import torch
import torch.distributed as dist
from torch import Tensor

log = logging.getLogger(__name__)

STOP, STEP, ADAPTER, SAVE, RESTORE, AUDIT = range(6)
_HEADER = 4
COLLECTIVE_TIMEOUT_S = 600.0
"""How long a collective waits for a silent peer before the rank gives up (a dead peer's
closed connection fails it at once; a hung one takes this long)."""


def resolve_device(spec: str, local_rank: int = 0, distributed: bool = False) -> torch.device:
    """`auto` | `cpu` | `cuda` | `cuda:N` as a torch device, or ValueError saying why not."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if not spec.startswith("cuda"):
        raise ValueError(f"--device {spec!r}: use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(
            f"--device {spec}: no CUDA device is visible here (torch.cuda.is_available() is False); "
            "use --device cpu, or a CUDA build of torch"
        )
    if ":" in spec and distributed:
        raise ValueError(f"--device {spec}: under torchrun each rank takes cuda:LOCAL_RANK; pass --device cuda")
    index = int(spec.split(":", 1)[1]) if ":" in spec else local_rank
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device cuda:{index}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


@dataclass
class Dist:
    """Where this process trains, and with whom."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    rank: int = 0
    world: int = 1
    mesh: Any = None
    """The FSDP2 device mesh (None in one process)."""

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device_spec: str) -> Dist:
        """One process, or a rank of torchrun's (WORLD_SIZE, RANK and LOCAL_RANK set)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls(device=resolve_device(device_spec))
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        device = resolve_device(device_spec, local, distributed=True)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(
                backend,
                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                device_id=device if device.type == "cuda" else None,
            )
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,))
        log.info("rank %d of %d on %s (%s)", rank, world, device, backend)
        return cls(device=device, rank=rank, world=world, mesh=mesh)

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()

    def exit(self, code: int) -> NoReturn:
        """End a rank's process once everything of ours is closed: the process group
        destroyed, logs and stdio flushed, then `os._exit` without finalizing the
        interpreter. gloo's worker threads can still be releasing the last collective's
        tensors (waiting for the GIL to drop their Python objects) when the main thread
        starts finalizing; a thread that then takes the GIL is ended by the interpreter
        mid-destructor and the process aborts (`terminate called without an active
        exception`, SIGABRT: about 1 exit in 15 with 2 CPU ranks here; pytorch#179291
        describes the same race). One process (`enabled` False) exits normally."""
        self.close()
        if not self.enabled:
            sys.exit(code)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    # ------------------------------------------------------------- collectives
    def _wire(self, t: Tensor) -> Tensor:
        """NCCL moves CUDA tensors only; gloo CPU ones."""
        return t.to(self.device) if self.device.type == "cuda" else t

    def broadcast(self, t: Tensor) -> Tensor:
        """Rank 0's `t` on every rank (the others pass a tensor of the same shape and dtype)."""
        wire = self._wire(t.contiguous())
        dist.broadcast(wire, src=0)
        return wire.to(t.device)

    def command(self, cmd: int, *args: int) -> None:
        """Rank 0: [cmd, *args] to the other ranks (which `receive` it)."""
        header = torch.zeros(_HEADER, dtype=torch.long, device="cpu")
        header[: 1 + len(args)] = torch.tensor([cmd, *args], dtype=torch.long, device="cpu")
        self.broadcast(header)

    def receive(self) -> list[int]:
        """Another rank: rank 0's next [cmd, *args]."""
        return [int(x) for x in self.broadcast(torch.zeros(_HEADER, dtype=torch.long, device="cpu")).tolist()]

    def send_step(self, tensors: list[Tensor], lengths: list[int]) -> list[int]:
        """Rank 0: a training step's tensors (each row's length in `lengths`) to every
        rank, and each row's rank (by token count, `split_rows`); returns the latter."""
        owner = split_rows(lengths, self.world)
        self.command(STEP, *tensors[0].shape)
        for t in tensors:
            t.copy_(self.broadcast(t))
        self.broadcast(torch.tensor(owner, dtype=torch.long, device="cpu"))
        return owner

    def receive_step(self, tensors: list[Tensor]) -> list[int]:
        """Another rank, after STEP: rank 0's step into `tensors` (zeros of the shapes the
        command named); returns each row's rank."""
        for t in tensors:
            t.copy_(self.broadcast(t))
        owners = self.broadcast(torch.zeros(tensors[0].shape[0], dtype=torch.long, device="cpu"))
        return [int(x) for x in owners.tolist()]

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        if not self.enabled:
            return values
        t = self._wire(torch.tensor(values, dtype=torch.float64, device="cpu"))
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return [float(x) for x in t.cpu().tolist()]

    def same_passes(self, plan: list[list[int]]) -> list[list[int] | None]:
        """`plan` (this rank's micro-batches) padded with None, an empty pass, to as many as
        the rank with the most has: under FSDP every rank runs the same collectives."""
        most = int(self.all_reduce([float(len(plan))], op="max")[0])
        return [*plan, *[None] * (most - len(plan))]

    def broadcast_json(self, obj: Any = None) -> Any:
        """A JSON-able value from rank 0 (its bytes as a uint8 tensor, length first)."""
        data = json.dumps(obj).encode() if self.main else b""
        n = int(self.broadcast(torch.tensor([len(data)], dtype=torch.long, device="cpu")).item())
        buf = torch.zeros(n, dtype=torch.uint8, device="cpu")
        if self.main:
            buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return json.loads(bytes(self.broadcast(buf).tolist()))


def peak_memory_mb(device: torch.device) -> float:
    """The most memory this process has held: allocated by torch on a CUDA device, the
    process's peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor behind an FSDP2 shard (a collective: every rank calls it, in the
    same order); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def shard_model(model: torch.nn.Module, dist_: Dist) -> None:
    """FSDP2: each decoder layer (the classes transformers names in `_no_split_modules`)
    is a unit of its own, the rest (embeddings, norm, head) goes with the root."""
    from torch.distributed.fsdp import fully_shard

    names = set()
    for module in model.modules():
        names |= set(getattr(module, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"cannot shard {type(model).__name__}: it names no decoder layer class (_no_split_modules)")
    for layer in layers:
        fully_shard(layer, mesh=dist_.mesh)
    fully_shard(model, mesh=dist_.mesh)


def reshard(model: torch.nn.Module) -> None:
    """Free the gathered parameters an FSDP2 forward pass with no backward leaves behind
    (the root's are kept after forward): a state-dict load after it would meet plain
    tensors where it expects shards. Nothing outside torchrun."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def fill_from_rank0(model: torch.nn.Module, full: dict[str, Tensor], dist_: Dist) -> None:
    """Every rank's shards (and buffers) from rank 0's whole model: the other ranks built
    theirs on the meta device, so only rank 0 ever holds the full weights in memory.
    `full` is rank 0's state dict from before sharding ({} elsewhere); buffers that are not
    in a state dict (rotary frequencies) are broadcast one by one."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not dist_.main:
        model.to_empty(device=dist_.device)
    set_model_state_dict(
        model,
        cast(dict[str, Any], full),  # torch annotates its values as a union Tensor is in
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    with torch.no_grad():
        for _, buf in sorted(model.named_buffers(), key=lambda nb: nb[0]):
            buf.copy_(dist_.broadcast(buf))


def split_rows(lengths: list[int], world: int) -> list[int]:
    """Each row's rank, so that every rank gets about the same number of tokens (longest
    first, each to the rank with the fewest tokens so far)."""
    load = [0] * world
    owner = [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += lengths[i]
    return owner
