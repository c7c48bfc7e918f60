"""Multi-process calibration: N processes (launched by `accelerate launch`, `torchrun` or
`torch.multiprocessing.spawn`) each push 1/N of the calibration batches through every decoder
layer, then pool what the searches need, so N processes calibrate N× the tokens in about the time
one process needs for its share.

What is pooled (after each `collect_inputs`):

* second moments `C = Σ x xᵀ` and their token counts: `all_reduce` (sum);
* the threshold-sample rows (fit tokens the decomposition never sees) and the held-aside rows:
  `all_gather`, then re-ordered by *global* batch index, so every process holds exactly the rows a
  single process would have on the same tokens, in the same order;
* the MAC meters of each compressed layer (active counts, tokens): `all_reduce`, so the measured
  FLOPs are those of all held-aside tokens.

Every process then runs the same deterministic decompositions and searches on the same pooled
statistics and swaps in the same adapters (no broadcast needed; the plans agree to float64
rounding of the moment sums). The split of the global batches into moment / threshold-sample
batches is the single-process one (the last ~15 % of the fit batches feed thresholds), decided once
from the global batch count, so the pooled statistics equal a single process's.

Nothing here runs unless a process group with more than one process is initialised.
"""
from __future__ import annotations

import os
from typing import Iterable

import torch
import torch.distributed as dist

from ..errors import UserError

from ..accounting import metered_modules

# The share of the fit batches (the last ones) that feed threshold samples only; the rest feed the
# second moments. One value for `collect_inputs`, the batch split across processes and the memory estimate.
THRESHOLD_FRACTION = 0.15


def active() -> bool:
    """True inside an initialised process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_main_process() -> bool:
    return rank() == 0


def setup_from_env(device: str = "cpu") -> str:
    """Join the process group described by the launcher's environment (WORLD_SIZE > 1), through
    accelerate's `PartialState` (gloo on CPU, NCCL on CUDA). Returns this process's compute
    device: `cuda` becomes `cuda:<local rank>`."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return device
    if not (dist.is_available() and dist.is_initialized()):
        from accelerate import PartialState

        PartialState(cpu=not device.startswith("cuda"))
    if device == "cuda":
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ------------------------------------------------------------------ sharding the calibration batches


def global_roles(n_batches: int, threshold_fraction: float = THRESHOLD_FRACTION) -> list[str]:
    """Role of each global fit batch, as a single process assigns them: the last `n_thr` batches
    feed threshold samples only, the rest feed second moments ("both" when there is one batch)."""
    if n_batches <= 1:
        return ["both"] * n_batches
    n_thr = max(1, round(n_batches * threshold_fraction))
    return ["moment"] * (n_batches - n_thr) + ["sample"] * n_thr


def local_batches(n_batches: int, threshold_fraction: float = THRESHOLD_FRACTION) -> list[tuple[int, str | None]]:
    """(global batch index, role) of the batches this process handles.

    One process: every batch, role None (collect_inputs splits moment and sample batches itself).
    N processes: moment and sample batches are dealt round-robin separately (so each process gets
    its share of both), and each process's list interleaves the two kinds, so any prefix of it
    (e.g. a profiling subset) still holds both."""
    if not active():
        return [(b, None) for b in range(n_batches)]
    w, r = world_size(), rank()
    if n_batches < w:
        raise UserError(f"{n_batches} calibration batches cannot be split across {w} processes; "
                        "use more calibration tokens or a smaller --batch-size")
    roles = global_roles(n_batches, threshold_fraction)
    # one round-robin over the moment batches, then the sample batches (balanced counts)
    order = [b for kind in ("moment", "sample", "both") for b, k in enumerate(roles) if k == kind]
    dealt = [b for j, b in enumerate(order) if j % w == r]
    mine = []
    for kind in ("moment", "sample", "both"):
        ids = [b for b in dealt if roles[b] == kind]
        offset = 0.25 if kind == "sample" else 0.5  # samples early, so short prefixes hold both kinds
        mine += [((j + offset) / len(ids), b, kind) for j, b in enumerate(ids)]
    return [(b, kind) for _, b, kind in sorted(mine)]


# ------------------------------------------------------------------ collectives


def all_reduce_sum_(t: torch.Tensor) -> torch.Tensor:
    """In-place sum over processes (moved to the backend's device and back when needed)."""
    dev = _comm_device()
    buf = t if t.device == dev else t.to(dev)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    if buf is not t:
        t.copy_(buf)
    return t


