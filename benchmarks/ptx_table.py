"""What the compiler makes of the masked-GEMV kernels on an sm_90 GPU (H100, H200), without one.

For every kernel specialization the compiled decode path can launch (for the launches of Llama-2-7B-
and Llama-3-8B-shaped layers in bf16 / fp16 / fp32: the heuristic's configs on a 132-SM GPU, and the
configs of EVERY GPU in the shipped tuning table, each entry at least once), it regenerates the
kernel's source the way inductor does under torch.compile, compiles that source with Triton for
``GPUTarget("cuda", 90, 32)`` and reads the PTX:

* barriers (``bar.sync``) inside the K loop: a reduction or a shared-memory stage there costs a
  round trip per step and makes the loop latency-bound;
* weight loads in the loop, their width, and whether they are prefetched (the loop's weight-load
  registers are consumed in the next iteration, not the one that issues them);
* ``cp.async`` (Triton's shared-memory pipelining; this kernel pipelines in registers instead);
* registers and spills, from the bundled ``ptxas -v`` for sm_90a.

No GPU is needed. Writes benchmarks/results/ptx_sm90.md + .json.

    python benchmarks/ptx_table.py                 # every variant (about a minute)
    python benchmarks/ptx_table.py --out /tmp/p    # elsewhere
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for real: the interpreter's functions have no PTX

import torch  # noqa: E402

from rana.kernels import gemv_tune  # noqa: E402
from rana.kernels import triton_gemv as tg  # noqa: E402

# SMs of the GPUs we measure on (H100 and H200 alike): the heuristic's configs, and the splits the table's
# entries are re-derived into for exact shapes
SMS = 132
HEURISTIC = "(no table entry: the heuristic)"  # the config source of a GPU the table does not name
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_INT_ARGS_16 = ("K0", "K1", "K2", "N0", "N1", "N2", "SW0", "SW1", "SW2", "KC0", "KC1", "KC2", "n_total", "N",
                "K", "stride_e", "stride_w", "stride_v")  # the last four: the expert kernel's


# --------------------------------------------------------------------------------------------
# inductor's regeneration, and compilation for sm_90
# --------------------------------------------------------------------------------------------
def regenerated_source(kernel) -> str:
    """The kernel's source as inductor re-emits it into its output module (helpers it finds included)."""
    from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code

    return user_defined_triton_kernel_transitive_closure_source_code(kernel)


def regenerated_kernel(kernel):
    """Exec the regenerated source in a fresh module, as inductor's output module would: a helper
    reached any other way than by a global name is missing there and fails to compile."""
    import importlib.util

    import triton

    # a file of its own, as inductor writes its output module (triton.jit reads the source back)
    path = Path(tempfile.mkdtemp(prefix="rana-inductor-")) / f"regenerated_{kernel.__name__}.py"
    path.write_text("import triton\nimport triton.language as tl\n\n@triton.jit\n" + regenerated_source(kernel))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, kernel.__name__)
    assert isinstance(fn, triton.runtime.jit.JITFunction), type(fn)
    return fn


def _arg_type(kernel_name: str, name: str, ty: str) -> str:
    """The Triton type of one argument as the launcher passes it, activations of type `ty`."""
    if re.fullmatch(r"t\d|t_ptr|ws_ptr|q\d", name):  # thresholds, the split-K workspace, int8 weights' scales
        return "*fp32"
    if name == "idx_ptr":  # the expert kernel's expert indices
        return "*i64"
    if re.fullmatch(r"w\d", name) and kernel_name.endswith("_int8"):
        return "*i8"
    if re.fullmatch(r"[wvsb]\d|\w+_ptr", name):
        return "*" + ty
    return "i32"


def signature(kernel, dtype: torch.dtype, constexprs: dict) -> tuple[dict, dict]:
    """(signature, attrs) of a launch: tensors of `dtype` (thresholds, workspace and int8 scales fp32, int8
    weights for the int8 kernel, int64 expert indices), 32-bit ints, pointers and sizes 16-divisible as the
    launcher specializes them for aligned tensors."""
    ty = _TRITON_TYPES[dtype]
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        sig[name] = "constexpr" if name in constexprs else _arg_type(kernel.__name__, name, ty)
        if sig[name].startswith("*") or name in _INT_ARGS_16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_sm90(kernel, dtype: torch.dtype, constexprs: dict, num_warps: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = signature(kernel, dtype, constexprs)
    return triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps})


