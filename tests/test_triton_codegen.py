"""What inductor and the CUDA compiler do with the shipped Triton kernels, proven on a CPU.

Under torch.compile on CUDA, inductor re-emits each user Triton kernel's source into its output
module and keeps only the helpers it finds among the kernel's global names; a helper reached any
other way is missing there and the first compiled decode step fails. Here every shipped kernel is
regenerated with inductor's own function, executed from a fresh module file and compiled by Triton
for an sm_90 target, and the PTX of every specialization the compiled path can launch is read (the
int8-weight and expert kernels' too; the heuristic's configs on a 132-SM GPU such as the H100 and H200,
and every GPU's entries of the shipped tuning table): no barrier inside the K loop, weight loads
prefetched a step ahead, no spills. Negative controls show each check can fail. Runs in a subprocess
without TRITON_INTERPRET (the interpreter's functions have no PTX). No GPU needed. Under torch 2.11 (the
GPU machine's) inductor's mutation analysis reports the written tensors only, so the read checks need 2.13.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rana.kernels import triton_gemv as tg

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not tg.triton_available(), reason="triton is not installed")

SCRIPT = textwrap.dedent(r'''
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import ptx_table as pt
    from rana.kernels import triton_gemv as tg

    out = {"sources": {}, "rows": []}
    kernels = {}
    for k in (*tg.kernels(), tg.int8_kernel(), tg.expert_kernel()):
        src = pt.regenerated_source(k)
        out["sources"][k.__name__] = [name for name in ("_kept_rows_dot", "_grouped", "_project", "_active", "_dense_rows")
                                      if f"def {name}(" in src]
        kernels[k.__name__] = pt.regenerated_kernel(k)
    # every specialization of every kernel: the heuristic's on a 132-SM GPU and every GPU's table entries
    for v in pt.all_variants():
        out["rows"].append(pt.analyse(v, kernels))

    # negative controls: a helper reached through a closure, and a reduction inside the loop
    path = sys.argv[2]
    import importlib.util
    spec = importlib.util.spec_from_file_location("bad_kernels", path)
    bad = importlib.util.module_from_spec(spec); spec.loader.exec_module(bad)
    closure_kernel = bad.build()
    try:
        pt.compile_sm90(pt.regenerated_kernel(closure_kernel), tg.torch.bfloat16, {"BLOCK": 64}, 4)
        out["closure_compiles"] = True
    except Exception as exc:
        out["closure_compiles"] = False
        out["closure_error"] = f"{type(exc).__name__}: {exc}"[:300]
    ptx = pt.compile_sm90(pt.regenerated_kernel(bad.reduce_in_loop), tg.torch.bfloat16,
                          {"BLOCK_N": 64, "BLOCK_K": 16}, 8).asm["ptx"]
    out["in_loop"] = pt.ptx_stats(ptx)
    # inductor's mutation analysis (what it would clone or treat as mutated), for an sm_90 target
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from torch._higher_order_ops import triton_kernel_wrap as tkw

    class Sm90Driver:  # the only thing the analysis asks the driver
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    triton.runtime.driver.set_active(Sm90Driver())
    bf, f32 = torch.bfloat16, torch.float32
    w, v, t = torch.empty(128, 192, dtype=bf), torch.empty(128, dtype=bf), torch.empty((), dtype=f32)
    y, ws = torch.empty(192, dtype=bf), torch.empty(2, 192, dtype=f32)
    sizes = dict(K0=128, K1=128, K2=128, N0=64, N1=64, N2=64, SW0=192, SW1=192, SW2=192, NB0=1, NB1=1,
                 KC0=64, KC1=64, KC2=64, n_total=192, MODE=3, B0=True, B1=False, B2=False, BLOCK_N=64, BLOCK_K=64)
    tensors = {f"{p}{g}": x for g in range(3) for p, x in (("w", w), ("v", v), ("t", t), ("s", v), ("b", y))}
    def accesses(kernel, args):
        """[reads, writes]: reads None where this torch's analysis reports the writes only."""
        if hasattr(tkw, "identify_accessed_tensors"):  # torch 2.13: reads and writes
            rw = tkw.identify_accessed_tensors(kernel, args, {}).read_writes
            return sorted(d.name for d in rw.reads), sorted(d.name for d in rw.writes)
        # torch 2.11 (the GPU machine's): the written tensors only. Both fall back to "every tensor argument"
        # when the analysis fails, which the write checks catch.
        return None, sorted(tkw.identify_mutated_tensors(kernel, args, {}))
    i8, qs = torch.empty(128, 192, dtype=torch.int8), torch.empty(192, dtype=f32)
    int8_tensors = dict(tensors, w0=i8, w1=i8, w2=i8, q0=qs, q1=qs, q2=qs)
    out["accesses"] = {
        "int8_direct": accesses(tg.rana_masked_gemv_int8, dict(int8_tensors, out_ptr=y, ws_ptr=ws, G=3, WORKSPACE=False,
                                                               **sizes)),
        "int8_workspace": accesses(tg.rana_masked_gemv_int8, dict(int8_tensors, out_ptr=y, ws_ptr=ws, G=3,
                                                                  WORKSPACE=True, **sizes)),
        "gemv_direct": accesses(tg.rana_masked_gemv, dict(tensors, out_ptr=y, ws_ptr=ws, G=3, WORKSPACE=False, **sizes)),
        "gemv_workspace": accesses(tg.rana_masked_gemv, dict(tensors, out_ptr=y, ws_ptr=ws, G=3, WORKSPACE=True, **sizes)),
        "reduce": accesses(tg.rana_gemv_reduce, dict(ws_ptr=ws, y_ptr=y, N=192, SPLIT=2, BLOCK=1024)),
        "dense": accesses(tg.rana_dense_gemv, dict(w0=w.t(), v0=v, w1=w.t(), v1=v, w2=w.t(), v2=v, out_ptr=y,
                                                   K0=128, K1=128, K2=128, N0=96, N1=96, N2=0, SW0=128, SW1=128,
                                                   SW2=128, NB0=12, NB1=12, G=2, BLOCK_R=8, BLOCK_K=512)),
    }
    out["reads_known"] = hasattr(tkw, "identify_accessed_tensors")
    print("RESULT " + json.dumps(out))
