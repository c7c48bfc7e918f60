"""vLLM's linear methods for rana's adapters: the weights a layer holds, how each checkpoint tensor reaches its
shard, and what ``apply`` calls (rana.vllm.compute's op). Imported only inside vLLM processes.

One method serves every kind rana.vllm.layout.SERVED lists, for any of vLLM's linear layers (q/k/v and gate/up
fused, o/down row-parallel, unfused ones): per projection it holds the children its kind stores (``linear``, a
rank adapter's ``A`` and ``B``, the stacked q/k/v ``code``), as float weights or int8 codes + scales, each as one
parameter whose loader writes every projection's shard into its own region. The LM head has its own method
(vocab-parallel, maybe tied to the embedding).
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn import Parameter

from vllm.model_executor.layers.linear import (LinearMethodBase, MergedColumnParallelLinear, QKVParallelLinear,
                                               RowParallelLinear)
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

from . import compute
from .layout import (INT8_DENSE, SERVED, NotServed, Partition, active_fraction, column_partitions, local_shape, qkv_starts, shard,
                     threshold_of)

INT8_NAMES = ("qweight", "weight_scale")


def _dense_for(device_is_cpu: bool):
    """A factory of the several-token GEMM for a (rows, in) float matrix: vLLM's prepacked CPU GEMM on CPU
    (oneDNN / sgl-kernel, chosen by vLLM), F.linear (cuBLAS) elsewhere."""
    def dense_for(weight: torch.Tensor):
        if not device_is_cpu:
            return lambda x, bias: torch.nn.functional.linear(x, weight, bias)
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        holder = nn.Module()
        holder.weight = Parameter(weight.contiguous(), requires_grad=False)
        # A stand-in bias, only for its dtype: vLLM converts a layer's bias to what the GEMM it picks takes (float32
        # for sgl-kernel's packed GEMM, which it picks for half precision on CPUs with AMX), and the biases passed
        # per call must follow, or that GEMM refuses them.
        holder.bias = Parameter(torch.zeros(weight.shape[0], dtype=weight.dtype), requires_grad=False)
        # the prepacked GEMMs keep their own packed copy (the row-major one is dropped); torch's fallback keeps it
        dispatch_cpu_unquantized_gemm(holder, remove_weight=True)
        w, bias_dtype = holder.weight, holder.bias.dtype
        del holder.bias
        return lambda x, bias: holder.cpu_linear(x, w, bias if bias is None else bias.to(bias_dtype))
    return dense_for


class _Stored:
    """One child tensor (e.g. ``linear.qweight``) of every projection of a layer: a flat parameter holding each
    projection's shard in its own region, and the loader writing them."""

    def __init__(self, layer, child: str, name: str, regions: dict, dtype, shard_of):
        numel = sum(int(torch.Size(shape).numel()) for _, shape in regions.values())
        self.param = Parameter(torch.empty(numel, dtype=dtype), requires_grad=False)
        self.child, self.name, self.regions, self.shard_of = child, name, regions, shard_of
        self.loaded: set = set()
        owner = layer._modules.get(child) if child else layer
        if owner is None:
            owner = nn.Module()
            layer.register_module(child, owner)
        owner.register_parameter(name, self.param)
        self.param.weight_loader = self.load

    def view(self, key) -> torch.Tensor:
        start, shape = self.regions[key]
        return self.param.data[start:start + int(torch.Size(shape).numel())].view(shape)

    def load(self, param, loaded: torch.Tensor, shard_id=None):
        if shard_id is None:
            shard_id = getattr(loaded, "shard_id", None)
        if shard_id not in self.regions:
            raise NotServed(f"rana: a checkpoint tensor {self.child}.{self.name} of shard {shard_id!r} has no place "
                            f"in this layer")
        part = self.shard_of(shard_id)
        t = shard(loaded, self.child, self.name, rows=part[0], cols=part[1])
        target = self.view(shard_id)
        if tuple(t.shape) != tuple(target.shape):
            raise NotServed(f"rana: {self.child}.{self.name} of {shard_id!r} has shape {tuple(loaded.shape)}, the "
                            f"record makes it {tuple(target.shape)} on this rank: re-export the model with `rana export`")
        target.copy_(t)
        self.loaded.add(shard_id)