def _gather_ints(values: list[int]) -> torch.Tensor:
    """world × len(values) int64 table of every process's `values`."""
    dev = _comm_device()
    mine = torch.tensor(values, dtype=torch.int64, device=dev)
    out = [torch.empty_like(mine) for _ in range(world_size())]
    dist.all_gather(out, mine)
    return torch.stack(out).cpu()


def all_gather_chunks(chunks: list[torch.Tensor], ids: list[int | None], dim: int | None = None,
                      dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], list[int]]:
    """Every process's row chunks (each `rows × dim`), tagged with global batch ids, gathered on
    every process and sorted by id (ties, and chunks without an id, by process then position).
    Returns (chunks, ids) on the CPU."""
    dim = dim if dim is not None else (chunks[0].shape[-1] if chunks else 0)
    lens = [c.shape[0] for c in chunks]
    sizes = _gather_ints([len(chunks), sum(lens), dim])
    dim = int(sizes[:, 2].max())
    max_chunks, max_rows = int(sizes[:, 0].max()), int(sizes[:, 1].max())
    if max_chunks == 0:
        return [], []
    dev = _comm_device()
    meta = torch.full((2, max_chunks), -1, dtype=torch.int64)
    meta[0, : len(lens)] = torch.tensor(lens, dtype=torch.int64)
    meta[1, : len(ids)] = torch.tensor([-1 if i is None else int(i) for i in ids], dtype=torch.int64)
    rows = torch.zeros(max_rows, dim, dtype=dtype)
    if chunks:
        rows[: sum(lens)] = torch.cat([c.reshape(-1, dim).to(dtype).cpu() for c in chunks])
    metas = [torch.empty_like(meta, device=dev) for _ in range(world_size())]
    dist.all_gather(metas, meta.to(dev))
    all_rows = [torch.empty(max_rows, dim, dtype=dtype, device=dev) for _ in range(world_size())]
    dist.all_gather(all_rows, rows.to(dev))
    tagged = []
    for r, (m, R) in enumerate(zip(metas, all_rows)):
        m, R = m.cpu(), R.cpu()
        n_chunks = int(sizes[r, 0])
        start = 0
        for j in range(n_chunks):
            n = int(m[0, j])
            bid = int(m[1, j])
            tagged.append(((bid if bid >= 0 else float("inf"), r, j), R[start:start + n].clone(), bid))
            start += n
    tagged.sort(key=lambda t: t[0])
    return [t[1] for t in tagged], [t[2] for t in tagged]


def reduce_stats(stats: dict, row_ids: dict, dims: dict[str, int | None], second_moment: Iterable[str],
                 device: torch.device | str = "cpu") -> None:
    """Pool `collect_inputs` statistics across processes in place (see the module docstring).
    `row_ids[name]` = {"fit": [...], "eval": [...]}: the global batch id of each row chunk.
    The pooled statistics end on `device`, the compute device (rana.compress.placement)."""
    for name in sorted(stats):
        s = stats[name]
        if name in second_moment:
            d = dims.get(name)
            if s.moment is None:  # this process saw no moment batch: contribute zeros
                if d is None:
                    d = int(_gather_ints([s.fit_rows[0].shape[-1] if s.fit_rows else 0])[:, 0].max())
                s.moment = torch.zeros(d, d, dtype=torch.float64, device=device)
            count = torch.tensor([float(s.count)], dtype=torch.float64)
            all_reduce_sum_(s.moment)
            all_reduce_sum_(count)
            s.count = int(count.item())
        dim = dims.get(name)
        fit_rows, row_ids[name]["fit"] = all_gather_chunks(s.fit_rows, row_ids[name]["fit"], dim)
        eval_rows, row_ids[name]["eval"] = all_gather_chunks(s.eval_rows, row_ids[name]["eval"], dim)
        s.fit_rows = [r.to(device) for r in fit_rows]
        s.eval_rows = [r.to(device) for r in eval_rows]


def sync_meters(module: torch.nn.Module) -> None:
    """Sum every MAC meter in `module` over processes (all processes call this for the same layer)."""
    if not active():
        return
    meters = list(metered_modules(module).values())
    if not meters:
        return
    vals = torch.tensor([[float(m._active_sum), float(m._tokens)] for m in meters], dtype=torch.float64)
    all_reduce_sum_(vals)
    for m, (a, n) in zip(meters, vals.tolist()):
        m._active_sum = torch.tensor(a, dtype=torch.float64)
        m._tokens = int(round(n))


def all_reduce_max(value: float) -> float:
    if not active():
        return value
    t = torch.tensor([float(value)], dtype=torch.float64)
    dev = _comm_device()
    t = t.to(dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