# --------------------------------------------------------------------------------------------
# reading the PTX
# --------------------------------------------------------------------------------------------
def _loops(lines: list[str]) -> list[tuple[int, int]]:
    """(first, last) line of every loop: a label with a branch back to it from below."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$L__BB\d+_\d+):", line))}
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if m and labels.get(m.group(1), i + 1) <= i:
            loops.append((labels[m.group(1)], i))
    return loops


def _regs(text: str) -> set[str]:
    return set(re.findall(r"%r[sd]?\d+", text))


def _operands(line: str) -> tuple[str, set[str], set[str]]:
    """(opcode, destination registers, source registers) of one PTX instruction line."""
    text = line.split("//")[0].strip().rstrip(";")
    if text.startswith("@"):
        text = text.split(None, 1)[1] if " " in text else ""
    parts = text.split(None, 1)
    if len(parts) < 2:
        return (parts[0] if parts else ""), set(), set()
    op, args = parts
    if args.startswith("{"):
        dest, rest = args[1:].split("}", 1)
    else:
        dest, _, rest = args.partition(",")
    return op, _regs(dest), _regs(rest)


def _consumed_in_same_iteration(lines: list[str], at: int, end: int) -> bool:
    """Whether what the load at line `at` wrote is computed with before the loop's back branch at `end`
    (moves and re-packing followed through: they only rename)."""
    _, tainted, _ = _operands(lines[at])
    for line in lines[at + 1: end + 1]:
        op, dests, sources = _operands(line)
        if not sources & tainted:
            continue
        if op.startswith("mov") or op.startswith("ld."):
            tainted |= dests
        else:
            return True
    return False


def ptx_stats(ptx: str) -> dict:
    """Barriers, loads and prefetching inside the K loop(s) of one kernel's PTX."""
    lines = ptx.splitlines()
    loops = _loops(lines)
    body = [lines[i] for lo, hi in loops for i in range(lo, hi + 1)]
    weight_loads = [(i, hi) for lo, hi in loops for i in range(lo, hi + 1)
                    if "ld.global" in lines[i] and "evict_first" in lines[i]]
    # prefetched: every weight load of an iteration feeds the next one (step i's weights are multiplied
    # while step i+1's are in flight), never the arithmetic of its own iteration
    prefetched = bool(weight_loads) and not any(_consumed_in_same_iteration(lines, i, hi) for i, hi in weight_loads)
    widths = sorted({m.group(1) for i, _ in weight_loads if (m := re.search(r"\.(v\d)\.", lines[i]))} or {"scalar"})
    return {"loops": len(loops), "barriers_in_loop": sum("bar.sync" in ln or "barrier" in ln for ln in body),
            "cp_async": ptx.count("cp.async."), "weight_loads_in_loop": len(weight_loads),
            "weight_load_width": ",".join(widths), "prefetched": prefetched,
            "shuffles_in_loop": sum("shfl" in ln for ln in body)}