class RanaLinearMethod(LinearMethodBase):
    """A vLLM linear layer made of rana projections (`specs`, in the layer's output order)."""

    def __init__(self, config, prefix: str, specs: list[dict]):
        self.config, self.prefix, self.specs = config, prefix, specs
        self.served = [SERVED[s["type"]] for s in specs]

    # ---- geometry -------------------------------------------------------------------------
    def _partitions(self, layer, output_partition_sizes) -> tuple[list[Partition], tuple | None, bool]:
        tp_rank, tp_size = getattr(layer, "tp_rank", 0), getattr(layer, "tp_size", 1)
        paths = [s["path"] for s in self.specs]
        if isinstance(layer, RowParallelLinear):
            cols = (tp_rank * layer.input_size_per_partition, layer.input_size_per_partition)
            return column_partitions(paths, [None], list(output_partition_sizes), [0]), cols, True
        sizes = list(output_partition_sizes)
        if isinstance(layer, QKVParallelLinear):
            ids, starts = ["q", "k", "v"], qkv_starts(tp_rank, sizes, getattr(layer, "num_kv_head_replicas", 1))
        elif isinstance(layer, MergedColumnParallelLinear):
            ids, starts = list(range(len(sizes))), [tp_rank * s for s in sizes]
        else:
            ids, starts = [None], [tp_rank * sizes[0] if tp_size > 1 else 0]
        if len(ids) != len(paths):
            raise NotServed(f"rana: vLLM's {self.prefix} fuses {len(ids)} projections, the record names {len(paths)}")
        return column_partitions(paths, ids, sizes, starts), None, False

    # ---- weights ----------------------------------------------------------------------------
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        # a dense int8 projection records no shapes: its inputs are the layer's (outputs: each part's rows)
        self.specs = [{**s, "in": input_size} if s["type"] == INT8_DENSE else s for s in self.specs]
        parts, cols, row_parallel = self._partitions(layer, output_partition_sizes)
        tp_size = getattr(layer, "tp_size", 1)
        if row_parallel and tp_size > 1 and any(s.code for s in self.served):
            raise NotServed(f"rana: {self.prefix} is a rank adapter on a row-parallel layer: its code z = B x needs the "
                            f"whole input, which tensor parallelism splits; serve it with tensor_parallel_size=1")
        block = self.config.activation_block
        if row_parallel and tp_size > 1 and self.config.activations == "int8" and input_size_per_partition % block:
            raise NotServed(f"rana: W8A8 quantizes each token's inputs in blocks of {block}; tensor parallelism splits "
                            f"the {input_size} inputs of {self.prefix} into {input_size_per_partition} per rank, which "
                            f"cuts blocks: serve this folder with a tensor_parallel_size that keeps {block} | inputs per rank")
        by_id = {p.shard_id: p for p in parts}
        in_local = input_size_per_partition

        def shard_of(shard_id):
            p = by_id[shard_id]
            return (None if row_parallel else (p.start, p.rows)), cols

        stored = {}
        dtypes = {"weight": params_dtype, "qweight": torch.int8, "weight_scale": torch.float32}  # as rana stores them
        children = []  # the children each projection stores (its masked matrix, its own rank code)
        masked = {s.masked for s in self.served}
        codes = {s.code for s in self.served}
        if len(masked) != 1 or len(codes) != 1:
            raise NotServed(f"rana: the projections of {self.prefix} are of kinds "
                            f"{sorted({s['type'] for s in self.specs})}, which vLLM cannot fuse into one layer")
        children.append(masked.pop())
        code = codes.pop()
        if code == "own":
            children.append("B")
        for child in children:
            int8 = self.config.is_int8(self.specs, child)
            for name in (INT8_NAMES if int8 else ("weight",)):
                regions, start = {}, 0
                for p, spec in zip(parts, self.specs):
                    shape = local_shape(spec, child, name, rows=p.rows, cols=in_local if row_parallel else None)
                    regions[p.shard_id] = (start, shape)
                    start += int(torch.Size(shape).numel())
                stored[child, name] = _Stored(layer, child, name, regions, dtypes[name], shard_of)
        if code == "shared":
            code_spec = self.config.specs[self.specs[0]["code"]]
            if any(s.get("code") != code_spec["path"] for s in self.specs):
                raise NotServed(f"rana: the projections of {self.prefix} read different stacked codes")
            int8 = self.config.is_int8([code_spec], "B")
            for name in (INT8_NAMES if int8 else ("weight",)):
                shape = local_shape(code_spec, "code", name, rows=None, cols=in_local if row_parallel else None)
                stored["code", name] = _Stored(layer, "code", name, {None: (0, shape)}, dtypes[name],
                                               lambda _sid: (None, cols))
        layer.rana_parts, layer.rana_stored, layer.rana_row_parallel = parts, stored, row_parallel
        layer.register_buffer("rana_anchor", torch.zeros(1, dtype=torch.float32), persistent=False)
        layer.rana_out = sum(output_partition_sizes)
        layer.rana_dtype = params_dtype  # the model's dtype: int8 weights' dequantized copy for several tokens

    def _matrix(self, layer, child: str, key) -> compute.Matrix:
        stored = layer.rana_stored
        if (child, "weight") in stored:
            return compute.Matrix(weight=stored[child, "weight"].view(key))
        return compute.Matrix(q_t=stored[child, "qweight"].view(key), qscale=stored[child, "weight_scale"].view(key),
                              activations=self.config.activations, block=self.config.activation_block)

    def process_weights_after_loading(self, layer) -> None:
        for (child, name), st in layer.rana_stored.items():
            missing = [k for k in st.regions if k not in st.loaded]
            if missing:
                where = ", ".join(str(k) for k in missing)
                raise NotServed(f"rana: {self.prefix}: the checkpoint has no {child}.{name} for {where}: re-export the "
                                f"model with `rana export`")
        device = layer.rana_anchor.device
        specs = self.config.specs
        codes, parts = [], []
        if ("code", "weight") in layer.rana_stored or ("code", "qweight") in layer.rana_stored:
            codes.append(compute.Code(self._matrix(layer, "code", None)))
        for p, spec, served in zip(layer.rana_parts, self.specs, self.served):
            m = self._matrix(layer, served.masked, p.shard_id)
            if not m.int8:
                m = compute.Matrix(weight=compute.column_major(m.weight))
            scale = None
            if served.norms:
                sq = m.fp32().pow(2).sum(dim=0)
                if not layer.rana_row_parallel and getattr(layer, "tp_size", 1) > 1:
                    from vllm.distributed import tensor_model_parallel_all_reduce
                    sq = tensor_model_parallel_all_reduce(sq)
                scale = sq.sqrt().to(torch.float32).contiguous()
            code = None
            if served.code == "own":
                codes.append(compute.Code(self._matrix(layer, "B", p.shard_id)))
                code = len(codes) - 1
            elif served.code == "shared":
                code = 0
            threshold = None if served.mode == "none" else \
                torch.tensor(threshold_of(spec, specs), dtype=torch.float32, device=device)
            parts.append(compute.Part(spec["path"], p.rows, p.offset, m, served.mode, threshold, scale, code,
                                      compute.part_sparsity_bin(active_fraction(spec, specs))))
        state = compute.LayerState(self.prefix, parts, codes, _dense_for(device.type == "cpu"), layer.rana_dtype)
        layer.rana_state = state  # the layer holds its state; the op finds it through the anchor
        compute.register_state(layer.rana_anchor, state)
        # the flat loading buffers of float matrices were copied (column-major parts, the GEMMs' packed weights)
        for (child, name), st in layer.rana_stored.items():
            if name == "weight" and child != "code" and child != "B":
                st.param.data = torch.empty(0, dtype=st.param.dtype, device=st.param.device)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return compute.vllm_linear(x, layer.rana_anchor, bias, layer.rana_out)


