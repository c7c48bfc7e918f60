"""Multi-process calibration (rana.compress.distributed): two CPU processes (gloo, joined through
accelerate's PartialState as under `accelerate launch`) each push half of the calibration batches
and pool moments / sample rows / meters, and end with the same statistics and the same plan as one
process on all the tokens."""
import os
import socket

import pytest
import torch

from rana.compress import distributed
from helpers import tiny_calibration, tiny_compress_config, tiny_model

RUNS = (("rana", "float32"), ("rana-paper", "float32"), ("rana", "bfloat16"))


def _run(out_path):
    """What both the single-process reference and each worker compute."""
    from rana.archs import decoder_layers, get_arch
    from rana.compress.calibrate import capture_first_layer_inputs, collect_inputs
    from rana.compress import compress_model

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    calib = tiny_calibration()
    model = tiny_model("llama")
    spec = get_arch(model.config)
    fit = capture_first_layer_inputs(model, spec, calib.fit, batch_size=4, device=cpu, offload=cpu)
    held = capture_first_layer_inputs(model, spec, calib.heldout, batch_size=4, device=cpu, offload=cpu)
    layer = decoder_layers(model, spec)[0]
    targets = {r: layer.get_submodule(spec.role_path(r)) for r in ("qkv_in", "mlp_in")}
    stats = collect_inputs(layer, fit, held, targets, device=cpu, second_moment=("qkv_in", "mlp_in"))
    out = {"local_fit_batches": len(fit.hidden),
           "stats": {n: {"moment": s.moment, "count": s.count, "fit": s.fit, "eval": s.eval} for n, s in stats.items()}}
    for method, dtype in RUNS:
        result = compress_model(tiny_model("llama").to(getattr(torch, dtype)), None,
                                tiny_compress_config(method=method, flops=0.7, dtype=dtype), calib)
        out[method, dtype] = {"flops": result.plan["measured_flops"], "layers": result.plan["layers"]}
    torch.save(out, out_path)


def _worker(rank, world, port, folder):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    assert distributed.setup_from_env("cpu") == "cpu"
    assert distributed.active() and distributed.world_size() == world
    try:
        _run(os.path.join(folder, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _components(layers):
    for entry in layers:
        for step in ("attention", "mlp"):
            yield from ((entry["layer"], step, name, c) for name, c in entry[step]["components"].items())


def test_local_batches_split_the_single_process_partition(monkeypatch):
    roles = distributed.global_roles(12)
    assert roles == ["moment"] * 10 + ["sample"] * 2  # the last ~15 % feed thresholds, as collect_inputs does
    monkeypatch.setattr(distributed, "active", lambda: True)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    seen = []
    for r in range(2):
        monkeypatch.setattr(distributed, "rank", lambda r=r: r)
        mine = distributed.local_batches(12)
        assert len(mine) == 6 and {k for _, k in mine[:3]} == {"moment", "sample"}  # prefixes hold both kinds
        seen += mine
    assert sorted(seen) == sorted(zip(range(12), roles))


def test_two_processes_match_one(tmp_path):
    _run(str(tmp_path / "single.pt"))
    torch.multiprocessing.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ref = torch.load(tmp_path / "single.pt", weights_only=False)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert ref["local_fit_batches"] == 12 and [r["local_fit_batches"] for r in ranks] == [6, 6]  # half the work each
    for got in ranks:
        for name, s in ref["stats"].items():
            g = got["stats"][name]
            assert g["count"] == s["count"]
            assert torch.allclose(g["moment"], s["moment"], rtol=1e-12, atol=1e-9)
            assert torch.equal(g["fit"], s["fit"]) and torch.equal(g["eval"], s["eval"])  # same rows, same order
        for method in RUNS:
            assert got[method]["flops"] == pytest.approx(ref[method]["flops"], abs=1e-9)
            for (l1, s1, n1, a), (l2, s2, n2, b) in zip(_components(ref[method]["layers"]),
                                                         _components(got[method]["layers"]), strict=True):
                assert (l1, s1, n1, a["kind"], a.get("rank")) == (l2, s2, n2, b["kind"], b.get("rank"))
                if a.get("threshold") is not None:
                    assert b["threshold"] == pytest.approx(a["threshold"], rel=1e-6, abs=1e-9)
            for e1, e2 in zip(ref[method]["layers"], got[method]["layers"]):
                assert e1["mlp"].get("shares") == e2["mlp"].get("shares")
