"""The facts the speed choices depend on, from every rank, and what every rank can run.

The speed choices are timed on the main process (training/choices.py); they hold on the other
ranks only where those can run them. Before any choice each rank reports its facts (`local`):
its device's name and capability (a GPU's compute capability; a CPU's model and the ISA flags its
bf16 depends on), FP8 matmuls, native bf16, and the memory it may use (a GPU's free memory; on a
CPU MemAvailable, from psutil when installed, else /proc/meminfo, shared by the ranks of its
host). One all-gather (`gather`, on the default group, so within dist.timeout_s) gives every rank
every rank's facts, and one pure function (`agree`) turns them into the Limits every choice keeps:

- FP8 only where every rank has FP8 matmuls (train.float8 = on elsewhere: one line, exit 2);
- bf16 only where the main process measures it native and every rank has it natively by its
  hardware, or all ranks are alike (the main process's probe then holds for all);
- the full logits (train.loss = auto) only where they fit in the least free memory of any rank;
- optim.muon_split = redundant only where ranks are alike (same device name and capability):
  replicas that each compute every orthogonalisation stay byte-identical only on identical
  hardware, so on ranks that differ it is split by rule (redundant explicitly: one line, exit 2);
- the speed-choice cache keys name the devices where ranks differ (`Limits.cache_key`).

GPTRAIN_FAULT=facts@MIB/RANK (a drill of mixed hardware on one machine): rank RANK reports another
device: no FP8, no native bf16, MIB MiB of memory, and its name marked as faked.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

import torch

from gptrain.errors import UserError

FP8_CAPABILITY, BF16_CAPABILITY = (8, 9), (8, 0)
# the CPU flags that tell devices apart for the choices (x86 and Arm), and those of native bf16
CPU_FLAGS = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "asimd"}
CPU_FLAGS |= {"sve", "bf16", "i8mm"}
BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}
FAULT = "facts"  # GPTRAIN_FAULT's kind for faked facts


@dataclass(frozen=True)
class Facts:
    """One rank's facts."""

    name: str  # the device as timing.machine names it (a GPU with its capability, a CPU model)
    capability: str  # a GPU's compute capability ("9.0"); a CPU's relevant ISA flags
    fp8: bool  # FP8 matmuls (CUDA compute capability >= 8.9)
    bf16: bool | None  # native bf16 by the hardware (None: unknown)
    free: int | None  # bytes this rank may use (None: unknown)


def local(device: str, rank: int = 0, sharing: int = 1, env=os.environ) -> Facts:
    """This rank's facts on `device`; `sharing`: processes on this host (they share its CPU
    memory). GPTRAIN_FAULT=facts@MIB/RANK fakes them on rank RANK (see the module docstring)."""
    from gptrain.training.timing import machine

    if device.startswith("cuda"):
        cc = torch.cuda.get_device_capability(device)
        free = torch.cuda.mem_get_info(device)[0]
        facts = Facts(
            machine(device), f"{cc[0]}.{cc[1]}", cc >= FP8_CAPABILITY, cc >= BF16_CAPABILITY, free
        )
    else:
        flags = cpu_flags()
        available = available_memory()
        free = None if available is None else available // max(1, sharing)
        bf16 = None if flags is None else bool(flags & BF16_FLAGS)
        facts = Facts(machine(device), " ".join(sorted(flags or ())), False, bf16, free)
    mib = faked_mib(rank, env)
    if mib is not None:
        name = f"{facts.name} (faked by GPTRAIN_FAULT={FAULT}@{mib}/{rank})"
        facts = replace(facts, name=name, fp8=False, bf16=False, free=mib * 2**20)
    return facts


def faked_mib(rank: int, env=os.environ) -> int | None:
    """The MiB of a GPTRAIN_FAULT facts@MIB[/RANK] entry that applies to `rank`, or None."""
    for entry in env.get("GPTRAIN_FAULT", "").split(","):
        kind, _, rest = entry.strip().partition("@")
        mib, slash, at = rest.partition("/")
        if kind == FAULT and mib.isdigit() and (not slash or at == str(rank)):
            return int(mib)
    return None


