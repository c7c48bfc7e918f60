"""Where a batch-1 CPU decode step's time goes: per-component µs per token, dense vs rana folders.

    python benchmarks/bench_decode_profile.py DIR [DIR ...] [--threads 1] [--tokens 32] [--rounds 3]
    python benchmarks/bench_decode_profile.py /tmp/prof/f058 /tmp/prof/f058_int8 --threads 2

Every model (the dense base of the first folder, then each folder) decodes the same greedy tokens with
a plain loop (`model(token, past_key_values=cache, logits_to_keep=1)`, DynamicCache; no `generate`
bookkeeping), rounds interleaved so that drift hits all alike. Two kinds of rounds:

1. plain: nothing patched; the median seconds per decode step (the number to compare; ratio to dense);
2. instrumented: thin wrappers accumulate wall time per component (each wrapper costs ~0.3 µs, so the
   instrumented step is a little slower than the plain one):
   - kernel: inside the native C calls (fp32 masked GEMV, int8 masked / dense GEMV),
   - blas: inside `torch.nn.functional.linear` (dense GEMVs: rank codes `B x`, the dense branch, dense layers),
   - adapters: inside the top-level forward of every adapter module (rana.modules.MacMeter subclasses,
     RankSliceLinear) and Int8Linear; "adapter Python" = that minus its kernel and blas time,
   - head: inside the LM head's forward (kernel / blas / Python split likewise),
   - rest: the step minus adapters and head (attention, norms, rotary, embedding, HF Python).

Also printed: Python function calls per token (cProfile, top rana functions) and torch ops per token
(torch.profiler). Times are per decoded token.
"""
from __future__ import annotations

import argparse
import cProfile
import collections
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


# ------------------------------------------------------------------------------------ decoding
def decode_loop(model, ids: torch.Tensor, tokens: int, after_prefill=None) -> tuple[float, list[int]]:
    """(seconds of the `tokens` decode steps after the prefill, the greedy tokens). `after_prefill()` runs
    between the prefill and the timed steps (the probe forgets the prefill's time there)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        generated = [int(tok)]
        if after_prefill is not None:
            after_prefill()
        t0 = time.perf_counter()
        for _ in range(tokens):
            out = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            generated.append(int(tok))
        return time.perf_counter() - t0, generated


# ------------------------------------------------------------------------------------ instrumentation
class Probe:
    """Wall time per (region, category); region is 'adapter', 'head' or 'rest' (outside both)."""

    def __init__(self):
        self.acc: dict[tuple[str, str], int] = collections.defaultdict(int)
        self.region = "rest"
        self.undo: list = []
        self.model = None

    def _timed(self, fn, category):
        acc, clock = self.acc, time.perf_counter_ns
        probe = self

        def wrapper(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[(probe.region, category)] += clock() - t0
        return wrapper

    def _region(self, fn, region):
        acc, clock = self.acc, time.perf_counter_ns
        probe = self

        def wrapper(*args, **kwargs):
            if probe.region != "rest":  # nested (a group member, an Int8Linear child): count once
                return fn(*args, **kwargs)
            probe.region = region
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[(region, "total")] += clock() - t0
                probe.region = "rest"
        return wrapper

    def _patch(self, owner, name, value):
        self.undo.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, value)

    def install(self, model) -> None:
        import torch.nn.functional as F

        from rana.kernels import cpu_gemv
        from rana.modules import MacMeter, RankSliceLinear
        from rana.modules.int8 import Int8Linear

        lib, status = cpu_gemv._load()
        if lib is not None:
            timed = lib._replace(**{name: self._timed(getattr(lib, name), "kernel")
                                    for name in ("masked_f32", "masked_i8", "masked_a8", "expert")})
            self._patch(cpu_gemv, "_load", lambda: (timed, status))
        unbind(model)  # calls bound before were bound to the kernels themselves
        self.model = model
        self._patch(F, "linear", self._timed(F.linear, "blas"))
        head = model.get_output_embeddings()
        classes = {type(m) for m in model.modules() if isinstance(m, (MacMeter, RankSliceLinear, Int8Linear))}
        for cls in classes:
            if cls is type(head):
                continue
            self._patch(cls, "forward", self._region(cls.forward, "adapter"))
        # the head: an instance attribute (its class may also serve elsewhere)
        head.forward = self._region(head.forward, "head")
        self.undo.append((head, "forward", _INSTANCE))

    def remove(self) -> None:
        for owner, name, old in reversed(self.undo):
            if old is _INSTANCE:
                del owner.__dict__[name]
            elif old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self.undo.clear()
        if self.model is not None:
            unbind(self.model)  # calls bound while patched would keep the patched kernels
            self.model = None

    def breakdown(self, step_ns: int, tokens: int) -> dict[str, float]:
        a = self.acc
        us = lambda ns: ns / tokens / 1e3  # noqa: E731
        out = {}
        for region in ("adapter", "head"):
            total = a[(region, "total")]
            out[f"{region} kernel"] = us(a[(region, "kernel")])
            out[f"{region} blas"] = us(a[(region, "blas")])
            out[f"{region} python"] = us(total - a[(region, "kernel")] - a[(region, "blas")])
            out[f"{region} total"] = us(total)
        rest = step_ns - a[("adapter", "total")] - a[("head", "total")]
        out["rest kernel+blas"] = us(a[("rest", "kernel")] + a[("rest", "blas")])
        out["rest other (attention, norms, HF)"] = us(rest - a[("rest", "kernel")] - a[("rest", "blas")])
        out["step"] = us(step_ns)
        return out


_MISSING, _INSTANCE = object(), object()


def opaque_zeros():
    """`rana_bench::zeros(x, n)`: zeros of shape x.shape[:-1] + (n,), as a registered op (defined once per process)
    that a compiled graph keeps, with its input, as it keeps rana's own ops."""
    import torch

    try:
        return torch.ops.rana_bench.zeros
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("rana_bench", "DEF")
    lib.define("zeros(Tensor x, int n) -> Tensor")
    lib.impl("zeros", lambda x, n: x.new_zeros(*x.shape[:-1], n), "CompositeExplicitAutograd")
    torch.library.register_fake("rana_bench::zeros", lambda x, n: x.new_empty(*x.shape[:-1], n), lib=lib)
    _LIBRARIES.append(lib)  # a Library's definitions live as long as the object
    return torch.ops.rana_bench.zeros


