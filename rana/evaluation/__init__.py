"""`rana eval`: perplexity with measured FLOPs, lm-eval tasks, decode latency, per-layer errors.

    perplexity.py   the perplexity protocol, evaluation texts and their labels, FLOP blocks
    harness.py      lm-evaluation-harness glue and the bundled offline tasks
    latency.py      decode timing (eager / compiled / step harness) and the masked-GEMV path in use
    decode_step.py  the step harness: gpt-fast-style greedy decode with a compiled one-token step
    serving.py      decode timing through `transformers serve` (streamed HTTP completions), vs dense
    diagnostics.py  per-layer output errors vs the dense model, rank-contribution histograms
    run.py          evaluate_model (one model) and evaluate_models (the `rana eval` table; models
                    open through rana.io.open_model)

The function `perplexity` is imported from `rana.evaluation.perplexity`; it is not re-exported
here, where its name would hide the module of the same name.
"""
from .common import Progress, eval_mode, model_device
from .diagnostics import layer_errors, rank_adapters, rank_contributions
from .harness import LOCAL_TASKS, check_tasks, lm_eval_tasks, task_manager, write_local_tasks
from .decode_step import StepRunner, step_greedy
from .latency import (DEFAULT_PROMPT, LATENCY_MODES, compile_counters, decode_latency, decode_path,
                      default_latency_mode, latency_ratio, measure_latency, step_compile_kwargs)
from .perplexity import (combine_flops, eval_tokens, labelled_sources, ppl_protocol, summarize_flops, text_labels,
                         text_name, window_nll)
from .run import check_request, check_serving, evaluate_model, evaluate_models, metered_perplexity
from .serving import SERVE_MODE, ServeError, serve_latency

__all__ = [
    "Progress", "eval_mode", "model_device",
    "layer_errors", "rank_adapters", "rank_contributions",
    "LOCAL_TASKS", "check_tasks", "lm_eval_tasks", "task_manager", "write_local_tasks",
    "DEFAULT_PROMPT", "LATENCY_MODES", "decode_latency", "decode_path", "default_latency_mode", "latency_ratio",
    "measure_latency", "compile_counters", "step_compile_kwargs", "StepRunner", "step_greedy",
    "combine_flops", "eval_tokens", "labelled_sources", "ppl_protocol", "summarize_flops", "text_labels", "text_name",
    "window_nll",
    "check_request", "check_serving", "evaluate_model", "evaluate_models", "metered_perplexity",
    "SERVE_MODE", "ServeError", "serve_latency",
]