def cpu_flags() -> set[str] | None:
    """The CPU's flags of CPU_FLAGS (x86 "flags", Arm "Features"), or None where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split()) & CPU_FLAGS
    except OSError:
        pass
    return None


def available_memory() -> int | None:
    """Bytes of system memory available to new allocations (psutil, else /proc/meminfo's
    MemAvailable), or None where neither answers."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def gather(info, mine: Facts | None = None) -> list[Facts]:
    """Collective: every rank's facts, in rank order (one all-gather on the default group, so
    within dist.timeout_s); [this rank's] on one process."""
    from gptrain.distributed import runtime as dist

    mine = mine or local(info.device, info.rank, info.local_world_size)
    if not dist.active():
        return [mine]
    everyone: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, asdict(mine))
    return [Facts(**f) for f in everyone]


@dataclass(frozen=True)
class Limits:
    """What every rank can run: `agree`'s answer, which the speed choices keep."""

    fp8: bool  # every rank has FP8 matmuls
    bf16: bool  # every rank computes bf16 natively by its hardware
    free: int | None  # the least memory any rank may use (None: unknown everywhere)
    alike: bool  # the same device name and capability on every rank
    devices: tuple[str, ...] = ()  # each distinct device, with its ranks
    no_fp8: tuple[int, ...] = ()  # the ranks without FP8 matmuls

    def bf16_native(self, here: bool) -> bool:
        """Whether bf16 counts as native for the run, `here` being the main process's answer."""
        return here and (self.alike or self.bf16)

    def no_bf16(self, here: bool, cuda: bool) -> str:
        """How train.dtype reads where bf16 is not native (`here`: on the main process)."""
        if here:
            return f"rule: bf16 not native on every rank ({self.differ()})"
        return "rule: bf16 not native" if cuda else "measured: bf16 emulated"

    def logits_fit(self, need: int, share: float) -> bool:
        """Whether `need` bytes are at most `share` of the least free memory of any rank."""
        return self.free is None or need <= share * self.free

    def differ(self) -> str:
        """The devices of ranks that differ, for lines: "A (rank 0); B (rank 1)"."""
        return "; ".join(self.devices)

    def cache_key(self) -> str:
        """What the speed-choice cache keys add: nothing where ranks are alike, else every device."""
        return "" if self.alike else f"|ranks {self.differ()}"


def agree(facts: list[Facts]) -> Limits:
    """The Limits of ranks with these `facts` (rank order): a pure function."""
    kinds = [f"{f.name} [{f.capability}]" for f in facts]
    devices = []
    for kind in dict.fromkeys(kinds):
        ranks = [str(r) for r, k in enumerate(kinds) if k == kind]
        devices.append(f"{kind} (rank{'s' * (len(ranks) > 1)} {','.join(ranks)})")
    known = [f.free for f in facts if f.free is not None]
    return Limits(
        fp8=all(f.fp8 for f in facts),
        bf16=all(f.bf16 is True for f in facts),
        free=min(known) if known else None,
        alike=len(devices) == 1,
        devices=tuple(devices),
        no_fp8=tuple(r for r, f in enumerate(facts) if not f.fp8),
    )


def no_room_for_logits(device: str, need: int, share: float, limits: Limits) -> str | None:
    """Why `need` bytes of full logits do not fit in `share` of this GPU's free memory or of the
    least free memory of any rank (`limits`), or None where they do."""
    if device.startswith("cuda") and need > share * torch.cuda.mem_get_info(device)[0]:
        return f"the full logits need {need / 2**30:.1f} GiB, over {share:.0%} of free memory"
    if not limits.logits_fit(need, share):
        return f"the full logits need {need / 2**30:.1f} GiB, over {share:.0%} of the least free memory of any rank ({limits.free / 2**30:.1f} GiB)"
    return None


def split_where_unlike(asked: str, recorded: str | None, limits: Limits, world: int):
    """optim.muon_split on ranks that differ: (split, how, {}[, the warning of a recorded
    redundant decided again]); a UserError for an explicit redundant; None where ranks are alike
    or the value (explicit split, recorded split) holds anyway."""
    from gptrain.training.recorded import decided_again

    if limits.alike or world < 2:
        return None
    unlike = f"ranks differ ({limits.differ()})"
    if asked == "redundant":
        raise UserError(
            f"optim.muon_split = 'redundant' computes every orthogonalisation on every rank, which keeps replicas identical only on identical devices, but {unlike}; use optim.muon_split=split or auto"
        )
    if asked != "auto" or recorded == "split":
        return None
    again = [decided_again("muon_split", recorded, unlike, "split")] if recorded else []
    return ("split", f"rule: {unlike}", {}, *again)


def here(device: str) -> Limits:
    """The Limits of one process on `device` (a caller that gathered nothing)."""
    return agree([local(device, env={})])
