"""`rana sweep`: compress one model with several methods at several FLOP budgets, evaluate each
point (perplexity on several texts, FLOPs measured on those tokens) next to the dense model,
and write `results.json`, `results.md` and the paper-style figures.

The dense model is loaded once and deep-copied for every point; calibration data is computed
once and shared. Each finished point is saved to `OUT/points/<method>_<flops>.json` (with its
plan as `<method>_<flops>.plan.json`); a re-run with the same settings skips finished points.
"""
from __future__ import annotations

import copy
import gc
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..checks import check_inputs
from ..compress import BudgetError, calibration_data, compress_model
from ..data import check_source
from ..evaluation import evaluate_model, ppl_protocol, rank_adapters, rank_contributions, text_labels
from ..evaluation.perplexity import protocol_tokens
from ..io import save
from ..io.format import write_json
from ..io.models import load_model, model_inputs, resolve
from ..io.paths import SWEEP_KIND, check_output, claim_folder, local_inputs
from ..units import Progress
from .config import SweepConfig
from .report import DENSE, describe_point, layer_summary, point_name, write_outputs

Log = Callable[[str], None]


def _read_point(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class Sweep:
    """One sweep run; `run()` does the pending points and writes the outputs."""

    def __init__(self, config: SweepConfig, *, progress: Progress | None = None, log: Log | None = None):
        config.validate()
        self.cfg = config
        self.progress = progress or (lambda *a: None)
        self.log = log or (lambda msg: None)
        self.out = config.out
        self.points_dir = self.out / "points"
        self._model = self._tokenizer = None
        self._calibration = None
        self._tokens: dict[str, torch.Tensor] | None = None
        self.texts = text_labels(self.cfg.ppl_data)

    # ------------------------------------------------------------------ lazy shared state

    def model(self):
        if self._model is None:
            self.log(f"loading {self.cfg.model}")
            self._model, self._tokenizer, _ = load_model(self.cfg.model, dtype=self.cfg.dtype, device=self.cfg.device)
        return self._model, self._tokenizer

    def tokens(self) -> dict[str, torch.Tensor]:
        if self._tokens is None:
            _, tok = self.model()
            protocol = self.cfg.eval_protocol()
            self._tokens = {name: protocol_tokens(src, tok, protocol, max_tokens=self.cfg.eval_tokens,
                                                  text_column=self.cfg.text_column)
                            for name, src in zip(self.texts, self.cfg.ppl_data)}
        return self._tokens

    def calibration(self):
        if self._calibration is None:
            _, tok = self.model()
            self._calibration = calibration_data(self.cfg.compress_config("rana", 1.0), tok)
        return self._calibration

    # ------------------------------------------------------------------ points

    def planned(self) -> list[tuple[str, float | None]]:
        pts: list[tuple[str, float | None]] = [(DENSE, None)] if self.cfg.dense else []
        return pts + [(m, f) for m in self.cfg.methods for f in self.cfg.flops]

    def _path(self, method: str, flops: float | None) -> Path:
        return self.points_dir / f"{point_name(method, flops)}.json"

    def _done(self, method: str, flops: float | None) -> dict | None:
        p = _read_point(self._path(method, flops))
        if p is None:
            return None
        same = p.get("eval_settings") == json.loads(json.dumps(self.cfg.eval_settings()))
        if method != DENSE:
            same = same and p.get("compress_settings") == json.loads(json.dumps(self.cfg.compress_settings(method)))
        if not same:
            self.log(f"{point_name(method, flops)}: stored point has other settings; redoing it")
            return None
        return p

    def _evaluate(self, model) -> dict:
        _, tok = self.model()
        return evaluate_model(model, tok, self.cfg.eval_config(self.tokens()), progress=self.progress)

    def _run_dense(self) -> dict:
        model, _ = self.model()
        t0 = time.perf_counter()
        r = self._evaluate(model)
        return {"method": DENSE, "target_flops": 1.0, "status": "ok", "ppl": r["ppl"], "flops": r["flops"],
                "eval_wall_time_s": time.perf_counter() - t0}

    def _run_point(self, method: str, flops: float) -> dict:
        dense, tok = self.model()
        calibration = self.calibration()
        config = self.cfg.compress_config(method, flops)
        model = copy.deepcopy(dense)
        try:
            try:
                result = compress_model(model, tok, config, calibration,
                                        progress=lambda what, d, t: self.progress(f"compress {what}", d, t))
            except BudgetError as e:
                return {"method": method, "target_flops": flops, "status": "infeasible", "error": str(e)}
            plan = result.plan
            plan["model"] = self.cfg.model
            name = point_name(method, flops)
            write_json(self.points_dir / f"{name}.plan.json", plan)
            if self.cfg.save_models:
                save(result.model, tok, self.out / "models" / name, plan=plan, overwrite=True, offloaded=result.offloaded,
                     extra={"method": method, "compress_config": config.to_dict()})
            t0 = time.perf_counter()
            r = self._evaluate(result.model)
            hist = None
            if rank_adapters(result.model):
                first = next(iter(self.tokens().values()))
                hist = rank_contributions(result.model, first, seq_len=self.cfg.seq_len,
                                          batch_size=self.cfg.eval_batch_size, max_tokens=self.cfg.histogram_tokens)
            return {
                "method": method, "target_flops": flops, "status": "ok", "ppl": r["ppl"], "flops": r["flops"],
                "heldout_flops": plan["measured_flops"], "heldout_measured_on": plan["measured_on"],
                "plan_adapted_fraction": plan.get("adapted_fraction"), "plan_file": f"points/{name}.plan.json",
                "compress_wall_time_s": plan.get("wall_time_s"), "eval_wall_time_s": time.perf_counter() - t0,
                "layers": layer_summary(plan), "rank_contributions": hist,
            }
        finally:
            del model
            gc.collect()

    def run(self) -> dict:
        claim_folder(self.out, SWEEP_KIND)  # marks it as a sweep's: only such a folder is resumed into
        self.points_dir.mkdir(parents=True, exist_ok=True)
        planned = self.planned()
        points, done = [], 0
        self.progress("points", 0, len(planned))
        for method, flops in planned:
            name = point_name(method, flops)
            point = self._done(method, flops)
            if point is not None:
                self.log(f"{name}: done before, skipped")
            else:
                self.log(f"{name}: {'evaluating' if method == DENSE else 'compressing'}")
                point = self._run_dense() if method == DENSE else self._run_point(method, flops)
                point["eval_settings"] = self.cfg.eval_settings()
                if method != DENSE:
                    point["compress_settings"] = self.cfg.compress_settings(method)
                write_json(self._path(method, flops), point)
                self.log(describe_point(point, self.texts))
            points.append(point)
            gc.collect()  # the point's compressed copy is gone; free it before the next deep copy
            done += 1
            self.progress("points", done, len(planned))
        results = self.results(points)
        write_outputs(results, self.out)
        return results

    def results(self, points: list[dict]) -> dict:
        cfg = self.cfg
        tokens: dict[str, int] = {}  # tokens scored per text (whole windows)
        for p in points:
            for n, r in (p.get("ppl") or {}).items():
                tokens.setdefault(n, r.get("windows", 0) * r.get("seq_len", cfg.seq_len))
        return {
            "model": cfg.model,
            "config": cfg.to_dict(),
            "texts": self.texts,
            "text_sources": dict(zip(self.texts, cfg.ppl_data)),
            "eval_tokens_used": tokens,
            "protocol": ppl_protocol(cfg.eval_protocol(), cfg.eval_tokens),
            "calibration": {"dataset": cfg.dataset or "bundled corpus", "tokens": cfg.calib_tokens, "seq_len": cfg.seq_len},
            "figure_flops": cfg.figure_budget(),
            "points": points,
        }


def preflight(config: SweepConfig) -> None:
    """Every check `rana sweep` makes before the model loads: the settings, the model (a dense one), the
    output folder (new, or a sweep's to resume), the windows against the model's positions, the texts."""
    config.validate()
    resolve(config.model, dense=True)  # an unknown model, or a rana folder
    check_output(config.out, model_inputs(config.model) + local_inputs(config.dataset, *config.ppl_data),
                 resumable=(SWEEP_KIND,))
    check_inputs(config.model, seq_len=max(config.seq_len, config.eval_protocol().window), out=config.out,
                 out_inside=True, data=list(config.ppl_data))
    check_source(config.dataset, "--dataset", tokens=config.calib_tokens, text_column=config.text_column)


def run_sweep(config: SweepConfig, *, progress: Progress | None = None, log: Log | None = None,
              checked: bool = False) -> dict:
    """Run (or resume) a sweep and write its outputs under `config.out`; returns results.json's content.
    `checked`: `preflight(config)` has run (else it runs here)."""
    if not checked:
        preflight(config)
    return Sweep(config, progress=progress, log=log).run()
