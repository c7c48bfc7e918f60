"""`rana eval`: perplexity with measured FLOPs, lm-eval tasks, decode latency, per-layer errors.

    perplexity.py   the perplexity protocol, evaluation texts and their labels, FLOP blocks
    harness.py      lm-evaluation-harness glue and the bundled offline tasks
    latency.py      decode timing (eager / compiled / step harness) and the masked-GEMV path in use
    decode_step.py  the step harness: gpt-fast-style greedy decode with a compiled one-token step
    serving.py      decode timing through `transformers serve` (streamed HTTP completions), vs dense
    diagnostics.py  per-layer output errors vs the dense model, rank-contribution histograms
    config.py       EvalConfig: what `rana eval` is asked to measure, each option written once, and its checks
    run.py          evaluate_model (one model) and evaluate_models (the `rana eval` table; models
                    open through rana.io.open_model), both taking an EvalConfig

`preflight(config)`, below, is every check `rana eval` makes before the first model loads.

The function `perplexity` is imported from `rana.evaluation.perplexity`; it is not re-exported
here, where its name would hide the module of the same name.
"""
from ..checks import check_inputs
from ..io import check_folder, is_rana_dir
from ..io.models import model_inputs, resolve
from ..io.paths import check_output_file, local_inputs
from ..units import Progress  # re-exported: the progress callback the commands pass in
from .common import eval_mode, model_device
from .diagnostics import layer_errors, rank_adapters, rank_contributions
from .harness import LOCAL_TASKS, check_tasks, lm_eval_tasks, task_manager, write_local_tasks
from .decode_step import StepRunner, step_greedy
from .latency import (DEFAULT_PROMPT, LATENCY_MODES, compile_counters, decode_latency, decode_path,
                      default_latency_mode, latency_ratio, measure_latency, step_compile_kwargs)
from .perplexity import (combine_flops, eval_tokens, labelled_sources, ppl_protocol, summarize_flops, text_labels,
                         text_name, window_nll)
from .config import EvalConfig, check_request, check_serve_available
from .run import check_serving, evaluate_model, evaluate_models, metered_perplexity
from .serving import SERVE_MODE, ServeError, serve_latency

__all__ = [
    "Progress", "eval_mode", "model_device",
    "layer_errors", "rank_adapters", "rank_contributions",
    "LOCAL_TASKS", "check_tasks", "lm_eval_tasks", "task_manager", "write_local_tasks",
    "DEFAULT_PROMPT", "LATENCY_MODES", "decode_latency", "decode_path", "default_latency_mode", "latency_ratio",
    "measure_latency", "compile_counters", "step_compile_kwargs", "StepRunner", "step_greedy",
    "combine_flops", "eval_tokens", "labelled_sources", "ppl_protocol", "summarize_flops", "text_labels", "text_name",
    "window_nll",
    "EvalConfig", "check_request", "check_serve_available", "preflight",
    "check_serving", "evaluate_model", "evaluate_models", "metered_perplexity",
    "SERVE_MODE", "ServeError", "serve_latency",
]


def preflight(config: EvalConfig) -> None:
    """Everything `rana eval` checks before the first model loads, once, in this order: the settings
    (`EvalConfig.validate`), then every model, text, task and output they name. Raises the first problem
    as one `rana.errors.UserError` (or subclass) naming the option or file; loads no model.

    Defined in the package, not a module of its own: `check_tasks` is looked up here when called, so
    whoever replaces `rana.evaluation.check_tasks` (the tests' stand-in task data) replaces it here too."""
    config.validate()
    refs = config.references
    dense = [config.dense] if config.dense else []
    ppl_data = list(config.ppl_data)
    window = config.protocol.window
    # every model, file and output is checked before the first model loads
    check_inputs(*refs, *dense, seq_len=window if ppl_data else None, json_out=config.json_out, data=ppl_data,
                 data_tokens=config.eval_tokens, text_column=config.text_column)
    tasks = config.task_list
    if tasks:
        check_tasks(tasks, include_path=config.include_path,
                    data_dir=config.task_data if any(t.endswith("_local") for t in tasks) else None)
    for ref in refs:
        if not is_rana_dir(ref):
            resolve(ref)  # fail fast on an unknown model
        else:
            check_folder(ref)  # a broken rana folder: one line before any work
    check_output_file(config.json_out, [p for r in refs + dense for p in model_inputs(r)] + local_inputs(*ppl_data),
                      "--json")