_LIBRARIES: list = []


def unbind(model) -> None:
    """Drop every module's decode operands and so their bound native calls (rana.kernels.cpu_gemv.NativeCall):
    the next token binds to whatever kernel entry points are current (patched or restored)."""
    from rana.modules.operands import drop_operands
    for m in model.modules():
        drop_operands(m)


# ------------------------------------------------------------------------------------ floors
class Floor:
    """A decode step with part of the work taken away, to see what the rest costs:

    - "kernels as no-ops": every native C call (fp32 and int8 masked GEMV) returns at once after zeroing its
      output (ctypes.memset, ~0.5 µs), as if nothing were active; the Python around the calls, the ctypes
      call itself and everything outside the adapters still run. step − this = the kernels' own time.
    - "adapters and head return zeros": every adapter, Int8Linear and the LM head return a zero tensor of
      their output shape; what is left is transformers' own step (attention, norms, rotary, the cache, its
      Python): the floor no kernel can remove in the eager `generate` harness.
    Outputs are zeros, so tokens are meaningless; the step's shapes (and so its work) are not.

    `opaque` (for a compiled step): the zeros come from a registered op (`rana_bench::zeros`) that inductor cannot
    see into. Plain zeros would let it prove every attention output unused and delete the attention.
    """

    def __init__(self, kind: str, opaque: bool = False):
        self.kind, self.undo, self.opaque = kind, [], opaque

    def install(self, model) -> None:
        import ctypes

        from rana.kernels import cpu_gemv
        from rana.modules import MacMeter, RankSliceLinear
        from rana.modules.int8 import Int8Linear

        if self.kind == "kernels":
            lib, status = cpu_gemv._load()
            memset = ctypes.memset

            def masked_f32(operands, x, t, y, limit, xm, threads):
                memset(y, 0, cpu_gemv._Operands.from_address(operands).N * 4)
                return 0

            def masked_i8(operands, x, t, y, threads):
                memset(y, 0, cpu_gemv._Operands.from_address(operands).N * 4)
                return 0

            def expert(w, x, experts, t, S, K, N, lde, ldw, ldx, y, threads):
                memset(y, 0, S * N * 4)
                return 0
            if lib is not None:
                self._patch(cpu_gemv, "_load", lambda: (lib._replace(masked_f32=masked_f32, masked_i8=masked_i8,
                                                                     masked_a8=masked_i8, expert=expert), status))
                unbind(model)
                self.model = model
            return
        head = model.get_output_embeddings()
        zeros = opaque_zeros() if self.opaque else (lambda x, n: x.new_zeros(*x.shape[:-1], n))
        for m in model.modules():
            if isinstance(m, (MacMeter, RankSliceLinear, Int8Linear)) or m is head:
                n = m.out_features if hasattr(m, "out_features") else m.weight.shape[0]
                m.forward = (lambda n: lambda x, *args, **kw: zeros(x, n))(n)
                self.undo.append((m, "forward", _INSTANCE))

    def _patch(self, owner, name, value):
        self.undo.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, value)

    model = None
    remove = Probe.remove


