"""What a rana export's record means inside vLLM, as pure functions (no vLLM import; tests/test_vllm_layout.py).

vLLM fuses projections that read one input (``qkv_proj`` = q/k/v, ``gate_up_proj`` = gate/up) and shards every
linear over the tensor-parallel ranks. rana records one adapter per projection. This module maps the one onto
the other:

- `served_kind` / `refusal`: which adapter kinds vLLM serves (`SERVED`, filled by `@serves`; every other kind
  of rana's adapter registry is refused at load, in one line naming it);
- `fused_parts`: a vLLM layer's rana projections, in its output order (``packed_modules_mapping``);
- `Partition`: one projection as it lives on this rank: its rows in the fused output, and where its shard
  starts in the checkpoint tensor (q/k/v replicate kv heads when there are more ranks than kv heads);
- `TENSOR_AXES` / `shard`: which axis of each stored tensor is the output or the input, and the slice of a
  checkpoint tensor this rank keeps (column-parallel layers split outputs, row-parallel layers inputs);
- `weight_renames`: the checkpoint names vLLM must see (biases onto vLLM's own shard-aware bias, a stacked
  q/k/v rank code onto its fused layer, thresholds and column norms dropped: the record holds the thresholds,
  and the norms are recomputed from the weights as `rana.load` recomputes them).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

# adapter kind -> how its projection computes: the child holding the masked matrix, the child computing a dense
# code first (rank adapters: z = B x), the mask mode of rana's kernels, and whether the mask reads column norms
SERVED: dict[str, "Served"] = {}


@dataclass(frozen=True)
class Served:
    kind: str
    masked: str  # the child whose matrix the mask selects rows of ("linear", "A"; "" for the head's own weight)
    mode: str  # rana.kernels.modes name: "abs", "abs_scaled" (|x|·‖W[:, j]‖), "square" (z²)
    code: str | None = None  # "own": a child B computes z = B x; "shared": the record's shared code does
    norms: bool = False  # the mask reads ‖W[:, j]‖ (recomputed after loading)


def serves(kind: str, **how) -> None:
    SERVED[kind] = Served(kind, **how)


serves("input_sparse", masked="linear", mode="abs")
serves("neuron", masked="linear", mode="abs_scaled", norms=True)
serves("rank", masked="A", mode="square", code="own")
serves("rank_slice", masked="A", mode="square", code="shared")
serves("input_sparse_head", masked="", mode="abs")
# not an adapter kind: a projection left dense whose weights `rana quantize` made int8 (its own qweight /
# weight_scale, no mask: rana.modules.int8.Int8Linear)
INT8_DENSE = "int8_dense"
serves(INT8_DENSE, masked="", mode="none")
# a stacked q/k/v code is no projection of its own: its rank slices read it (refused when nothing does)
CODE_KINDS = ("shared_code",)

WHY_NOT = {
    "sparse_lowrank": "its low-rank side path runs beside the masked product",
    "rotated_input": "its input rotation runs before the masked product",
    "cats": "its mask gates the up projection with the activated gate",
    "moe_input_sparse": "vLLM's fused mixture-of-experts kernels take no per-expert input mask",
}


class NotServed(ValueError):
    """A folder vLLM cannot serve exactly: one line, at load."""


def refusal(record: dict) -> str | None:
    """Why the export's record cannot be served by rana's vLLM plugin (one line), or None."""
    if record.get("laurel"):
        return ("this folder has LAuReL residuals, which change the decoder layer itself: rana's vLLM plugin "
                "serves adapters of linear layers only (serve it with `transformers serve`)")
    for spec in record.get("adapters") or []:
        kind = spec.get("type")
        if kind in SERVED or kind in CODE_KINDS:
            continue
        why = WHY_NOT.get(kind, "rana's vLLM plugin has no linear method for it")
        return (f"adapter kind {kind!r} ({spec.get('path')}) is not served by rana's vLLM plugin: {why} "
                f"(serve this folder with `transformers serve`, or compress with the default method)")
    return None


def adapters_by_path(record: dict) -> dict[str, dict]:
    return {spec["path"]: spec for spec in record.get("adapters") or []}


def fused_parts(prefix: str, packed: dict[str, list[str]]) -> list[str]:
    """The rana paths of the projections vLLM fused into the layer `prefix` (itself when not fused)."""
    parent, _, leaf = prefix.rpartition(".")
    members = packed.get(leaf)
    if not members:
        return [prefix]
    return [f"{parent}.{m}" if parent else m for m in members]


@dataclass(frozen=True)
class Partition:
    """One projection of a (maybe fused) layer on this rank."""
    path: str  # its rana path
    shard_id: object  # what vLLM's stacked loader tags its tensors with ("q", 0, ...; None unfused)
    rows: int  # its outputs on this rank
    offset: int  # where they start in the layer's local output
    start: int  # where this rank's rows start in the checkpoint tensor (column-parallel)


def column_partitions(paths: list[str], shard_ids: list, local_sizes: list[int], starts: list[int]) -> list[Partition]:
    out, offset = [], 0
    for path, sid, rows, start in zip(paths, shard_ids, local_sizes, starts):
        out.append(Partition(path, sid, rows, offset, start))
        offset += rows
    return out


def qkv_starts(tp_rank: int, local_sizes: list[int], kv_replicas: int) -> list[int]:
    """Where this rank's q, k and v rows start in the checkpoint tensors: q by rank, k/v by kv-head group (with
    more ranks than kv heads, `kv_replicas` ranks hold the same kv heads)."""
    q, k, v = local_sizes
    return [tp_rank * q, (tp_rank // kv_replicas) * k, (tp_rank // kv_replicas) * v]


# stored tensor (child.name) -> (output axis, input axis) in the checkpoint's layout; None: the tensor has no such
# axis. Float weights are (out, in); int8 codes are stored transposed (in, out) (rana.modules.int8).
TENSOR_AXES = {
    "weight": (0, 1),
    "qweight": (1, 0),
    "weight_scale": (0, None),
}
CODE_CHILD = "B"  # a rank code's matrix: its outputs are ranks (never sharded), its inputs the layer's


def axes(child: str, name: str) -> tuple[int | None, int | None]:
    out_axis, in_axis = TENSOR_AXES[name]
    if child == CODE_CHILD or child == "code":
        return None, in_axis  # ranks are not split over the tensor-parallel ranks
    if child == "A":
        return out_axis, None  # its inputs are ranks
    return out_axis, in_axis


def shard(tensor, child: str, name: str, *, rows: tuple[int, int] | None, cols: tuple[int, int] | None):
    """The slice of checkpoint `tensor` this rank keeps: `rows` (start, size) along its output axis for a
    column-parallel layer, `cols` along its input axis for a row-parallel one (None: not split)."""
    out_axis, in_axis = axes(child, name)
    if rows is not None and out_axis is not None:
        tensor = tensor.narrow(out_axis, *rows)
    if cols is not None and in_axis is not None:
        tensor = tensor.narrow(in_axis, *cols)
    return tensor


def local_shape(spec: dict, child: str, name: str, *, rows: int | None, cols: int | None) -> tuple[int, ...]:
    """The shape one projection's stored tensor has on this rank (`rows` / `cols`: its local outputs / inputs)."""
    out_f, in_f, rank = spec.get("out"), spec.get("in"), spec.get("rank")
    if child == "A":
        out_f, in_f = spec["out"], rank
    elif child in (CODE_CHILD, "code"):
        out_f, in_f = rank, spec["in"]
    out_axis, in_axis = axes(child, name)
    if rows is not None and out_axis is not None:
        out_f = rows
    if cols is not None and in_axis is not None:
        in_f = cols
    return {"weight": (out_f, in_f), "qweight": (in_f, out_f), "weight_scale": (out_f,)}[name]


