"""`rana eval --latency --latency-mode serve`: a tiny compressed llama (rana folder) and its dense model, both
served by one `transformers serve` on a free 127.0.0.1 port (the rana folder exported in the quantizer
format, the dense model saved as a plain folder), timed through streamed completions. No timing is
asserted (a busy machine decides those): the result's structure, the token counts both models produced,
and that the server and its temporary folder are gone afterwards.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers import byte_tokenizer, tiny_calibration, tiny_compress_config, tiny_model
from rana.cli.app import app
from rana.evaluation.serving import SERVE_PROMPTS, serve_unavailable

pytestmark = pytest.mark.skipif(serve_unavailable() is not None, reason=serve_unavailable() or "")

NEW_TOKENS = 6
REPEATS = 2


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny dense llama (plain HF folder, byte tokenizer) and a rana folder of it compressed."""
    import rana.io as rio
    from rana.compress import compress_model

    tmp = tmp_path_factory.mktemp("serve_latency")
    dense = tmp / "dense"
    model = tiny_model("llama", vocab_size=257)
    tok = byte_tokenizer()
    model.save_pretrained(dense)
    tok.save_pretrained(dense)
    compress_model(model, None, tiny_compress_config(method="teal"), tiny_calibration(vocab=257))
    rio.save(model, tok, tmp / "tiny_rana")
    return tmp / "tiny_rana", dense


def _serve_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("rana_serve_*")}


def test_serve_latency_mode_end_to_end(folders, tmp_path):
    rana_dir, dense = folders
    out = tmp_path / "serve.json"
    before = _serve_dirs()
    env = {"HF_HUB_OFFLINE": "1", "COLUMNS": "250"}
    res = CliRunner().invoke(app, ["eval", str(rana_dir), "--dense", str(dense), "--latency", "--latency-mode", "serve",
                                   "--latency-tokens", str(NEW_TOKENS), "--latency-repeats", str(REPEATS),
                                   "--json", str(out)], env=env)
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert "TTFT ms" in res.output and "serve harness" in res.output

    lat = json.loads(out.read_text())["models"][0]["latency"]
    assert lat["mode"] == "serve" and lat["prompts"] == len(SERVE_PROMPTS) and lat["rounds"] == REPEATS
    assert lat["server"].startswith("transformers serve") and lat["decode_path"].startswith("served by transformers serve")
    for key in ("tokens_per_s", "dense_tokens_per_s", "latency_ratio", "speedup", "decode_tokens_per_s",
                "dense_decode_tokens_per_s", "decode_latency_ratio", "ttft_seconds", "dense_ttft_seconds", "ttft_ratio"):
        assert isinstance(lat[key], float) and math.isfinite(lat[key]) and lat[key] > 0, (key, lat[key])
    assert lat["latency_ratio"] == pytest.approx(lat["dense_tokens_per_s"] / lat["tokens_per_s"])
    for side in ("model", "dense"):
        s = lat[side]
        # every timed request of both models produced exactly the tokens asked for
        assert s["completion_tokens"] == [NEW_TOKENS] * (REPEATS * len(SERVE_PROMPTS)), (side, s["completion_tokens"])
        assert s["requests"] == REPEATS * len(SERVE_PROMPTS) and s["new_tokens"] == NEW_TOKENS
        assert len(s["texts"]) == len(SERVE_PROMPTS) and s["ttft_seconds"] <= s["seconds"]
    # the temporary folder (exports, dense copy, server log) is removed, and with it nothing left running
    assert _serve_dirs() == before


def test_serve_latency_keeps_workdir_and_stops_server(folders, tmp_path):
    """The library call on an in-memory model: its rana folder exported, the dense model saved, one server
    for both; the server's port is closed once the call returns."""
    import socket

    from rana.evaluation.serving import Server, serve_latency
    from rana.export import export
    from rana.io import load_model, open_model

    rana_dir, dense = folders
    loaded = open_model(rana_dir)
    dense_model = load_model(str(dense))[0]
    ports = []
    original = Server.start

    def remember(self, *a, **k):
        original(self, *a, **k)
        ports.append(self.port)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Server, "start", remember)
        r = serve_latency(loaded.model, loaded.tokenizer, dense_model, reference=rana_dir, export=export,
                          prompts=["hello"], new_tokens=3, warmup=1, repeats=1, workdir=tmp_path / "work")
    assert r["model"]["completion_tokens"] == [3] and r["dense"]["completion_tokens"] == [3]
    work = tmp_path / "work"
    cfg = json.loads((work / "compressed" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "rana"  # served through the quantizer, no remote code
    assert "quantization_config" not in json.loads((work / "dense" / "config.json").read_text())
    assert (work / "serve.log").is_file() and len(ports) == 1
    with socket.socket() as s:  # nothing listens on the server's port any more
        assert s.connect_ex(("127.0.0.1", ports[0])) != 0


def test_unknown_latency_mode_refused(folders):
    res = CliRunner().invoke(app, ["eval", str(folders[0]), "--latency", "--latency-mode", "served"])
    assert res.exit_code != 0 and "serve" in res.output