def op_counts(model, ids, tokens: int = 4) -> tuple[float, list[tuple[str, int]]]:
    """(aten ops per decode token, the most frequent ones per token)."""
    from torch.profiler import ProfilerActivity, profile

    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(tokens):
                out = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
    counts = collections.Counter()
    for e in prof.events():
        if e.name.startswith("aten::"):
            counts[e.name] += 1
    total = sum(counts.values()) / tokens
    return total, [(n, c // tokens) for n, c in counts.most_common(8)]


def python_calls(model, ids, tokens: int = 8) -> tuple[float, list[tuple[str, float]]]:
    """(Python function calls per decode token, the rana/kernels functions with the most calls per token)."""
    prof = cProfile.Profile()
    prof.enable()
    decode_loop(model, ids, tokens)
    prof.disable()
    stats = pstats.Stats(prof).stats
    total = sum(v[1] for v in stats.values())
    ours = [(f"{Path(k[0]).name}:{k[2]}", v[1]) for k, v in stats.items()
            if "/rana/" in k[0] or "/kernels/" in k[0]]
    ours.sort(key=lambda x: -x[1])
    return total / (tokens + 1), [(n, c / (tokens + 1)) for n, c in ours[:8]]


# ------------------------------------------------------------------------------------ main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", help="rana folders (fp32 and/or int8)")
    p.add_argument("--dense", default=None, help="dense reference (default: the first folder's base model)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-counts", action="store_true", help="skip the op / call counts")
    p.add_argument("--floors", action="store_true",
                   help="also time each folder's step with the native kernels as no-ops and with every adapter "
                        "and the head returning zeros (what the kernels, rana's Python and transformers' own step "
                        "cost; interleaved with the plain rounds)")
    return p.parse_args(argv)


def load_models(a):
    """({"dense": the dense reference, then each folder by name}, the folders' tokenizer)."""
    from transformers.utils import logging as hf_logging

    from rana import io as rio
    from rana.io.models import load_model

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    models = {}
    tokenizer = None
    for folder in a.folders:
        model, tokenizer = rio.load(folder)
        models[Path(folder).name] = model.eval()
    dense_ref = a.dense
    if dense_ref is None:
        import json
        cfg = json.loads((Path(a.folders[0]) / "rana_config.json").read_text())
        dense_ref = cfg.get("base_model") or cfg.get("model") or "smollm2-135m"
    try:
        dense, _, _ = load_model(dense_ref)
    except Exception:  # noqa: BLE001
        dense, _, _ = load_model("smollm2-135m")
    return {"dense": dense.eval(), **models}, tokenizer


def measure(models: dict, ids: torch.Tensor, a):
    """Warm-up, then `a.rounds` rounds, each: every model plain, each floor, every model instrumented.
    Returns (plain seconds per token, probe breakdowns, floor seconds per token, greedy tokens), by model."""
    for m in models.values():  # warm-up (builds the kernel, first-touch of the weights)
        decode_loop(m, ids, 4)
    plain = {n: [] for n in models}
    probes = {n: [] for n in models}
    floors = {(n, kind): [] for n in models if n != "dense" for kind in ("kernels", "zeros")} if a.floors else {}
    tokens_out = {}
    for _ in range(a.rounds):
        for name, m in models.items():
            seconds, toks = decode_loop(m, ids, a.tokens)
            plain[name].append(seconds / a.tokens)
            tokens_out[name] = toks
        for (name, kind), times in floors.items():
            floor = Floor(kind)
            floor.install(models[name])
            try:
                times.append(decode_loop(models[name], ids, a.tokens)[0] / a.tokens)
            finally:
                floor.remove()
        for name, m in models.items():
            probe = Probe()
            probe.install(m)
            try:
                seconds, _ = decode_loop(m, ids, a.tokens, after_prefill=probe.acc.clear)
            finally:
                probe.remove()
            probes[name].append(probe.breakdown(int(seconds * 1e9), a.tokens))
    return plain, probes, floors, tokens_out


def print_plain(models: dict, plain: dict, tokens_out: dict) -> None:
    dense_s = statistics.median(plain["dense"])
    print("\n## plain decode step (median over rounds)\n")
    print("| model | ms / token | ratio to dense | same tokens as dense |")
    print("|---|---|---|---|")
    for name in models:
        s = statistics.median(plain[name])
        same = sum(x == y for x, y in zip(tokens_out[name], tokens_out["dense"]))
        print(f"| {name} | {s * 1e3:.2f} | {s / dense_s:.3f} | {same}/{len(tokens_out['dense'])} |")


def print_floors(models: dict, plain: dict, floors: dict) -> None:
    print("\n## floors: ms per token with work taken away (median over rounds; see Floor)\n")
    print("| model | step | kernels as no-ops | adapters and head return zeros | kernels' own time | "
          "rana Python + ctypes | transformers' step |")
    print("|---|---|---|---|---|---|---|")
    for name in models:
        if name == "dense":
            continue
        step = statistics.median(plain[name])
        no_kernels = statistics.median(floors[(name, "kernels")])
        zeros = statistics.median(floors[(name, "zeros")])
        cells = [step, no_kernels, zeros, step - no_kernels, no_kernels - zeros, zeros]
        print(f"| {name} | " + " | ".join(f"{c * 1e3:.2f}" for c in cells) + " |")


def print_components(models: dict, probes: dict) -> None:
    print("\n## instrumented: µs per token by component (median over rounds)\n")
    keys = list(probes["dense"][0])
    print("| component | " + " | ".join(models) + " |")
    print("|---|" + "---|" * len(models))
    for k in keys:
        row = [statistics.median(r[k] for r in probes[n]) for n in models]
        print(f"| {k} | " + " | ".join(f"{v:.0f}" for v in row) + " |")


def print_counts(models: dict, ids: torch.Tensor) -> None:
    print("\n## per token: Python calls (cProfile) and torch ops (torch.profiler)\n")
    for name, m in models.items():
        calls, top = python_calls(m, ids)
        ops, top_ops = op_counts(m, ids)
        print(f"- {name}: {calls:.0f} Python calls, {ops:.0f} aten ops per token")
        print("  - top rana calls: " + ", ".join(f"{n} {c:.0f}" for n, c in top))
        print("  - top ops: " + ", ".join(f"{n} {c}" for n, c in top_ops))


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)

    from rana.kernels.cpu_gemv import native_status

    models, tokenizer = load_models(a)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    print(f"threads {a.threads}, {native_status()}, {a.tokens} decode tokens after a {ids.shape[1]}-token prompt, "
          f"{a.rounds} rounds interleaved", flush=True)

    plain, probes, floors, tokens_out = measure(models, ids, a)
    print_plain(models, plain, tokens_out)
    if floors:
        print_floors(models, plain, floors)
    print_components(models, probes)
    if not a.no_counts:
        print_counts(models, ids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