class RanaHeadMethod(QuantizeMethodBase):
    """The input-sparse LM head (``input_sparse_head``): vocab-parallel rows, float (maybe the embedding's, tied)
    or int8 codes + scales; logits = W (m ⊙ x), m = |x| >= t, per token. Also a dense head with int8 weights
    (mode "none": no mask)."""

    def __init__(self, config, prefix: str, spec: dict):
        self.config, self.prefix, self.spec = config, prefix, spec
        self.int8 = config.is_int8([spec], "")
        self.mode = SERVED[spec["type"]].mode

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        rows = sum(output_partition_sizes)
        if not self.int8:
            weight = Parameter(torch.empty(rows, input_size_per_partition, dtype=params_dtype), requires_grad=False)
            layer.register_parameter("weight", weight)
            weight.output_dim, weight.input_dim = 0, 1
            weight.weight_loader = extra_weight_attrs.get("weight_loader")
        else:
            q = Parameter(torch.zeros(input_size_per_partition, rows, dtype=torch.int8), requires_grad=False)
            s = Parameter(torch.zeros(rows, dtype=torch.float32), requires_grad=False)
            layer.register_parameter("qweight", q)
            layer.register_parameter("weight_scale", s)
            q.weight_loader = s.weight_loader = self._load_int8(layer)
            layer.rana_loaded = set()
        layer.register_buffer("rana_anchor", torch.zeros(1, dtype=torch.float32), persistent=False)
        layer.rana_out = rows
        layer.rana_dtype = params_dtype

    def _load_int8(self, layer):
        def load(param, loaded, *_):
            idx = layer.shard_indices
            start, size = idx.org_vocab_start_index, idx.org_vocab_end_index - idx.org_vocab_start_index
            axis = 1 if param.dim() == 2 else 0
            if loaded.shape[axis] != self.spec["out"]:
                raise NotServed(f"rana: lm_head has {loaded.shape[axis]} outputs, the record {self.spec['out']}")
            piece = loaded.narrow(axis, start, size)
            param.data.zero_()
            param.data.narrow(axis, 0, size).copy_(piece)
            layer.rana_loaded.add(param.dim())
        return load

    def tie_weights(self, layer, embed_tokens):
        if self.int8:  # an int8 head has codes of its own (the embedding keeps its full-precision rows)
            return layer
        return super().tie_weights(layer, embed_tokens)

    def process_weights_after_loading(self, layer) -> None:
        if self.int8:
            if layer.rana_loaded != {1, 2}:
                raise NotServed("rana: the checkpoint lacks lm_head.qweight or lm_head.weight_scale: re-export the model")
            m = compute.Matrix(q_t=layer.qweight.data, qscale=layer.weight_scale.data, activations=self.config.activations,
                               block=self.config.activation_block)
        else:
            m = compute.Matrix(weight=compute.column_major(layer.weight.data))
        device = layer.rana_anchor.device
        t = None if self.mode == "none" else \
            torch.tensor(threshold_of(self.spec, self.config.specs), dtype=torch.float32, device=device)
        part = compute.Part("lm_head", layer.rana_out, 0, m, self.mode, t, None, None,
                            compute.part_sparsity_bin(self.spec.get("active_fraction")))
        packed = _dense_for(device.type == "cpu")
        row_major = None if self.int8 else layer.weight.data  # (a tied head's: the embedding's rows, not a copy)
        layer.rana_state = compute.LayerState(self.prefix, [part], [],
                                              lambda rows: packed(rows if row_major is None else row_major),
                                              layer.rana_dtype)
        compute.register_state(layer.rana_anchor, layer.rana_state)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return compute.vllm_linear(x, layer.rana_anchor, bias, layer.rana_out)

    def embedding(self, layer, input_):  # the head is never looked up; the embedding keeps vLLM's own method
        raise NotImplementedError("rana's LM head method computes logits only")


__all__ = ["RanaLinearMethod", "RanaHeadMethod"]
