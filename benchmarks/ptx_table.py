"""What the compiler makes of the masked-GEMV kernels on an H100, without an H100.

For every kernel specialization the compiled decode path can launch on an H100 (the shipped tuning
table's configs, else the heuristic's, for the launches of Llama-2-7B- and Llama-3-8B-shaped layers
in bf16 / fp16 / fp32), it regenerates the kernel's source the way inductor does under
torch.compile, compiles that source with Triton for ``GPUTarget("cuda", 90, 32)`` and reads the PTX:

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

H100 = ("NVIDIA H100 80GB HBM3", 132)  # the table's GPU name and SM count of the machine we measure on
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_INT_ARGS_16 = ("K0", "K1", "K2", "N0", "N1", "N2", "SW0", "SW1", "SW2", "KC0", "KC1", "KC2", "n_total", "N")


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


def signature(kernel, dtype: torch.dtype, constexprs: dict) -> tuple[dict, dict]:
    """(signature, attrs) of a launch: tensors of `dtype` (thresholds and workspace fp32), 32-bit ints,
    pointers and sizes 16-divisible as the launcher specializes them for aligned tensors."""
    ty = _TRITON_TYPES[dtype]
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif re.fullmatch(r"t\d|ws_ptr", name):  # thresholds and the split-K workspace
            sig[name] = "*fp32"
        elif re.fullmatch(r"[wvsb]\d|\w+_ptr", name):
            sig[name] = "*" + ty
        else:
            sig[name] = "i32"
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
def _config_on_h100(ks, ns, dtype, sbin) -> tg.GemvConfig:
    entry = tg.read_table().get("gpus", {}).get(H100[0], {}).get(tg.table_key(ks, ns, dtype, sbin))
    if entry:
        return tg.GemvConfig(*entry)
    return tg.heuristic_config(ks, ns, dtype, torch.device("cuda"), sms=H100[1])


def variants() -> list[dict]:
    """Distinct (kernel, dtype, constexprs, num_warps) over the decode launches of both model shapes."""
    seen, out = set(), []
    for dname, dtype in DTYPES.items():
        for shape in gemv_tune.MODEL_SHAPES.values():
            for p in gemv_tune.problems(shape):
                for sbin in (1, 2, 3, 4):
                    cfg = _config_on_h100(p.ks, p.ns, dtype, sbin)
                    chunks = [-(-(-(-k // cfg.split)) // cfg.block_k) * cfg.block_k for k in p.ks]
                    split = max(-(-k // c) for k, c in zip(p.ks, chunks))
                    for bias in ((False, True) if p.name == "q/k/v" else (False,)):  # qwen2's q/k/v biases
                        flags = [bias] * len(p.ks) + [False] * (3 - len(p.ks))
                        const = dict(G=len(p.ks), MODE=tg.MODE_IDS[p.mode], B0=flags[0], B1=flags[1], B2=flags[2],
                                     WORKSPACE=split > 1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
                        _add(out, seen, "rana_masked_gemv", dname, const, cfg.num_warps, p.name)
                    if split > 1:
                        _add(out, seen, "rana_gemv_reduce", dname, dict(SPLIT=split, BLOCK=tg._REDUCE_BLOCK), 4, p.name)
        block_r, block_k, warps = tg.dense_rows_config(dtype)
        for g in (1, 2, 3):  # the rank adapters' codes: gate/up (2), a lone adapter or three siblings
            _add(out, seen, "rana_dense_gemv", dname, dict(G=g, BLOCK_R=block_r, BLOCK_K=block_k), warps,
                 "rank codes B x")
    return out


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
             "Every specialization the compiled decode path can launch on an H100 (shipped table, else heuristic) "
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
