"""Decode speed through a server: `transformers serve` (transformers' OpenAI-compatible server) answering
streamed text completions, the compressed model against the dense one served the same way.

What is timed is what a client of a served model sees: batch 1, greedy, a fixed number of new tokens
(`min_new_tokens` = `max_new_tokens`, so EOS cannot end a request early), each request streamed over
HTTP from 127.0.0.1. One `transformers serve` process serves both models (it takes the model per
request and keeps every model it loaded while `--model-timeout -1`), so both share the process, its
threads and its HTTP stack; the compressed model is a quantizer-format export (`rana export`: the
stock class, quant_method "rana") and the dense model a plain Hugging Face folder, both written to a
temporary folder. Requests alternate between the two models (ABBA order over the rounds) after
untimed warm-up rounds (the first also loads both models).

Per request: `ttft_seconds` (request sent -> first streamed text), `seconds` (request sent -> the
final chunk) and `decode_seconds` (first text -> final chunk, the `new_tokens - 1` later tokens).
Reported medians: `tokens_per_s` = new_tokens / seconds, `decode_tokens_per_s` = (new_tokens - 1) /
decode_seconds; `latency_ratio` = compressed / dense time per token (< 1 is faster), as the in-process
harnesses (`latency.py`) report it. A tokenizer that holds a token back until the next one completes
a character delays the first text by that token; the byte-level BPE tokenizers of real models rarely do.

What cannot finish never starts (a prompt and `new_tokens` past the models' positions: `check_prompts_fit`),
and a server that dies mid-run (killed, crashed, its connection dropped) ends the run in one `ServeError`
line saying how it ended; the server and its temporary folder are gone either way.
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..io import is_rana_dir
from ..io import save as save_rana_folder
from ..io.models import clear_gguf_quantizer
from ..kernels.cpu_gemv import native_status
from ..units import Progress
from .common import model_device
from .latency import DEFAULT_PROMPT, check_prompts_fit

SERVE_MODE = "serve"
# what the served models complete, in turn (prose, code, a story opening): each round sends every one
SERVE_PROMPTS = (
    DEFAULT_PROMPT,
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea, there lived",
)
START_TIMEOUT_S = 180.0  # the server's start (imports) until /health answers; models load on the first request
REQUEST_TIMEOUT_S = 600.0  # one request, model loading included (the warm-up's first requests load both models)
# the server process: rana's quantizer registered (as rana's start-up hook does in an installed rana), then
# transformers' own CLI (`transformers serve ...`)
LAUNCH = ("import sys; import rana; sys.argv[0] = 'transformers'; "
          "from transformers.cli.transformers import main; sys.exit(main())")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# export(rana_folder, out_folder) -> out_folder: the quantizer-format export (`rana.export.export`); the
# caller passes it (rana.evaluation does not import the export command; `rana eval` hands it over)
Exporter = Callable[[Path, Path], Any]


class ServeError(UserError, RuntimeError):
    """The server could not start, died, or a request failed or came back short. Its first line says which
    (a command prints it as its one error line), the server's log tail follows. Still a RuntimeError, as
    it was before it was a `UserError`."""


def serve_unavailable() -> str | None:
    """Why `transformers serve` cannot run in this Python (its extra is missing), or None."""
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        return ("`transformers serve` needs the serving extra (fastapi, uvicorn, pydantic, openai): "
                "pip install 'transformers[serving]'")
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `transformers serve` process on 127.0.0.1 (its own process group), serving any model folder a
    request names, every model kept once loaded. Use as a context manager: it is always stopped."""

    def __init__(self, *, device: str, dtype: str, log_path: Path, threads: int | None = None):
        self.device, self.dtype, self.log_path, self.threads = device, dtype, Path(log_path), threads
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _env(self) -> dict[str, str]:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("RANA_NO_HF_HOOK", None)  # the server needs quant_method "rana"
        if self.threads:  # the thread count this process measures with (decode_path says it)
            env["OMP_NUM_THREADS"] = str(self.threads)
        return env

    def start(self, attempts: int = 3) -> None:
        for _ in range(attempts):  # a port taken between free_port() and the server's bind: another port
            self.port = free_port()
            cmd = [sys.executable, "-c", LAUNCH, "serve", "--host", "127.0.0.1", "--port", str(self.port),
                   "--device", self.device, "--dtype", self.dtype, "--model-timeout", "-1", "--log-level", "warning"]
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=self._env(), start_new_session=True)
            if self._wait_ready(START_TIMEOUT_S):
                return
            self.stop()
            if "address already in use" not in self.log_tail().lower():
                break
        raise ServeError(f"transformers serve did not start: {self._last_log_line()}\n"
                         f"{self.log_tail()}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return True
            except OSError:
                pass
            finally:
                conn.close()
            time.sleep(0.25)
        return False

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _last_log_line(self) -> str:
        """The server log's last non-empty line (its log lives in a folder that is removed afterwards)."""
        lines = [line.strip() for line in self.log_tail().splitlines() if line.strip()]
        return lines[-1] if lines else f"nothing in its log ({self.log_path})"

    def _state(self) -> str:
        """How the server process ended (" was killed by signal 9", " exited with code 1"), waiting a
        moment for a process that is going; "" while it runs."""
        proc = self.proc
        if proc is None:
            return ""
        try:
            code = proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return ""
        return f" was killed by signal {-code}" if code < 0 else f" exited with code {code}"

    def _failed(self, model: str, what: str) -> ServeError:
        """The error of a request to `model` that got no complete answer: the server died (how), or `what`."""
        state = self._state()
        cause = f"transformers serve{state} while serving {model}" if state else f"{model}: {what}"
        return ServeError(f"{cause}; no latency was measured (server log: {self._last_log_line()})\n{self.log_tail()}")

    def stop(self) -> None:
        """Stop the server's process group (SIGTERM, then SIGKILL after 20 s); nothing else is signalled."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=20)
        except ProcessLookupError:
            pass

    def complete(self, model: str, prompt: str, new_tokens: int) -> dict[str, Any]:
        """One streamed greedy text completion of exactly `new_tokens` tokens, timed from the request."""
        body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
                # the whole generation config: greedy, and EOS unable to stop it before new_tokens
                "generation_config": json.dumps({"do_sample": False, "max_new_tokens": new_tokens,
                                                 "min_new_tokens": new_tokens})}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        try:
            t0 = time.perf_counter()
            conn.request("POST", "/v1/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise ServeError(f"{model}: HTTP {resp.status}: {resp.read()[:2000].decode(errors='replace')}\n"
                                 f"{self.log_tail()}")
            t_first = t_end = None
            text, usage, chunks = [], None, 0
            for raw in iter(resp.readline, b""):
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ServeError(f"{model}: the server's generation failed: {chunk['error']}\n{self.log_tail()}")
                chunks += 1
                piece = ((chunk.get("choices") or [{}])[0].get("text")) or ""
                if piece and t_first is None:
                    t_first = now
                text.append(piece)
                if chunk.get("usage"):
                    usage, t_end = chunk["usage"], now
        except ServeError:
            raise
        except (OSError, http.client.HTTPException, ValueError) as e:  # ValueError: a chunk cut short (JSON, UTF-8)
            raise self._failed(model, f"the request failed ({type(e).__name__}: {e})") from None
        finally:
            conn.close()
        if usage is None or t_end is None:
            raise self._failed(model, "the stream ended without its final chunk (usage)")
        t_first = t_end if t_first is None else t_first
        return {"seconds": t_end - t0, "ttft_seconds": t_first - t0, "decode_seconds": t_end - t_first,
                "completion_tokens": int(usage["completion_tokens"]), "prompt_tokens": int(usage["prompt_tokens"]),
                "chunks": chunks, "text": "".join(text)}


def _summary(requests: list[dict], new_tokens: int) -> dict[str, Any]:
    """Medians over the timed requests -> tokens/s end to end and for the decode steps, time to first token."""
    seconds = statistics.median(r["seconds"] for r in requests)
    decode = statistics.median(r["decode_seconds"] for r in requests)
    return {
        "tokens_per_s": new_tokens / seconds,
        "decode_tokens_per_s": (new_tokens - 1) / decode if decode > 0 and new_tokens > 1 else float("nan"),
        "seconds": seconds,
        "seconds_per_token": seconds / new_tokens,
        "ttft_seconds": statistics.median(r["ttft_seconds"] for r in requests),
        "new_tokens": new_tokens,
        "requests": len(requests),
        "completion_tokens": [r["completion_tokens"] for r in requests],
        "prompt_tokens": sorted({r["prompt_tokens"] for r in requests}),
    }


def time_served(server: Server, folders: Sequence[str], prompts: Sequence[str], *, new_tokens: int, warmup: int,
                repeats: int, progress: Progress | None = None) -> list[dict[str, Any]]:
    """Time streamed completions of every prompt by every served model folder, interleaved: each round
    sends each prompt to each model (the model order reversed every other round); `warmup` untimed rounds
    first (at least one: it loads the models). Returns one `_summary` per folder, plus `texts` (the last
    round's completion of each prompt)."""
    if repeats < 1:
        raise UserError(f"latency repeats must be at least 1, got {repeats}")
    warm = max(warmup, 1)
    timed: list[list[dict]] = [[] for _ in folders]
    texts: list[list[str]] = [[""] * len(prompts) for _ in folders]
    total, done = (warm + repeats) * len(prompts) * len(folders), 0
    for step in range(warm + repeats):
        order = list(range(len(folders)))
        if step % 2:
            order.reverse()
        for p, prompt in enumerate(prompts):
            for i in order:
                r = server.complete(folders[i], prompt, new_tokens)
                if r["completion_tokens"] != new_tokens:
                    raise ServeError(f"{folders[i]} generated {r['completion_tokens']} tokens, not the {new_tokens} "
                                     "asked for (min_new_tokens ignored?)")
                if step >= warm:
                    timed[i].append(r)
                    texts[i][p] = r["text"]
                done += 1
                if progress:
                    progress("serve latency", done, total)
    return [{**_summary(t, new_tokens), "texts": x} for t, x in zip(timed, texts)]


def _has_adapters(model: torch.nn.Module) -> bool:
    from ..modules.registry import ADAPTER_CLASSES

    return any(isinstance(m, ADAPTER_CLASSES) for m in model.modules())


def _with_tokenizer(folder: Path, tokenizer) -> Path:
    """A served folder needs its tokenizer: write `tokenizer` there when the folder has none."""
    if tokenizer is not None and not (folder / "tokenizer_config.json").is_file():
        tokenizer.save_pretrained(folder)
    return folder


def servable_folders(model: torch.nn.Module, tokenizer, dense_model: torch.nn.Module | None, workdir: Path, *,
                     reference: str | Path | None = None, export: Exporter | None = None) -> tuple[Path, Path | None]:
    """(folder serving `model`, folder serving `dense_model` or None) under `workdir`.

    A compressed model is served as a quantizer-format export of `reference` (its rana folder) or, for an
    in-memory model, of a rana folder saved first; a dense model as `save_pretrained` writes it (a GGUF
    model dequantised, its GGUF quantizer cleared first)."""
    workdir = Path(workdir)

    def dense_folder(m: torch.nn.Module, name: str) -> Path:
        clear_gguf_quantizer(m)  # a GGUF-loaded model keeps hf_quantizer, which save_pretrained refuses
        m.save_pretrained(workdir / name)
        return _with_tokenizer(workdir / name, tokenizer)

    if reference is not None and is_rana_dir(reference) or _has_adapters(model):
        if export is None:
            raise UserError("the serve latency mode exports the compressed model: pass export=rana.export.export")
        src = Path(reference) if reference is not None and is_rana_dir(reference) else None
        if src is None:
            src = save_rana_folder(model, tokenizer, workdir / "rana_folder")
        compressed = _with_tokenizer(Path(export(src, workdir / "compressed")), tokenizer)
    else:
        compressed = dense_folder(model, "model")
    dense = None if dense_model is None or dense_model is model else dense_folder(dense_model, "dense")
    return compressed, dense


@contextmanager
def _workdir(keep: str | Path | None):
    if keep is not None:
        Path(keep).mkdir(parents=True, exist_ok=True)
        yield Path(keep)
        return
    tmp = tempfile.mkdtemp(prefix="rana_serve_")
    try:
        yield Path(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def serve_path(model: torch.nn.Module, threads: int) -> str:
    """The batch-1 path the served compressed model decodes on, in words."""
    device = model_device(model)
    where = (f"CPU, {threads} thread(s): {native_status()}" if device.type == "cpu"
             else f"{device.type}: the adapters' batch-1 path on {device.type}")
    return f"served by transformers serve (HTTP, streamed, batch 1); {where}"


def serve_latency(model: torch.nn.Module, tokenizer, dense_model: torch.nn.Module | None = None, *,
                  reference: str | Path | None = None, export: Exporter | None = None,
                  prompts: Sequence[str] = SERVE_PROMPTS, new_tokens: int = 64, warmup: int = 1, repeats: int = 5,
                  workdir: str | Path | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """Batch-1 greedy decode speed through `transformers serve`, against `dense_model` served the same way.

    `model` (a compressed model: exported from `reference`, its rana folder, with `export`; or a dense one)
    and `dense_model` are written as servable folders under `workdir` (default: a temporary folder, removed
    afterwards), one server on a free 127.0.0.1 port serves both in the dtype and on the device of `model`
    (on CPU with this process's thread count), and every prompt is completed `repeats` times per model,
    interleaved, after `warmup` untimed rounds. The server is stopped whatever happens.

    Returns the keys of `latency.latency_ratio` (tokens_per_s, dense_tokens_per_s, latency_ratio, speedup,
    the decode_ variants; mode "serve"), ttft_seconds / dense_ttft_seconds / ttft_ratio, `model` and
    `dense` (per-model summaries: medians, completion_tokens of every timed request, texts), and
    `decode_path`. Without a distinct `dense_model` only the model's own numbers."""
    reason = serve_unavailable()
    if reason:
        raise ServeError(reason)
    if new_tokens < 1:
        raise UserError(f"latency tokens must be at least 1, got {new_tokens}")
    prompts = list(prompts)
    if not prompts:
        raise UserError("the serve latency mode needs at least one prompt")
    check_prompts_fit([model, dense_model], tokenizer, prompts, new_tokens)  # what cannot finish never starts
    device = model_device(model)
    dtype = DTYPE_NAMES.get(next(model.parameters()).dtype, "auto")
    threads = torch.get_num_threads() if device.type == "cpu" else None
    with _workdir(workdir) as work:
        compressed, dense = servable_folders(model, tokenizer, dense_model, work, reference=reference, export=export)
        folders = [str(compressed)] + ([str(dense)] if dense is not None else [])
        with Server(device=str(device), dtype=dtype, log_path=work / "serve.log", threads=threads) as server:
            runs = time_served(server, folders, prompts, new_tokens=new_tokens, warmup=warmup, repeats=repeats,
                               progress=progress)
    ours = runs[0]
    import transformers

    out: dict[str, Any] = {"tokens_per_s": ours["tokens_per_s"], "decode_tokens_per_s": ours["decode_tokens_per_s"],
                           "ttft_seconds": ours["ttft_seconds"], "mode": SERVE_MODE, "model": ours,
                           "prompts": len(prompts), "rounds": repeats, "warmup_rounds": max(warmup, 1),
                           "server": f"transformers serve {transformers.__version__}",
                           "device": str(device), "dtype": dtype, "decode_path": serve_path(model, threads or 0)}
    if dense is None:
        if dense_model is model:
            out.update(dense_tokens_per_s=ours["tokens_per_s"], latency_ratio=1.0, speedup=1.0,
                       decode_latency_ratio=1.0, dense_ttft_seconds=ours["ttft_seconds"], ttft_ratio=1.0)
        return out
    theirs = runs[1]
    ratio = theirs["tokens_per_s"] / ours["tokens_per_s"]
    out.update(
        dense_tokens_per_s=theirs["tokens_per_s"],
        latency_ratio=ratio,
        speedup=1.0 / ratio,
        dense_decode_tokens_per_s=theirs["decode_tokens_per_s"],
        decode_latency_ratio=theirs["decode_tokens_per_s"] / ours["decode_tokens_per_s"],
        dense_ttft_seconds=theirs["ttft_seconds"],
        ttft_ratio=ours["ttft_seconds"] / theirs["ttft_seconds"],
        dense=theirs,
    )
    return out


__all__ = ["SERVE_MODE", "SERVE_PROMPTS", "Exporter", "ServeError", "Server", "free_port", "serve_unavailable",
           "servable_folders", "serve_latency", "serve_path", "time_served"]
