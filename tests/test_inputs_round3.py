"""Issue 39, the third round of bad inputs, causes 5 and 6: the up-front data check bounded by the token
budget like the reading itself (and an empty path read as no source), and exports fed back to rana,
serving and latency (an export given to `rana compress`, a remote-code export loaded without any prompt,
a server that dies mid-run, a latency run that cannot finish).

Tiny random models, the CLI through typer's CliRunner; the dying server is a stand-in process that
kills itself in the middle of a request."""
from __future__ import annotations

import builtins
import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from helpers import byte_tokenizer, tiny_calibration, tiny_compress_config, tiny_model, tiny_model_dir, one_line_error
from rana.cli.app import app
from rana.compress import CompressConfig
from rana.data import BUNDLED_CORPUS, DataError, check_source, load_texts, read_tokens
from rana.evaluation.serving import serve_unavailable

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest

runner = CliRunner()
SMALL = ["--calib-tokens", "1024", "--seq-len", "64", "--batch-size", "4"]
PROMPTED = "Do you wish to run the custom code"  # transformers' trust_remote_code question


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny dense folder (256 positions, byte tokenizer), a rana folder compressed from it and its
    exports in both formats."""
    import rana.io as rio
    from rana.compress import compress_model
    from rana.export import export
    from rana.quantize.run import quantize_model

    root = tmp_path_factory.mktemp("round3")
    dense = tiny_model_dir(root / "dense")
    model = tiny_model("llama", vocab_size=257)
    compress_model(model, None, tiny_compress_config(method="teal"), tiny_calibration(vocab=257))
    rio.save(model, byte_tokenizer(), root / "rana_folder")
    export(root / "rana_folder", root / "quantizer_export", format="quantizer")
    export(root / "rana_folder", root / "remote_export", format="remote-code")
    quantize_model(model, None)  # int8 weights (max-abs scales): the remote-code config records them apart
    rio.save(model, byte_tokenizer(), root / "int8_folder")
    export(root / "int8_folder", root / "int8_remote_export", format="remote-code")
    return {"root": root, "dense": dense, "rana": root / "rana_folder", "quantizer": root / "quantizer_export",
            "remote-code": root / "remote_export", "int8": root / "int8_folder",
            "int8 remote-code": root / "int8_remote_export"}


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    """`datasets`' cache folder, empty and watched: nothing may be copied into it."""
    import datasets

    cache = tmp_path / "datasets_cache"
    cache.mkdir()
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    return cache


def cached_bytes(cache: Path) -> int:
    return sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())


# --------------------------------------------------------------------------- cause 5: bounded by the budget


def _rows(n: int) -> str:
    text = BUNDLED_CORPUS.read_text()
    return "".join(json.dumps({"text": text[i % 20_000:i % 20_000 + 500]}) + "\n" for i in range(0, 500 * n, 500))


@pytest.mark.parametrize("kind", ["jsonl", "txt"])
def test_the_compress_preflight_checks_the_data_only_as_far_as_the_budget_reads(models, tmp_path, datasets_cache,
                                                                                   kind):
    """A 2 MB file for 1024 tokens: the check reads what the budget reads (a damaged end of the file is
    never reached, as the read never reaches it) and copies nothing into the datasets cache; it used to
    parse (and cache) the whole file, so the damaged end failed the pre-flight."""
    from rana.compress.job import preflight

    data = tmp_path / f"big.{kind}"
    if kind == "jsonl":
        data.write_text(_rows(4000) + "{not json at all\n")
    else:
        data.write_bytes(BUNDLED_CORPUS.read_text()[:20_000].encode() * 100 + b"\xff\xfe not UTF-8")
    config = CompressConfig(model=str(models["dense"]), dataset=str(data), calib_tokens=1024, seq_len=64)
    preflight(config)
    assert cached_bytes(datasets_cache) == 0
    # damage within the budget is still found up front, by name
    data.write_text("{not json at all\n" + _rows(10)) if kind == "jsonl" else data.write_bytes(b"\xff" * 100)
    with pytest.raises(DataError, match="big"):
        preflight(config)


