"""`rana eval --ppl-protocol {rana,gptq,teal}`: the window plans, the token streams, perplexities
against plain per-window loops on a tiny random Llama, the FLOP blocks' context, the CLI."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from helpers import byte_tokenizer, tiny_model
from rana.accounting import dense_macs
from rana.data import DataError
from rana.evaluation import evaluate_model
from rana.evaluation.perplexity import (joined_text, perplexity, ppl_preset, protocol_tokens, scored_positions,
                                        text_rows, window_starts)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest

WIKI = " \n = Title = \n \n Some body text , with @-@ marks .\n \n = = Section = = \n \n More text .\n"


@pytest.fixture(scope="module")
def long_model():
    """A tiny Llama over the byte tokenizer's 257 ids whose position table holds a 2560-token window."""
    return tiny_model(vocab_size=257, max_position_embeddings=4096)


def _tokens(n: int, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, 257, (n,), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- plans


def test_presets_set_window_stride_and_scored_span():
    rana, gptq, teal = ppl_preset("rana"), ppl_preset("gptq"), ppl_preset("teal")
    assert (rana.window, rana.stride, rana.scored) == (512, 512, 511)
    assert (gptq.window, gptq.stride, gptq.scored, gptq.separator) == (2048, 2048, 2047, "\n\n")
    assert (teal.window, teal.stride, teal.scored, teal.context, teal.terminate) == (2560, 512, 512, 2048, True)
    # --seq-len replaces the window (rana, gptq) or the context before the 512 scored tokens (teal)
    assert ppl_preset("rana", 64).window == 64 and ppl_preset("gptq", 4096).window == 4096
    assert (ppl_preset("teal", 1024).window, ppl_preset("teal", 1024).context) == (1536, 1024)
    with pytest.raises(ValueError, match="unknown --ppl-protocol 'wikitext': choose one of rana, gptq, teal"):
        ppl_preset("wikitext")
    with pytest.raises(ValueError, match="--seq-len"):
        ppl_preset("gptq", 1)


def test_windows_drop_the_tail_and_cover_only_full_windows():
    gptq = ppl_preset("gptq")
    assert window_starts(2047, gptq) == [] and window_starts(2048, gptq) == [0]
    assert window_starts(3 * 2048 + 2047, gptq) == [0, 2048, 4096]  # numel // 2048 windows
    # TEAL: the stream cut to a multiple of 512, 2560-token windows advanced by 512 until one ends there
    teal = ppl_preset("teal")
    assert window_starts(2559, teal) == [] and window_starts(2560, teal) == [0]
    assert window_starts(5000, teal) == [0, 512, 1024, 1536, 2048]  # 4608 = 5000 cut to 512s = last end


def test_teal_scores_each_token_after_the_first_2048_exactly_once_with_2048_or_more_before_it():
    teal = ppl_preset("teal")
    positions = scored_positions(5000, teal)
    assert torch.equal(positions, torch.arange(2048, 4608))  # the tail past the last full window unscored
    for i, start in enumerate(window_starts(5000, teal)):  # window i scores its own last 512 tokens
        assert torch.equal(positions[i * 512 : (i + 1) * 512], torch.arange(start + 2048, start + 2560))
    rana = ppl_preset("rana", 64)
    positions = scored_positions(200, rana)
    assert torch.equal(positions, torch.tensor([p for p in range(192) if p % 64]))  # all but each window's first


# --------------------------------------------------------------------------- perplexity vs hand loops


def _loop_nll(model, tokens, window, stride, first_scored):
    """Plain reference: run each full window, add -log p(token | everything before it in the window)
    for window positions first_scored.., one token at a time."""
    nll, count, start = 0.0, 0, 0
    with torch.no_grad():
        while start + window <= tokens.numel():
            ids = tokens[start : start + window]
            logp = F.log_softmax(model(input_ids=ids[None]).logits[0].double(), dim=-1)
            for j in range(first_scored, window):
                nll -= float(logp[j - 1, ids[j]])
                count += 1
            start += stride
    return nll / count, count


@pytest.mark.parametrize("name,seq_len,n", [("rana", 64, 1000), ("gptq", None, 2 * 2048 + 700), ("teal", None, 3700),
                                            ("teal", 256, 1500)])
def test_each_preset_matches_a_per_window_loop(long_model, name, seq_len, n):
    protocol = ppl_preset(name, seq_len)
    tokens = _tokens(n)
    result = perplexity(long_model, tokens, batch_size=2, progress=False, protocol=protocol)
    nll, count = _loop_nll(long_model, tokens, protocol.window, protocol.stride, protocol.window - protocol.scored)
    assert result["tokens"] == count == len(scored_positions(n, protocol))
    assert result["windows"] == len(window_starts(n, protocol)) and result["seq_len"] == protocol.window
    assert result["nll"] == pytest.approx(nll, rel=1e-5)
    assert result["ppl"] == pytest.approx(math.exp(nll), rel=1e-5)


def test_gptq_and_teal_equal_their_papers_formulas(long_model):
    """GPTQ: mean over windows of the mean shifted cross-entropy, exp'd. TEAL: the model's own loss with
    labels masked to -100 outside the last 512 tokens of each window, mean over windows, exp'd."""
    tokens = _tokens(2 * 2048 + 300, seed=7)
    with torch.no_grad():
        losses = []
        for i in range(tokens.numel() // 2048):
            ids = tokens[None, i * 2048 : (i + 1) * 2048]
            logits = long_model(input_ids=ids).logits.float()
            losses.append(F.cross_entropy(logits[0, :-1], ids[0, 1:]))
        gptq = math.exp(float(torch.stack(losses).double().mean()))
        losses = []
        for start in range(0, 3700 - 3700 % 512, 512):
            ids = tokens[None, start : start + 2560]
            labels = ids.clone()
            labels[:, :-512] = -100
            losses.append(long_model(input_ids=ids, labels=labels).loss)
            if start + 2560 >= 3700 - 3700 % 512:
                break
        teal = math.exp(float(torch.stack(losses).double().mean()))
    assert perplexity(long_model, tokens, progress=False, protocol=ppl_preset("gptq"))["ppl"] == pytest.approx(gptq,
                                                                                                             rel=1e-5)
    assert perplexity(long_model, tokens[:3700], progress=False,
                      protocol=ppl_preset("teal"))["ppl"] == pytest.approx(teal, rel=1e-5)


def test_too_short_a_stream_is_one_clear_error(long_model):
    with pytest.raises(DataError, match="fewer than one 2560-token window of the teal protocol"):
        perplexity(long_model, _tokens(2559), progress=False, protocol=ppl_preset("teal"))


# --------------------------------------------------------------------------- token streams


def _bos_tokenizer():
    """The byte tokenizer with a BOS its default special tokens prepend (as Llama's does)."""
    from tokenizers.processors import TemplateProcessing

    tok = byte_tokenizer()
    tok.add_special_tokens({"bos_token": "<bos>"})
    bos = tok.convert_tokens_to_ids("<bos>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    return tok, bos


def test_text_file_rows_are_wikitext_lines_and_streams_join_them(tmp_path):
    raw = tmp_path / "wiki.test.raw"
    raw.write_text(WIKI)
    rows = text_rows(raw)
    # as the hub `wikitext` dataset has wiki.test.raw: each line keeps "\n", blank lines are empty rows
    assert rows == ["", " = Title = \n", "", " Some body text , with @-@ marks .\n", "", " = = Section = = \n", "",
                    " More text .\n"]
    tok, bos = _bos_tokenizer()
    gptq, teal = ppl_preset("gptq"), ppl_preset("teal")
    expected = tok("\n\n".join(rows))["input_ids"]
    assert expected[0] == bos
    assert protocol_tokens(raw, tok, gptq).tolist() == expected  # one call, default special tokens
    assert joined_text(rows, teal) == "".join(r + "\n\n" for r in rows)  # TEAL: each row followed by "\n\n"
    assert protocol_tokens(raw, tok, teal).tolist() == tok(joined_text(rows, teal))["input_ids"]
    assert protocol_tokens(raw, tok, gptq, max_tokens=20).tolist() == expected[:20]
    rana = protocol_tokens(raw, tok, ppl_preset("rana"))  # today's: no special tokens, the file as one document
    assert rana.tolist() == tok(WIKI, add_special_tokens=False)["input_ids"]


def test_record_files_keep_empty_rows_and_folders_are_refused(tmp_path):
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t}) for t in ["first", "", "third"]) + "\n")
    assert text_rows(jsonl) == ["first", "", "third"]
    tok = byte_tokenizer()
    assert protocol_tokens(jsonl, tok, ppl_preset("gptq")).tolist() == tok("first\n\n\n\nthird")["input_ids"]
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.txt").write_text("text")
    with pytest.raises(DataError, match="folder"):
        text_rows(tmp_path / "dir")