''')

BAD_KERNELS = textwrap.dedent(r'''
    import triton
    import triton.language as tl


    def build():
        @triton.jit
        def _helper(x):
            return x * 2

        @triton.jit
        def closure_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(y_ptr + offs, _helper(tl.load(x_ptr + offs)))

        return closure_kernel


    @triton.jit
    def reduce_in_loop(w_ptr, v_ptr, y_ptr, K, N, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(v_ptr + offs_k).to(tl.float32)
            w = tl.load(w_ptr + offs_k[:, None] * N + offs_n[None, :], eviction_policy="evict_first")
            acc += tl.sum(w.to(tl.float32) * v[:, None], axis=0)
        tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty))
''')


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("codegen")
    (tmp / "bad_kernels.py").write_text(BAD_KERNELS)
    (tmp / "run.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(tmp / "run.py"), str(REPO / "benchmarks"), str(tmp / "bad_kernels.py")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_inductor_regeneration_keeps_every_helper(compiled):
    assert compiled["sources"]["rana_masked_gemv"] == ["_kept_rows_dot", "_grouped", "_project", "_active"]
    assert compiled["sources"]["rana_gemv_reduce"] == []
    assert compiled["sources"]["rana_dense_gemv"] == ["_dense_rows"]
    assert compiled["sources"]["rana_masked_gemv_int8"] == ["_kept_rows_dot", "_grouped", "_project", "_active"]
    assert compiled["sources"]["rana_expert_masked_gemv"] == ["_kept_rows_dot", "_active"]


def test_every_specialization_compiles_for_sm90(compiled):
    rows = compiled["rows"]
    gemv = [r for r in rows if r["kernel"] == "rana_masked_gemv"]
    # every dtype, group size and mask mode a decode step launches, both store paths
    assert {r["dtype"] for r in gemv} == {"bfloat16", "float16", "float32"}
    assert {r["constexprs"]["G"] for r in gemv} == {1, 2, 3}
    assert {r["constexprs"]["MODE"] for r in gemv} >= {tg.MODE_IDS[m] for m in ("square", "abs_scaled", "abs")}
    assert {r["constexprs"]["WORKSPACE"] for r in gemv} == {True, False}
    assert any(r["kernel"] == "rana_gemv_reduce" for r in rows)
    dense = [r for r in rows if r["kernel"] == "rana_dense_gemv"]
    assert {(r["dtype"], r["constexprs"]["G"]) for r in dense} == {(d, g) for d in ("bfloat16", "float16", "float32")
                                                                   for g in (1, 2, 3)}
    # int8 weights: every activation dtype, group size and mode (incl. "none", the dense int8 GEMV), both store
    # paths, with the int8 config (more rows per step than the float kernels)
    int8 = [r for r in rows if r["kernel"] == "rana_masked_gemv_int8"]
    assert {r["dtype"] for r in int8} == {"bfloat16", "float16", "float32"}
    assert {r["constexprs"]["G"] for r in int8} == {1, 2, 3}
    assert {r["constexprs"]["MODE"] for r in int8} == set(tg.MODE_IDS.values())
    assert {r["constexprs"]["WORKSPACE"] for r in int8} == {True, False}
    assert {(r["constexprs"]["BLOCK_N"], r["constexprs"]["BLOCK_K"]) for r in int8} == {(tg.INT8_BLOCK_N,
                                                                                      tg.INT8_BLOCK_K)}
    # the expert-indexed MoE kernel: every activation dtype
    experts = [r for r in rows if r["kernel"] == "rana_expert_masked_gemv"]
    assert {r["dtype"] for r in experts} == {"bfloat16", "float16", "float32"}


def test_k_loop_streams(compiled):
    for r in compiled["rows"]:
        if r["kernel"] == "rana_gemv_reduce":
            continue
        where = f"{r['first_seen_in']}: {r['kernel']} {r['dtype']} {r['constexprs']} {r['num_warps']} warps"
        assert r["loops"] >= 1 and r["barriers_in_loop"] == 0, where
        assert r["weight_loads_in_loop"] > 0 and r["prefetched"], where
        assert r["weight_load_width"] == "v4", where  # 16-byte loads
        if r.get("registers") is not None:
            assert r["spill_bytes"] == 0 and r["registers"] <= 128, where


def test_negative_controls_fail_the_checks(compiled):
    assert compiled["closure_compiles"] is False and "_helper" in compiled["closure_error"]
    assert compiled["in_loop"]["barriers_in_loop"] > 0 and not compiled["in_loop"]["prefetched"]


# ---------------------------------------------------------------------------- the shipped config table
@pytest.fixture
def compiled_path_configs(monkeypatch):
    """choose_config as the compiled path on a GPU sees it (not the interpreter's fixed config), with the
    table restored afterwards."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    yield
    tg.set_config_table(None)


def test_choose_config_takes_the_table_entry_else_the_heuristic(compiled_path_configs):
    import torch

    cpu = torch.device("cpu")  # the table's GPU key for CPU tensors is "cpu"
    ks, ns = (4096, 4096, 4096), (4096, 1024, 1024)
    key = tg.table_key(ks, ns, torch.bfloat16, 2)
    tg.set_config_table({"gpus": {"cpu": {key: [32, 128, 4, 8]}}})
    cfg = tg.choose_config(ks, ns, torch.bfloat16, "abs", 2, cpu)
    assert (cfg.block_n, cfg.block_k, cfg.num_warps) == (32, 128, 8)
    # the split is re-derived for the exact shapes from the programs per SM it gave the bucket
    assert cfg.split == tg.split_for(ks, ns, 32, 128, 8, 4 * sum(-(-n // 32) for n in ns) / 8)
    # a rank in the same size class (bucketed K) takes the same entry; another sparsity bin does not
    assert tg.table_key((4000,) * 3, ns, torch.bfloat16, 2) == key
    assert tg.choose_config(ks, ns, torch.bfloat16, "abs", 3, cpu) == tg.heuristic_config(ks, ns, torch.bfloat16, cpu)
    tg.set_config_table({"gpus": {"another GPU": {key: [32, 128, 4, 8]}}})
    assert tg.choose_config(ks, ns, torch.bfloat16, "abs", 2, cpu) == tg.heuristic_config(ks, ns, torch.bfloat16, cpu)


def test_int8_weights_have_their_own_table_keys_and_heuristic(compiled_path_configs):
    import torch

    cpu = torch.device("cpu")
    ks, ns = (4096,), (14336,)
    key, key8 = tg.table_key(ks, ns, torch.bfloat16, 2), tg.table_key(ks, ns, torch.bfloat16, 2, torch.int8)
    assert key8 != key and "int8" in key8 and tg.table_key(ks, ns, torch.bfloat16, 2, torch.bfloat16) == key
    heuristic8 = tg.heuristic_config(ks, ns, torch.bfloat16, cpu, weight_dtype=torch.int8)
    assert (heuristic8.block_n, heuristic8.block_k) == (tg.INT8_BLOCK_N, tg.INT8_BLOCK_K)
    tg.set_config_table({"gpus": {"cpu": {key: [32, 128, 1, 8]}}})  # a float entry does not serve int8
    assert tg.choose_config(ks, ns, torch.bfloat16, "abs", 2, cpu, weight_dtype=torch.int8) == heuristic8
    tg.set_config_table({"gpus": {"cpu": {key8: [128, 256, 1, 8]}}})
    assert tg.choose_config(ks, ns, torch.bfloat16, "abs", 2, cpu, weight_dtype=torch.int8) == (128, 256, 1, 8)
    assert tg.choose_config(ks, ns, torch.bfloat16, "abs", 2, cpu) == tg.heuristic_config(ks, ns, torch.bfloat16, cpu)


def test_heuristic_fills_the_gpu_and_skips_the_split_when_outputs_do(compiled_path_configs):
    import torch

    cuda, sms = torch.device("cuda"), 132  # an H100 or H200
    for ks, ns in (((4096,), (4096,)), ((14336,), (4096,)), ((4096,) * 3, (4096, 1024, 1024)),
                   ((4096,) * 2, (14336, 14336)), ((4096,), (128256,))):
        cfg = tg.heuristic_config(ks, ns, torch.bfloat16, cuda, sms=sms)
        blocks = sum(-(-n // cfg.block_n) for n in ns)
        assert blocks * cfg.split >= 2 * sms  # at least two programs per SM
        assert (cfg.split == 1) == (blocks >= tg.FILLED * sms)  # no reduce launch once the outputs fill it


@pytest.fixture
def ptx_table(compiled_path_configs, monkeypatch):
    """benchmarks/ptx_table.py, imported in this process (the import drops TRITON_INTERPRET, which
    compiled_path_configs has set to 0 and puts back)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import ptx_table

    return ptx_table


def test_every_gpus_table_entries_are_compiled(ptx_table):
    """The PTX checks cover the configs of every GPU in the table, not one GPU's: an entry a model launch reaches
    (with the split re-derived as the launcher does), an entry of another size class (every mode, both store
    paths) and an int8 entry; the heuristic's configs stay checked beside them."""
    import torch

    from rana.kernels import gemv_tune

    qkv = gemv_tune.problems(gemv_tune.MODEL_SHAPES["llama-3-8b"])[0]
    reached = tg.table_key(qkv.ks, qkv.ns, torch.bfloat16, 2)
    elsewhere = "float16|s3|K181|N724|G2"  # no model launch of either shape falls in this size class
    int8 = tg.table_key(qkv.ks, qkv.ns, torch.float16, 1, torch.int8)
    table = {"gpus": {"NVIDIA H200": {reached: [128, 32, 3, 8], elsewhere: [16, 32, 2, 4]},
                      "NVIDIA H100 80GB HBM3": {reached: [32, 64, 1, 8], int8: [128, 64, 2, 8]}}}
    rows = ptx_table.all_variants(table)

    def launches(kernel, dtype, g, blocks):
        return [r for r in rows if (r["kernel"], r["dtype"], r["constexprs"].get("G")) == (kernel, dtype, g)
                and (r["constexprs"]["BLOCK_N"], r["constexprs"]["BLOCK_K"], r["num_warps"]) == blocks]

    h200 = launches("rana_masked_gemv", "bfloat16", 3, (128, 32, 8))
    assert h200 and {r["constexprs"]["WORKSPACE"] for r in h200} == {True}  # the tuned split survives for 4096
    assert {r["constexprs"]["B0"] for r in h200} == {False, True}  # q/k/v with and without biases
    assert launches("rana_masked_gemv", "bfloat16", 3, (32, 64, 8))  # the H100's entry for the same key
    other = launches("rana_masked_gemv", "float16", 2, (16, 32, 4))
    assert {r["constexprs"]["MODE"] for r in other} == set(tg.MODE_IDS.values())
    assert {r["constexprs"]["WORKSPACE"] for r in other} == {True, False}
    assert launches("rana_masked_gemv_int8", "float16", 3, (128, 64, 8))
    heuristic = tg.heuristic_config(qkv.ks, qkv.ns, torch.bfloat16, torch.device("cuda"), sms=ptx_table.SMS)
    assert launches("rana_masked_gemv", "bfloat16", 3, (heuristic.block_n, heuristic.block_k, heuristic.num_warps))
    # the shipped table's entries go the same way (all_variants() reads it); a key triton_gemv never makes is
    # an error, not an entry left unchecked
    assert ptx_table.table_gpus() == tg.read_table()["gpus"]
    with pytest.raises(ValueError, match="not a key"):
        ptx_table.all_variants({"gpus": {"NVIDIA H200": {"bfloat16|K4096": [64, 64, 1, 4]}}})


def test_exports_inline_the_table():
    from transformers import LlamaConfig, LlamaForCausalLM

    from rana.export.render import render_sources

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    source = render_sources(config, LlamaForCausalLM)["triton_gemv.py"]
    line = next(ln for ln in source.splitlines() if ln.startswith("SHIPPED_TABLE"))
    assert ast.literal_eval(line.split("=", 1)[1].strip()) == tg.read_table()


def test_inductor_sees_exactly_what_each_kernel_writes(compiled):
    """Inductor's mutation analysis of each kernel (falling back, it would treat every input as written and
    clone the weights on every step): only the output, or the workspace of a split launch, is written."""
    acc = compiled["accesses"]
    writes = {name: a[1] for name, a in acc.items()}
    assert writes == {"gemv_direct": ["out_ptr"], "gemv_workspace": ["ws_ptr"], "int8_direct": ["out_ptr"],
                      "int8_workspace": ["ws_ptr"], "reduce": ["y_ptr"], "dense": ["out_ptr"]}
    if compiled["reads_known"]:  # torch 2.13's identify_accessed_tensors; 2.11's analysis reports writes only
        assert {"w0", "w1", "w2", "v0", "t0", "b0"} <= set(acc["gemv_direct"][0])
        assert acc["reduce"][0] == ["ws_ptr"]
        assert {"w0", "w1", "v0", "v1"} <= set(acc["dense"][0])
        assert {"w0", "w1", "w2", "q0", "q1", "q2", "v0", "t0", "b0"} <= set(acc["int8_direct"][0])
    else:
        assert all(a[0] is None for a in acc.values())