def ptxas_resources(ptx: str) -> dict:
    """Registers and spill bytes from the bundled ptxas (sm_90a); empty when it cannot run here."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except Exception:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run([ptxas, "-v", "-arch=sm_90a", str(src), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill_st = re.search(r"(\d+) bytes spill stores", text)
    spill_ld = re.search(r"(\d+) bytes spill loads", text)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_bytes": (int(spill_st.group(1)) if spill_st else 0) + (int(spill_ld.group(1)) if spill_ld else 0)}


# --------------------------------------------------------------------------------------------
# the variants the compiled path can take
# --------------------------------------------------------------------------------------------
def table_gpus(table: dict | None = None) -> dict:
    """{GPU name: {table key: [BLOCK_N, BLOCK_K, SPLIT, warps]}} of `table` (None: the shipped one)."""
    table = tg.read_table() if table is None else table
    return {gpu: entries for gpu, entries in table.get("gpus", {}).items() if isinstance(entries, dict)}


@contextlib.contextmanager
def on_gpu(name: str, entries: dict):
    """triton_gemv.choose_config as it runs on a 132-SM GPU called `name` whose table entries are `entries`
    (yields that GPU as torch.device("cuda", 0)): the configs checked are the ones the launcher would pick,
    through its own code. Its per-device caches and table are restored afterwards."""
    saved = dict(tg._SM_COUNT), dict(tg._GPU_NAME), tg._CONFIG_TABLE.get("table")
    tg._SM_COUNT[0], tg._GPU_NAME[0] = SMS, name
    tg.set_config_table({"gpus": {name: entries}})
    try:
        yield torch.device("cuda", 0)
    finally:
        for cache, before in ((tg._SM_COUNT, saved[0]), (tg._GPU_NAME, saved[1])):
            cache.clear()
            cache.update(before)
        tg.set_config_table(None if saved[2] is None else {"gpus": saved[2]})


def config_sources(table: dict | None = None) -> dict:
    """Every GPU's table entries, plus a GPU the table does not name (every launch takes the heuristic)."""
    return {HEURISTIC: {}, **table_gpus(table)}