def test_reading_a_local_json_file_copies_nothing_into_the_datasets_cache(tmp_path, datasets_cache):
    data = tmp_path / "rows.jsonl"
    data.write_text(_rows(200))
    texts = load_texts(data)  # unbounded: every row, streamed
    assert len(texts) == 200 and cached_bytes(datasets_cache) == 0
    check_source(data, "--dataset", text_column="text")
    assert cached_bytes(datasets_cache) == 0
    with pytest.raises(DataError, match="column 'body' not in"):  # the column is checked up front when named
        check_source(data, "--dataset", tokens=64, text_column="body")


def test_an_empty_path_is_no_data_source(tmp_path, monkeypatch):
    """`Path('')` is the current folder: a library caller's '' used to read every text file under it."""
    (tmp_path / "notes.txt").write_text("a private note in the working directory " * 20)
    monkeypatch.chdir(tmp_path)
    for read in (lambda: load_texts(""), lambda: load_texts(" ", max_chars=100),
                 lambda: read_tokens("", byte_tokenizer(), limit=10)):
        with pytest.raises(DataError, match="empty path"):
            read()
    with pytest.raises(DataError, match="--dataset is an empty path"):
        check_source("", "--dataset")


# --------------------------------------------------------------------------- cause 6: exports fed back


@pytest.mark.parametrize("kind", ["quantizer", "remote-code"])
def test_compressing_an_export_is_refused_before_any_work(models, kind, tmp_path, no_model_load):
    res = runner.invoke(app, ["compress", str(models[kind]), "--out", str(tmp_path / "again"), *SMALL])
    one_line_error(res, f"is a `rana export` folder ({kind} format), a compressed model", "pass the dense model")
    assert not (tmp_path / "again").exists()


def test_an_export_from_the_hub_is_refused_as_a_dense_model(models, monkeypatch):
    """A hub id resolves to its snapshot without reading config.json, so a quantizer-format export from the
    hub shows only once loaded: refused there, before any compression work (it used to load as dense)."""
    import rana.io.models
    from rana.io.models import ModelLoadError, ModelSource, load_model

    monkeypatch.setattr(rana.io.models, "resolve", lambda ref, dense=False: ModelSource(str(models["quantizer"])))
    with pytest.raises(ModelLoadError, match="'someone/tiny-rana' is a `rana export` \\(quantizer format\\), a "
                                             "compressed model, not a dense model"):
        load_model("someone/tiny-rana")


@pytest.fixture
def no_prompt(monkeypatch):
    """A terminal nobody answers: transformers' trust_remote_code question fails the test."""
    def refuse(*a, **k):
        raise AssertionError("transformers asked whether to run the code shipped in the folder")

    monkeypatch.setattr(builtins, "input", refuse)


def test_both_export_formats_open_through_rana_without_running_their_code(models, no_prompt):
    """Both export formats open through rana's quantizer, giving exactly `rana.load`'s logits; the
    remote-code one used to go to transformers' remote-code path, which asks (or fails) first."""
    import rana
    import rana.io as rio

    ids = torch.tensor([[1, 5, 9, 33, 100, 7, 200, 64]])
    for kind, source in (("remote-code", "rana"), ("int8 remote-code", "int8"), ("quantizer", "rana")):
        want, _ = rio.load(models[source])
        shipped = {m for m in sys.modules if m.startswith("transformers_modules")}
        opened = rana.open(models[kind])
        assert opened.kind == "rana" and opened.tokenizer is not None, kind
        assert {m for m in sys.modules if m.startswith("transformers_modules")} == shipped  # nothing shipped ran
        with torch.no_grad():
            assert torch.equal(opened.model(ids).logits, want(ids).logits), kind


def test_eval_of_a_remote_code_export_with_stdin_closed_never_prompts(models):
    res = runner.invoke(app, ["eval", str(models["remote-code"]), "--dense", str(models["dense"]), "--latency",
                              "--latency-tokens", "2", "--latency-repeats", "1", "--latency-mode", "eager"], input="")
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert PROMPTED not in res.output and "tok/s" in res.output