# --------------------------------------------------------------------------- evaluate_model and FLOPs


def test_evaluate_model_reports_the_preset_and_meters_flops_at_its_window(long_model, tmp_path):
    raw = tmp_path / "wiki.test.raw"
    raw.write_text(WIKI * 70)  # ~5.6k bytes
    tok = byte_tokenizer()
    result = evaluate_model(long_model, tok, ppl_sources={"wiki": str(raw)}, ppl_protocol="teal", batch_size=2)
    r, flops = result["ppl"]["wiki"], result["flops"]
    n = protocol_tokens(raw, tok, ppl_preset("teal")).numel()
    assert result["ppl_protocol"] == r["ppl_protocol"] == "teal" and result["seq_len"] == 2560
    assert r["windows"] == len(window_starts(n, ppl_preset("teal"))) and r["tokens"] == r["windows"] * 512
    assert result["protocol"].startswith("teal protocol: ") and "the last 512 tokens of each scored" in result["protocol"]
    # every token of every run window is metered, attention products at the window's context
    assert flops["tokens"] == r["windows"] * 2560 and flops["attention_context"] == 2560
    assert flops["fraction"] == 1.0  # a dense model
    assert flops["dense_gflops_per_token"] == pytest.approx(2 * dense_macs(long_model.config, 2560)["total"] / 1e9)
    gptq = evaluate_model(long_model, tok, ppl_sources={"wiki": str(raw)}, ppl_protocol="gptq", seq_len=1024)
    assert gptq["seq_len"] == 1024 and "--seq-len 1024 in place of the preset's 2048" in gptq["protocol"]
    assert gptq["flops"]["attention_context"] == 1024
    default = evaluate_model(long_model, tok, ppl_sources={"wiki": str(raw)}, seq_len=64)
    assert default["ppl_protocol"] == "rana" and "non-overlapping 64-token windows" in default["protocol"]


