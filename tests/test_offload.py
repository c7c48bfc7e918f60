"""Models bigger than memory (rana.compress.streaming / residency / memory): layers streamed from safetensors one at a time give
the same compressed model as an in-memory run; --max-memory is checked up front; and a ~600 MB
checkpoint compresses under a 400 MB cap with peak RSS well under the model size (subprocess)."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rana.compress import compress_model
from rana.io import WEIGHTS_INDEX, load, save
from rana.compress.memory import MemoryBudgetError, estimate_memory
from rana.compress.residency import disk_spill
from rana.compress.streaming import load_lazy
from rana.units import parse_memory
from helpers import tiny_calibration, tiny_compress_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest

ROOT = Path(__file__).resolve().parents[1]


def test_parse_memory():
    assert parse_memory("2GB") == 2 * 10**9
    assert parse_memory("512MiB") == 512 * 2**20
    assert parse_memory("1.5g") == 1_500_000_000
    assert parse_memory(None) is None
    with pytest.raises(ValueError, match="memory size"):
        parse_memory("lots")
    with pytest.raises(ValueError, match="memory size"):
        tiny_compress_config(max_memory="2 parsecs").validate()


def test_disk_spill_round_trips(tmp_path):
    spill = disk_spill(tmp_path / "acts")
    x = torch.randn(3, 5, 7)
    y = spill(x)
    assert torch.equal(x, y) and list((tmp_path / "acts").iterdir()) == []  # file unlinked, mapping alive


@pytest.mark.parametrize("arch", ["llama", "gemma", "gpt_neox"])  # plain, tied embeddings, renamed lm_head
def test_streamed_compression_equals_in_memory(arch, tmp_path):
    model = tiny_model(arch)
    model.save_pretrained(tmp_path / "src")
    config = tiny_compress_config(method="rana-paper", flops=0.75)
    in_memory = compress_model(model, None, config, tiny_calibration())
    save(in_memory.model, None, tmp_path / "mem", plan=in_memory.plan)

    lazy, _, weights = load_lazy(tmp_path / "src")
    assert all(p.device.type == "meta" for p in lazy.get_submodule(get_layers_path(lazy)).parameters())
    streamed = compress_model(lazy, None, tiny_compress_config(method="rana-paper", flops=0.75,
                                                               offload_dir=str(tmp_path / "off")), tiny_calibration(),
                              lazy_weights=weights)
    assert streamed.plan["measured_flops"] == in_memory.plan["measured_flops"]
    assert streamed.plan["memory"]["weights_home"].startswith("disk")
    assert in_memory.offloaded is None and streamed.offloaded is not None
    with pytest.raises(ValueError, match="offloaded=result.offloaded"):  # its layers are on disk, not in the model
        save(streamed.model, None, tmp_path / "no-layers", plan=streamed.plan)
    assert not (tmp_path / "no-layers").exists()
    save(streamed.model, None, tmp_path / "disk", plan=streamed.plan, offloaded=streamed.offloaded)
    assert (tmp_path / "disk" / WEIGHTS_INDEX).exists()  # one shard per layer + the rest

    ids = torch.randint(0, 128, (2, 16))
    a, _ = load(tmp_path / "mem")
    b, _ = load(tmp_path / "disk")
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def get_layers_path(model):
    from rana.archs import get_arch

    return get_arch(model.config).layers


def test_max_memory_too_small_is_a_clear_error():
    with pytest.raises(MemoryBudgetError, match=r"--max-memory 50kB is too small: .* needs about .*layer weights"):
        compress_model(tiny_model("llama"), None, tiny_compress_config(max_memory="50kB"), tiny_calibration())
    est = estimate_memory(tiny_model("llama").config, tiny_compress_config())
    assert est.parts["layer weights"] == 4 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 160 * 64)


BIG = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12, num_key_value_heads=12,
           vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)


def _write_big_checkpoint(folder: Path) -> int:
    """A ~600 MB float32 Llama-shaped checkpoint (16 layers of 38 MB), sharded per layer, written
    without ever holding the model: the shapes come from a meta-device model."""
    import transformers as tf
    from accelerate import init_empty_weights
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    config = tf.LlamaConfig(**BIG)
    config.save_pretrained(folder)
    with init_empty_weights():
        model = tf.LlamaForCausalLM(config)
    groups: dict[str, list] = {}
    for name, p in model.named_parameters():
        key = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        groups.setdefault(key, []).append((name, p.shape))
    g = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for i, (key, items) in enumerate(groups.items()):
        shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.02 for n, s in items}
        total += sum(t.numel() * 4 for t in tensors.values())
        save_file(tensors, str(folder / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in tensors})
    (folder / WEIGHTS_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


WORKER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import torch
    torch.set_num_threads(1)
    from helpers import tiny_calibration
    from rana.compress import CompressConfig, compress_model
    from rana.compress.streaming import load_lazy
    from rana.io import save

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    model, _, weights = load_lazy({src!r})
    before = status("VmRSS")
    try:  # reset the peak-RSS mark to the current RSS (Linux >= 4.0)
        open("/proc/self/clear_refs", "w").write("5")
    except OSError:
        pass
    config = CompressConfig(model="big", method="teal", flops=0.8, calib_tokens=1024, seq_len=32, batch_size=8,
                            max_memory="400MB", offload_dir={off!r})
    result = compress_model(model, None, config, tiny_calibration(n_fit=28, n_heldout=4, vocab=256),
                            lazy_weights=weights)
    save(result.model, None, {out!r}, plan=result.plan, offloaded=result.offloaded)
    print(json.dumps({{"rss_before": before, "peak": status("VmHWM"), "flops": result.plan["measured_flops"],
                      "estimate": result.plan["memory"]["estimate"]["total_bytes"]}}))
""")


def test_model_bigger_than_the_cap_compresses_with_small_peak_rss(tmp_path):
    size = _write_big_checkpoint(tmp_path / "src")
    assert size > parse_memory("400MB")
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(ROOT / "tests"), src=str(tmp_path / "src"), off=str(tmp_path / "off"),
                                    out=str(tmp_path / "out")))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    grew = r["peak"] - r["rss_before"]  # what compression added on top of the interpreter + embeddings
    print(f"model {size / 1e6:.0f} MB, peak RSS {r['peak'] / 1e6:.0f} MB, grew {grew / 1e6:.0f} MB, "
          f"estimate {r['estimate'] / 1e6:.0f} MB")
    assert grew < 0.5 * size
    assert grew < parse_memory("400MB")
    assert r["flops"] == pytest.approx(0.8, abs=0.01)
    meta = json.loads((tmp_path / "out" / "rana_config.json").read_text())
    assert len(meta["adapters"]) == 16 * 7  # every projection of every layer written
    index = json.loads((tmp_path / "out" / WEIGHTS_INDEX).read_text())
    assert len(set(index["weight_map"].values())) == 17