def test_a_model_that_needs_its_own_code_is_one_line_not_a_prompt(models, tmp_path):
    """A dense-looking folder whose model type only its shipped code defines: rana passes
    trust_remote_code=False, so transformers refuses it (in one line) instead of asking."""
    import shutil

    folder = tmp_path / "custom"
    shutil.copytree(models["dense"], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="my_custom_llama", auto_map={"AutoConfig": "configuration_custom.MyConfig",
                                                          "AutoModelForCausalLM": "modeling_custom.MyModel"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_custom.py").write_text("raise SystemExit('planted code ran')\n")
    (folder / "modeling_custom.py").write_text("raise SystemExit('planted code ran')\n")
    res = runner.invoke(app, ["eval", str(folder), "--latency", "--latency-tokens", "2", "--latency-repeats", "1",
                              "--latency-mode", "eager"], input="")
    one_line_error(res, "needs the code shipped with it", "rana runs no code from a model folder")
    assert PROMPTED not in res.output


# --------------------------------------------------------------------------- cause 6: latency that cannot finish


def test_latency_tokens_past_the_positions_are_refused_before_loading(models, no_model_load):
    res = runner.invoke(app, ["eval", str(models["dense"]), "--latency", "--latency-tokens", "1000000"])
    one_line_error(res, "--latency-tokens 1000000 cannot finish", "it has 256", "pass --latency-tokens 255 or less")


@pytest.mark.parametrize("mode", ["eager", "serve"])
def test_the_prompt_counts_against_the_positions_before_any_timing(models, mode, monkeypatch):
    """250 new tokens fit 256 positions, but not after the 77-token prompt: refused once the tokenizer is
    known, before perplexity, a server or a timed run."""
    import rana.evaluation.run
    import rana.evaluation.serving

    if mode == "serve" and serve_unavailable():
        pytest.skip(serve_unavailable())

    def never(*a, **k):
        raise AssertionError("a run that cannot finish was started")

    monkeypatch.setattr(rana.evaluation.run, "measure_latency", never)
    monkeypatch.setattr(rana.evaluation.serving.Server, "start", never)
    res = runner.invoke(app, ["eval", str(models["rana"]), "--dense", str(models["dense"]), "--latency",
                              "--latency-tokens", "250", "--latency-mode", mode])
    one_line_error(res, "--latency-tokens 250 cannot finish", "77-token prompt", "pass --latency-tokens 179 or less")


def test_the_decode_harness_refuses_a_run_past_the_positions():
    from rana.errors import UserError
    from rana.evaluation import decode_latency

    model = tiny_model("llama", vocab_size=257)  # 256 positions
    with pytest.raises(UserError, match="need 260 positions, and it has 256"):
        decode_latency(model, torch.zeros(1, 250, dtype=torch.long), new_tokens=10, warmup=0, repeats=1, mode="eager")


# --------------------------------------------------------------------------- cause 6: a server that dies


# A stand-in for `transformers serve` (Server runs `python -c LAUNCH serve --port P ...`): /health answers,
# the first completion is streamed whole, the second kills the process — halfway through its stream, or
# before it answers at all.
_DYING_SERVER = r'''
import http.server, json, os, signal, sys
port, how = int(sys.argv[sys.argv.index("--port") + 1]), os.environ["RANA_TEST_DEATH"]
served = []

def event(chunk):
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"

class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def do_POST(self):
        n = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["max_tokens"]
        served.append(n)
        if len(served) == 2 and how == "before answering":
            os.kill(os.getpid(), signal.SIGKILL)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(event({"choices": [{"text": "a"}]}))
        self.wfile.flush()
        if len(served) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        self.wfile.write(event({"choices": [{"text": "b"}], "usage": {"completion_tokens": n, "prompt_tokens": 3}}))
        self.wfile.write(b"data: [DONE]\n\n")

http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


@pytest.mark.skipif(serve_unavailable() is not None, reason=serve_unavailable() or "")
@pytest.mark.parametrize("how", ["mid-stream", "before answering"])
def test_a_server_killed_mid_run_ends_in_one_line(models, how, monkeypatch):
    import rana.evaluation.serving

    monkeypatch.setattr(rana.evaluation.serving, "LAUNCH", _DYING_SERVER)
    monkeypatch.setenv("RANA_TEST_DEATH", how)
    res = runner.invoke(app, ["eval", str(models["dense"]), "--latency", "--latency-mode", "serve",
                              "--latency-tokens", "4", "--latency-repeats", "1"])
    one_line_error(res, "transformers serve was killed by signal 9 while serving", "no latency was measured")