def _masked_variants(out, seen, kernel, dname, problem_name, ks, cfg, bias_flags, mode_id):
    """The masked kernel's specialization for one launch with `cfg`, and its reduce launch when it splits."""
    chunks = [-(-(-(-k // cfg.split)) // cfg.block_k) * cfg.block_k for k in ks]
    split = max(-(-k // c) for k, c in zip(ks, chunks))  # as triton_gemv._launch slices the inputs
    flags = list(bias_flags) + [False] * (3 - len(bias_flags))
    const = dict(G=len(ks), MODE=mode_id, B0=flags[0], B1=flags[1], B2=flags[2], WORKSPACE=split > 1,
                 BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    _add(out, seen, kernel, dname, const, cfg.num_warps, problem_name)
    if split > 1:
        _add(out, seen, "rana_gemv_reduce", dname, dict(SPLIT=split, BLOCK=tg._REDUCE_BLOCK), 4, problem_name)


def _model_launches():
    """(dtype name, dtype, problem, sparsity bin) of every masked launch of both model shapes' decode steps."""
    for dname, dtype in DTYPES.items():
        for shape in gemv_tune.MODEL_SHAPES.values():
            for p in gemv_tune.problems(shape):
                for sbin in (1, 2, 3, 4):
                    yield dname, dtype, p, sbin


def _launch_variants(out, seen, reached, gpu, entries, weight_dtype=None):
    """What the model launches take on one GPU; the table keys they reached go into `reached`."""
    kernel = "rana_masked_gemv_int8" if weight_dtype == torch.int8 else "rana_masked_gemv"
    suffix = "" if gpu == HEURISTIC else f" on {gpu}"
    with on_gpu(gpu, entries) as device:
        for dname, dtype, p, sbin in _model_launches():
            key = tg.table_key(p.ks, p.ns, dtype, sbin, weight_dtype)
            cfg = tg.choose_config(p.ks, p.ns, dtype, p.mode, sbin, device, weight_dtype=weight_dtype)
            if key in entries:
                reached.add((gpu, key))
            for bias in ((False, True) if p.name == "q/k/v" else (False,)):  # qwen2's q/k/v biases
                _masked_variants(out, seen, kernel, dname, p.name + suffix, p.ks, cfg, [bias] * len(p.ks),
                                 tg.MODE_IDS[p.mode])


_KEY = re.compile(r"(?P<dtype>[a-z0-9]+)(?:\.w-(?P<weights>[a-z0-9]+))?\|s\d+\|K(?P<k>\d+)\|N\d+\|G(?P<g>\d)")


def _entry_variants(out, seen, gpu, key, entry):
    """A table entry no model launch reaches (another model's size class): its config in every mask mode,
    with and without biases, through each store path its split can take."""
    m = _KEY.fullmatch(key)
    if m is None or m["dtype"] not in DTYPES or m["weights"] not in (None, "int8"):
        raise ValueError(f"table entry {key!r} of {gpu}: not a key triton_gemv.table_key makes")
    kernel = "rana_masked_gemv_int8" if m["weights"] == "int8" else "rana_masked_gemv"
    block_n, block_k, split, warps = entry
    g, k = int(m["g"]), int(m["k"])
    for cfg in {tg.GemvConfig(block_n, block_k, 1, warps), tg.GemvConfig(block_n, block_k, split, warps)}:
        for mode_id in sorted(tg.MODE_IDS.values()):
            for bias in (False, True):
                _masked_variants(out, seen, kernel, m["dtype"], f"{key} on {gpu}", (k,) * g, cfg, [bias] * g,
                                 mode_id)


def variants(table: dict | None = None, seen: set | None = None) -> list[dict]:
    """Distinct (kernel, dtype, constexprs, num_warps) of the float kernels over the decode launches of both
    model shapes, for the heuristic and for every GPU of `table` (None: the shipped one), every entry
    included; and the rank adapters' dense GEMV."""
    seen, out, reached = set() if seen is None else seen, [], set()
    sources = config_sources(table)
    for gpu, entries in sources.items():
        _launch_variants(out, seen, reached, gpu, entries)
    for dname, dtype in DTYPES.items():
        block_r, block_k, warps = tg.dense_rows_config(dtype)
        for g in (1, 2, 3):  # the rank adapters' codes: gate/up (2), a lone adapter or three siblings
            _add(out, seen, "rana_dense_gemv", dname, dict(G=g, BLOCK_R=block_r, BLOCK_K=block_k), warps,
                 "rank codes B x")
    _unreached_entries(out, seen, sources, reached, int8=False)
    return out


def int8_variants(table: dict | None = None, seen: set | None = None) -> list[dict]:
    """The int8-weight kernel's specializations: the model launches with int8 weights (the table's int8 entries
    of every GPU, else the int8 heuristic), and the dense int8 GEMV (mode "none") of a dense layer."""
    seen, out, reached = set() if seen is None else seen, [], set()
    sources = config_sources(table)
    for gpu, entries in sources.items():
        _launch_variants(out, seen, reached, gpu, entries, weight_dtype=torch.int8)
    with on_gpu(HEURISTIC, {}) as device:
        for dname, dtype in DTYPES.items():
            cfg = tg.heuristic_config((4096,), (4096,), dtype, device, weight_dtype=torch.int8)
            _masked_variants(out, seen, "rana_masked_gemv_int8", dname, "dense int8", (4096,), cfg, [False],
                             tg.MODE_IDS["none"])
    _unreached_entries(out, seen, sources, reached, int8=True)
    return out


def _unreached_entries(out, seen, sources, reached, int8: bool):
    for gpu, entries in sources.items():
        for key, entry in sorted(entries.items()):
            if (".w-" in key) == int8 and (gpu, key) not in reached:
                _entry_variants(out, seen, gpu, key, entry)


# the expert-indexed kernel of a mixture of experts: Mixtral-8x7B's gate/up and down shapes
EXPERT_SHAPES = ((4096, 28672), (14336, 4096))


def expert_variants(seen: set | None = None) -> list[dict]:
    """The expert kernel's specializations (it always takes the heuristic's blocks)."""
    seen, out = set() if seen is None else seen, []
    with on_gpu(HEURISTIC, {}) as device:
        for dname, dtype in DTYPES.items():
            for k, n in EXPERT_SHAPES:
                cfg = tg.heuristic_config((k,), (n,), dtype, device)
                _add(out, seen, "rana_expert_masked_gemv", dname, dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k),
                     cfg.num_warps, f"experts {k}x{n}")
    return out


def all_variants(table: dict | None = None) -> list[dict]:
    """Every specialization of every kernel the compiled decode path launches (float, int8, experts)."""
    seen: set = set()
    return variants(table, seen) + int8_variants(table, seen) + expert_variants(seen)


def _add(out, seen, kernel, dname, const, warps, problem):
    key = (kernel, dname, tuple(sorted(const.items())), warps)
    if key not in seen:
        seen.add(key)
        out.append({"kernel": kernel, "dtype": dname, "constexprs": const, "num_warps": warps, "first_seen_in": problem})


def analyse(variant: dict, kernels: dict) -> dict:
    compiled = compile_sm90(kernels[variant["kernel"]], DTYPES[variant["dtype"]], variant["constexprs"],
                           variant["num_warps"])
    ptx = compiled.asm["ptx"]
    return {**variant, **ptx_stats(ptx), **ptxas_resources(ptx)}


def markdown(rows: list[dict], versions: str = "") -> str:
    lines = [f"# Masked-GEMV kernels compiled for sm_90 (PTX read without a GPU{', ' + versions if versions else ''})", "",
             "Every specialization the compiled decode path can launch on an sm_90 GPU (the heuristic on 132 SMs, and "
             "every GPU's entries of the shipped table) "
             "for Llama-2-7B/Llama-3-8B-shaped launches, regenerated the way inductor does and compiled with "
             "Triton for `GPUTarget(\"cuda\", 90, 32)`. Generated by `python benchmarks/ptx_table.py`.", "",
             "| kernel | dtype | G | mode | bias | workspace | BLOCK_N | BLOCK_K / SPLIT | warps | barriers in K loop "
             "| weight loads in loop | width | prefetched | cp.async | registers | spill bytes | first seen in |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    modes = {v: k for k, v in tg.MODE_IDS.items()}
    for r in rows:
        c = r["constexprs"]
        if r["kernel"] == "rana_masked_gemv":
            cells = [c["G"], modes[c["MODE"]], "yes" if c["B0"] else "no", "yes" if c["WORKSPACE"] else "no",
                     c["BLOCK_N"], c["BLOCK_K"]]
        elif r["kernel"] == "rana_dense_gemv":
            cells = [c["G"], "dense rows", "no", "no", f"{c['BLOCK_R']} rows", c["BLOCK_K"]]
        else:
            cells = ["", "", "", "", c["BLOCK"], f"SPLIT={c['SPLIT']}"]
        lines.append("| " + " | ".join(str(x) for x in [r["kernel"], r["dtype"], *cells, r["num_warps"],
                                                          r["barriers_in_loop"], r["weight_loads_in_loop"],
                                                          r["weight_load_width"], "yes" if r["prefetched"] else "no",
                                                          r["cp_async"], r.get("registers"), r.get("spill_bytes"),
                                                          r["first_seen_in"]]) + " |")
    gemv = [r for r in rows if r["kernel"] != "rana_gemv_reduce"]
    lines += ["", f"{len(gemv)} GEMV specializations (masked and dense-rows): barriers inside the K loop in "
              f"{sum(r['barriers_in_loop'] > 0 for r in gemv)}, weight loads not prefetched in "
              f"{sum(not r['prefetched'] for r in gemv)}, spills in {sum(bool(r.get('spill_bytes')) for r in gemv)}.",
              "(The reduce kernel has no weight loads: its loop is the static sum over SPLIT slots.)"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "ptx_sm90")
    args = p.parse_args(argv)
    if not tg.triton_available():
        p.error("triton is not installed")
    kernels = {k.__name__: regenerated_kernel(k) for k in tg.kernels()}
    rows = []
    for i, v in enumerate(variants()):
        rows.append(analyse(v, kernels))
        print(f"[{i + 1}] {v['kernel']} {v['dtype']} {v['constexprs']}: barriers {rows[-1]['barriers_in_loop']}, "
              f"prefetched {rows[-1]['prefetched']}, regs {rows[-1].get('registers')}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    import triton

    versions = f"triton {triton.__version__}, torch {torch.__version__}"
    args.out.with_suffix(".json").write_text(json.dumps({"target": "cuda sm_90", "versions": versions, "rows": rows},
                                                        indent=1))
    args.out.with_suffix(".md").write_text(markdown(rows, versions))
    print(markdown(rows, versions))


if __name__ == "__main__":
    sys.exit(main())