def weight_renames(record: dict, packed: dict[str, list[str]]) -> dict[str, str | None]:
    """Regex → replacement (None: drop) for the checkpoint names of an export, as vLLM's weights mapper takes
    them. Written against both the full names and those below ``model.`` (vLLM maps at both levels)."""
    renames: dict[str, str | None] = {
        r"\.(threshold|column_norms)$": None,  # the record's thresholds; norms recomputed from the weights
        r"\.(linear|A)\.bias$": ".bias",  # vLLM's own bias: loaded per shard, added on rank 0 of a row-parallel layer
    }
    specs = record.get("adapters") or []
    for spec in specs:
        if spec.get("type") != "shared_code":
            continue
        code_parent, _, code_leaf = spec["path"].rpartition(".")
        readers = [s["path"].rpartition(".")[2] for s in specs if s.get("code") == spec["path"]]
        fused = [name for name, members in packed.items() if readers and set(readers) <= set(members)]
        if len(fused) != 1:
            raise NotServed(f"the stacked rank code {spec['path']} is read by {readers or 'no projection'}, which "
                            f"vLLM does not fuse into one layer: rana's vLLM plugin cannot serve it")
        renames[rf"\.{re.escape(code_leaf)}\.B\."] = f".{fused[0]}.code."
    return renames


def threshold_of(spec: dict, specs: dict[str, dict]) -> float:
    """A projection's threshold as rana's loader reads it (null: -inf; "inf"), its shared code's for a slice."""
    if spec.get("type") == "rank_slice":
        spec = specs[spec["code"]]
    value = spec.get("threshold")
    return -math.inf if value is None else float(value)


def active_fraction(spec: dict, specs: dict[str, dict]) -> float | None:
    if spec.get("type") == "rank_slice":
        spec = specs[spec["code"]]
    return spec.get("active_fraction")


__all__ = ["SERVED", "Served", "serves", "CODE_KINDS", "NotServed", "refusal", "adapters_by_path", "fused_parts",
           "INT8_DENSE", "Partition", "column_partitions", "qkv_starts", "TENSOR_AXES", "axes", "shard", "local_shape",
           "weight_renames", "threshold_of", "active_fraction"]
