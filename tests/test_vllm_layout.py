"""rana's vLLM plugin without vLLM: what it serves and refuses, the checkpoint names it maps, and the
computation of one fused / sharded layer (rana.vllm.compute) against rana's own adapter modules, for one token
(the masked GEMV) and several (each row's own mask), whole and split over two tensor-parallel ranks.
The plugin inside vLLM itself: tests_vllm/ (`make test-vllm`)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from helpers import tiny_model
from rana.compress import CompressConfig, compress_model
from rana.modules.registry import ADAPTER_KINDS
from rana.vllm import compute, layout
from rana.vllm.support import check_vllm

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


@pytest.mark.parametrize("kind", sorted(ADAPTER_KINDS))
def test_every_registered_kind_is_served_or_refused_by_name(kind):
    record = {"adapters": [{"path": "model.layers.0.mlp.up_proj", "type": kind}], "laurel": None}
    why = layout.refusal(record)
    if kind in layout.SERVED or kind in layout.CODE_KINDS:
        assert why is None
    else:
        assert why is not None and f"'{kind}'" in why and "\n" not in why


def test_laurel_refused():
    assert "LAuReL" in layout.refusal({"adapters": [], "laurel": {"variant": "rw"}})


@pytest.mark.parametrize("version,ok", [("0.32.0", True), ("0.32.3+cpu", True), ("0.31.1", False), ("0.33.0", False)])
def test_vllm_version_range(version, ok):
    if ok:
        check_vllm(version)
    else:
        with pytest.raises(layout.NotServed, match="supports vLLM 0.32.x"):
            check_vllm(version)


def test_weight_renames():
    record = {"adapters": [
        {"path": "model.layers.0.self_attn.qkv_code", "type": "shared_code"},
        *({"path": f"model.layers.0.self_attn.{p}", "type": "rank_slice", "code": "model.layers.0.self_attn.qkv_code"}
          for p in ("q_proj", "k_proj", "v_proj"))]}
    rules = layout.weight_renames(record, PACKED)
    import re

    def mapped(name):
        for pattern, new in rules.items():
            if re.search(pattern, name):
                if new is None:
                    return None
                name = re.sub(pattern, new, name)
        return name
    assert mapped("model.layers.0.self_attn.q_proj.threshold") is None
    assert mapped("model.layers.3.mlp.down_proj.column_norms") is None
    assert mapped("model.layers.0.self_attn.q_proj.linear.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert mapped("model.layers.0.self_attn.q_proj.A.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert mapped("model.layers.0.self_attn.qkv_code.B.weight") == "model.layers.0.self_attn.qkv_proj.code.weight"
    assert mapped("layers.0.self_attn.qkv_code.B.qweight") == "layers.0.self_attn.qkv_proj.code.qweight"
    assert mapped(mapped("model.layers.0.self_attn.q_proj.linear.bias")) == "model.layers.0.self_attn.q_proj.bias"
    with pytest.raises(layout.NotServed, match="stacked rank code"):
        layout.weight_renames(record, {"gate_up_proj": ["gate_proj", "up_proj"]})


def test_qkv_shards_replicate_kv_heads():
    # 8 q heads, 2 kv heads of 16 over 4 ranks: 2 q heads per rank, each kv head on 2 ranks
    starts = [layout.qkv_starts(r, [32, 16, 16], kv_replicas=2) for r in range(4)]
    assert starts == [[0, 0, 0], [32, 0, 0], [64, 16, 16], [96, 16, 16]]


def test_shard_axes():
    w = torch.arange(6 * 4).view(6, 4)  # float (out, in)
    q = w.t().contiguous()  # int8 codes stored (in, out)
    assert torch.equal(layout.shard(w, "linear", "weight", rows=(2, 3), cols=None), w[2:5])
    assert torch.equal(layout.shard(q, "linear", "qweight", rows=(2, 3), cols=None), q[:, 2:5])
    assert torch.equal(layout.shard(w, "linear", "weight", rows=None, cols=(1, 2)), w[:, 1:3])
    assert torch.equal(layout.shard(q, "linear", "qweight", rows=None, cols=(1, 2)), q[1:3])
    assert torch.equal(layout.shard(w, "B", "weight", rows=(2, 3), cols=None), w)  # ranks are never split
    assert torch.equal(layout.shard(w, "A", "weight", rows=(2, 3), cols=(0, 1)), w[2:5])  # A's inputs are ranks


# ---- one fused / sharded layer against rana's modules ------------------------------------------------------
@pytest.fixture(scope="module")
def models():
    out = {}
    for method in ("rana", "rana-paper", "rana-int8", "rana-paper-int8"):
        model = tiny_model("llama", seed=3, hidden_size=64, intermediate_size=256)  # 128 per rank: whole W8A8 blocks
        ids = torch.randint(0, 128, (20, 32), generator=torch.Generator().manual_seed(0))
        cfg = CompressConfig(model="x", flops=0.6, method=method.replace("-int8", ""), calib_tokens=512, seq_len=32,
                             batch_size=4, search_tokens=128, fit_sample_tokens=256)
        model = compress_model(model, None, cfg, SimpleNamespace(fit=ids[:16], heldout=ids[16:])).model.eval()
        if method.endswith("int8"):
            from rana.quantize import quantize_model
            quantize_model(model, ids[:16], batch_size=4, activations="int8")
        out[method] = model
    return out


def _matrix(layer) -> compute.Matrix:
    if hasattr(layer, "qweight"):
        return compute.Matrix(q_t=layer.qweight, qscale=layer.weight_scale, activations=layer.activations,
                              block=layer.activation_block)
    return compute.Matrix(weight=layer.weight)


def _slice(m: compute.Matrix, rows=None, cols=None) -> compute.Matrix:
    """The shard of a matrix a rank holds: `rows` (start, size) of its outputs, `cols` of its inputs."""
    if m.int8:
        q, s = m.q_t, m.qscale
        if rows:
            q, s = q[:, rows[0]:rows[0] + rows[1]], s[rows[0]:rows[0] + rows[1]]
        if cols:
            q = q[cols[0]:cols[0] + cols[1]]
        return compute.Matrix(q_t=q.contiguous(), qscale=s.contiguous(), activations=m.activations, block=m.block)
    w = m.weight
    if rows:
        w = w[rows[0]:rows[0] + rows[1]]
    if cols:
        w = w[:, cols[0]:cols[0] + cols[1]]
    return compute.Matrix(weight=compute.column_major(w))


def _state(adapters, kinds, rank=0, ranks=1, row_parallel=False, code=None):
    """What RanaLinearMethod builds for `adapters` (one vLLM layer's projections) on tensor-parallel rank `rank`."""
    parts, codes, offset = [], [], 0
    if code is not None:
        codes.append(compute.Code(_matrix(code.B)))
    for a, kind in zip(adapters, kinds):
        served = layout.SERVED[kind]
        child = a._modules[served.masked]
        full = _matrix(child)
        out_f = child.out_features
        rows = None if row_parallel else (rank * out_f // ranks, out_f // ranks)
        cols = (rank * child.in_features // ranks, child.in_features // ranks) if row_parallel else None
        m = _slice(full, rows, cols)
        scale = None
        if served.norms:
            scale = _slice(full, rows, None).fp32().pow(2).sum(0).sqrt() if not row_parallel else \
                full.fp32().pow(2).sum(0).sqrt()[cols[0]:cols[0] + cols[1]].contiguous()
        threshold = (code if code is not None else a)._buffers["threshold"]
        code_index = None
        if served.code == "own":
            codes.append(compute.Code(_matrix(a.B)))
            code_index = len(codes) - 1
        elif served.code == "shared":
            code_index = 0
        n = out_f if row_parallel else out_f // ranks
        parts.append(compute.Part(kind, n, offset, m, served.mode, threshold.clone(), scale, code_index))
        offset += n
    return compute.LayerState("layer", parts, codes, lambda w: (lambda x, b: F.linear(x, w, b)))


def _reference(adapters, x):
    return torch.cat([a(x) for a in adapters], dim=-1)


def _sites(model, method):
    layer = model.model.layers[1]
    attn, mlp = layer.self_attn, layer.mlp
    qkv, gate_up = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
    kind = lambda m: type(m).spec_type  # noqa: E731
    code = getattr(attn, "qkv_code", None)
    return [(qkv, [kind(m) for m in qkv], code, False), (gate_up, [kind(m) for m in gate_up], None, False),
            ([mlp.down_proj], [kind(mlp.down_proj)], None, True)]


@pytest.mark.parametrize("method", ["rana", "rana-paper", "rana-int8", "rana-paper-int8"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_layer_state_equals_rana_modules(models, method, tokens):
    model = models[method]
    g = torch.Generator().manual_seed(tokens)
    with torch.no_grad():
        for adapters, kinds, code, row_parallel in _sites(model, method):
            x = torch.randn(tokens, adapters[0].in_features, generator=g)
            want = _reference(adapters, x)
            got = _state(adapters, kinds, code=code)(x, None)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            # the same layer split over two tensor-parallel ranks: outputs concatenated (column-parallel) or
            # summed (row-parallel, each rank masking its own input shard with the same thresholds)
            shards = [_state(adapters, kinds, rank=r, ranks=2, row_parallel=row_parallel, code=code)
                      for r in range(2)]
            if row_parallel:
                k = x.shape[-1] // 2
                split = sum(s(x[:, r * k:(r + 1) * k], None) for r, s in enumerate(shards))
            else:
                outs = [s(x, None) for s in shards]
                sizes = [a.out_features for a in adapters]
                pieces = [[o.split([n // 2 for n in sizes], dim=-1)[i] for o in outs] for i in range(len(sizes))]
                split = torch.cat([torch.cat(p, dim=-1) for p in pieces], dim=-1)
            torch.testing.assert_close(split, want, rtol=1e-4, atol=1e-4)


def test_several_tokens_mask_each_row(models):
    """A batch row decoded with others gets the output it gets alone (its own mask, not a shared one)."""
    adapters, kinds, code, _ = _sites(models["rana"], "rana")[1]
    state = _state(adapters, kinds, code=code)
    x = torch.randn(4, adapters[0].in_features, generator=torch.Generator().manual_seed(9))
    x[2] *= 40  # a row far from the others: a shared mask would differ from its own
    with torch.no_grad():
        together = state(x, None)
        alone = torch.cat([state(x[i:i + 1], None) for i in range(4)])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-4)
    assert not math.isnan(float(together.sum()))