# --------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def eval_dir(tmp_path_factory, long_model):
    root = tmp_path_factory.mktemp("pplproto")
    long_model.save_pretrained(root / "tiny")
    byte_tokenizer().save_pretrained(root / "tiny")
    (root / "wiki.test.raw").write_text(WIKI * 40)
    return root


def test_cli_prints_the_protocol_and_writes_it_to_json(eval_dir):
    from rana.cli.app import app

    out = eval_dir / "r.json"
    res = CliRunner().invoke(app, ["eval", str(eval_dir / "tiny"), "--ppl-data", str(eval_dir / "wiki.test.raw"),
                                   "--ppl-protocol", "teal", "--seq-len", "256", "--json", str(out)])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "teal perplexity protocol" in text and "protocol: teal protocol, --seq-len 256 in place of the preset's 2048" in text
    data = json.loads(out.read_text())
    assert data["ppl_protocol"] == "teal" and data["seq_len"] == 768
    assert data["models"][0]["ppl"]["wiki.test"]["tokens"] == data["models"][0]["ppl"]["wiki.test"]["windows"] * 512


@pytest.mark.parametrize("args,needles", [
    (["--ppl-protocol", "wikitext"], ["unknown --ppl-protocol 'wikitext'", "rana, gptq, teal"]),
    (["--ppl-protocol", "gptq", "--eval-tokens", "1000"], ["--eval-tokens (1000)", "2048 tokens"]),
    (["--ppl-protocol", "gptq", "--seq-len", "8192"], ["8192"]),  # beyond the model's 4096 positions
])
def test_cli_refuses_a_bad_protocol_in_one_line(eval_dir, args, needles):
    from rana.cli.app import app

    res = CliRunner().invoke(app, ["eval", str(eval_dir / "tiny"), "--ppl-data", str(eval_dir / "wiki.test.raw"),
                                   *args])
    assert res.exit_code not in (0, None), res.output
    assert "Traceback" not in res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.output
    text = " ".join(res.output[res.output.index("error:"):].split())
    for needle in needles:
        assert needle in text, text


# --------------------------------------------------------------------------- sweep


def test_sweep_carries_the_preset(eval_dir, tmp_path):
    from rana.sweep import SweepConfig, run_sweep

    def config(**kw):
        return SweepConfig(model=str(eval_dir / "tiny"), out=tmp_path / "s", ppl_data=[str(eval_dir / "wiki.test.raw")],
                           methods=[], dense=True, seq_len=64, **kw)

    assert config().eval_protocol().window == 64 and "ppl_protocol" not in config().eval_settings()  # rana: --seq-len
    assert config(ppl_protocol="gptq").eval_protocol().window == 2048  # the others keep their own windows
    with pytest.raises(ValueError, match="unknown --ppl-protocol"):
        config(ppl_protocol="c4").validate()
    results = run_sweep(config(ppl_protocol="teal"))
    assert results["protocol"].startswith("teal protocol: ")
    (point,) = results["points"]
    r = point["ppl"]["wiki.test"]
    assert r["ppl_protocol"] == "teal" and r["seq_len"] == 2560 and r["tokens"] == 512 * r["windows"]
    assert point["flops"]["attention_context"] == 2560
