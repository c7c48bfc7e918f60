"""Adapter kinds register themselves and describe themselves (rana.modules.registry, issue 26 item 1).

* every registered kind's declarations hold for a module of it (its linear children are its nn.Linear
  children, a refit kind's scores are as wide as its mask, ...);
* a kind that forgets a declaration fails when it registers;
* what ships with an export is derived from the registered kinds, and the template names none;
* adding a kind is one new module in rana/modules/: a toy kind written to a new file (put on the
  package's path, never into the repository) is saved, loaded, LoRA-targeted, blended by the
  self-guided start, metered, quantized with its threshold refit, and exported (loaded by plain
  transformers in a fresh process), with no other file of rana edited.
Tiny models, CPU.
"""
from __future__ import annotations

import importlib
import sys

import pytest
import torch
import torch.nn as nn

import rana
import rana.io as rio
import rana.modules
from helpers import exported_logits, tiny_model
from rana.accounting import measured_macs, metering
from rana.export import SHIPPED_MODULES, export, render_sources
from rana.export.render import TEMPLATE_DIR, shipped_modules
from rana.finetune import resolve_lora_targets
from rana.finetune.guidance import guided_kinds, guided_sites
from rana.modules.int8 import Int8Linear, holds_int8
from rana.modules.rebuild import install_empty_adapters
from rana.modules.registry import ADAPTER_KINDS, adapter_class, adapter_classes, register_adapter
from rana.quantize.run import quantize_model

pytestmark = pytest.mark.usefixtures("one_thread")

# one example entry per registered kind (rana_config.json's form), built on `_root()`; a new kind adds its own
EXAMPLES = {
    "rank": {"path": "rank", "in": 8, "out": 6, "rank": 3, "bias": True, "threshold": 0.1},
    "shared_code": {"path": "code", "in": 8, "out": 6, "rank": 3, "consumers": 3, "threshold": 0.1},
    "rank_slice": {"path": "slice", "out": 2, "rank": 3, "bias": False, "code": "code"},
    "neuron": {"path": "neuron", "in": 8, "out": 6, "bias": True, "threshold": 0.1},
    "input_sparse": {"path": "input_sparse", "in": 8, "out": 6, "bias": False, "threshold": 0.1},
    "sparse_lowrank": {"path": "sparse_lowrank", "in": 8, "out": 6, "rank": 2, "bias": True, "threshold": 0.1},
    "input_sparse_head": {"path": "head", "in": 8, "out": 6, "bias": False, "threshold": 0.1, "tied": False},
    "cats": {"path": "act", "hidden": 8, "intermediate": 6, "threshold": 0.1},
    "rotated_input": {"path": "norm", "in": 8, "block": "mlp"},
    "moe_input_sparse": {"path": "experts", "experts": 2, "in": 8, "inter": 4, "top_k": 1, "act": "silu"},
}


def _root() -> nn.Module:
    """What the example entries replace or wrap: an activation (cats) and a norm (rotated_input)."""
    root = nn.Module()
    root.act, root.norm = nn.SiLU(), nn.LayerNorm(8)
    return root


@pytest.fixture(scope="module")
def built():
    """{spec_type: a module of that kind}, every registered kind built from its example entry."""
    missing = sorted(set(ADAPTER_KINDS) - set(EXAMPLES))
    assert not missing, f"add an example entry for the adapter kind(s) {missing} to EXAMPLES"
    root = _root()
    install_empty_adapters(root, [{"type": t, **s} for t, s in EXAMPLES.items()], torch.float32, "the test")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in root.parameters():
            p.normal_()
    return root, {t: root.get_submodule(s["path"]) for t, s in EXAMPLES.items()}


def test_registration_order_and_lookups():
    classes = adapter_classes()
    assert [c.spec_type for c in classes] == list(ADAPTER_KINDS)
    assert classes[:3] == (rana.modules.RankAdapterLinear, rana.modules.SharedRankCode, rana.modules.RankSliceLinear)
    from rana.modules.registry import ADAPTER_CLASSES  # computed from the registrations, when asked for

    assert ADAPTER_CLASSES == classes
    assert adapter_class(nn.Linear(2, 2)) is None


def test_every_kind_keeps_its_declarations(built):
    root, modules = built
    for spec_type, m in modules.items():
        cls = ADAPTER_KINDS[spec_type]
        assert adapter_class(m) is cls
        linears = tuple(n for n, c in m.named_children() if type(c) is nn.Linear)
        assert linears == cls.linear_children, spec_type
        if cls.bare_weights:
            assert m._parameters, f"{spec_type} declares weights of its own but holds none"
        if cls.rank_code:
            assert type(m.B) is nn.Linear
        if cls.norms_child is not None:
            m.refresh_norms()
        if cls.refit in ("own", "shared"):
            x = torch.randn(5, m.intermediate if spec_type == "cats" else m.in_features)
            scores = m.refit_scores(x)
            assert scores.shape == (5, m.mask_width()) and scores.dtype == torch.float32, spec_type
        if cls.refit == "owner":  # a slice: scored for its shared code's threshold
            assert m.threshold_owner() is modules["shared_code"] and modules["shared_code"].refit == "shared"
        if cls.self_guided == "unmasked":
            x = torch.randn(1, 4, m.in_features)
            assert m.unmasked(x).shape == m(x).shape
        if cls.groupable:
            assert cls.decode_mode is not None and m.decode_operands(torch.randn(1, m.in_features)) is not None
        if cls.int8_form is not None:
            assert holds_int8(m.int8_form())
        m.restore(root)  # after a load or a merge: runs on every kind


def test_a_kind_that_forgets_a_declaration_fails_when_it_registers():
    def kind(**attrs):
        base = {"spec_type": "forgetful", "spec_fields": {"in": "size"}, "to_spec": lambda self, root: {},
                "from_spec": classmethod(lambda cls, s, **_: cls()), "linear_children": (), "bare_weights": False,
                "decode_mode": None, "groupable": False, "self_guided": None, "refit": None, "rank_code": False,
                "norms_child": None, "restore": lambda self, root: None, "int8_form": None}
        return type("Forgetful", (nn.Module,), {k: v for k, v in {**base, **attrs}.items() if v is not ...})

    with pytest.raises(TypeError, match="declares no refit"):
        register_adapter(kind(refit=...))
    with pytest.raises(TypeError, match="self_guided must be one of"):
        register_adapter(kind(self_guided="blend"))
    with pytest.raises(TypeError, match="needs a method mask_width"):
        register_adapter(kind(refit="own"))
    with pytest.raises(TypeError, match="needs a method decode_operands"):
        register_adapter(kind(groupable=True, decode_mode="abs"))
    with pytest.raises(TypeError, match="spec_type 'rank' is RankAdapterLinear's"):
        register_adapter(kind(spec_type="rank"))
    assert "forgetful" not in ADAPTER_KINDS


def test_what_ships_is_derived_from_the_registered_kinds():
    shipped = shipped_modules()
    assert shipped == SHIPPED_MODULES
    assert {cls.__module__ for cls in adapter_classes()} <= set(shipped)
    assert {"rana.modules.rebuild", "rana.modules.registry", "rana.kernels.ops", "rana.errors"} <= set(shipped)
    template = (TEMPLATE_DIR / "modeling_rana.py").read_text(encoding="utf-8")
    for cls in adapter_classes():
        assert cls.__name__ not in template, f"the template names {cls.__name__}"


# ---------------------------------------------------------------------------------------------- a new kind
TOY_MODULE = "toy_scaled_sparse"
TOY_SOURCE = '''"""A toy adapter kind (tests/test_adapter_registry.py): `s ⊙ W (m ⊙ x)`, m_j = 1{|x_j| ≥ t}, s per output."""
from __future__ import annotations

import torch
import torch.nn as nn

from .common import Adapter, MacMeter, MaskedDecode, column_major_linear
from .registry import register_adapter


@register_adapter
class ScaledInputSparse(MaskedDecode, MacMeter, Adapter, nn.Module):
    # what differs from the Adapter defaults
    spec_type = "toy_scaled_input_sparse"
    spec_fields = {"in": "size", "out": "size", "threshold": "threshold"}
    linear_children = ("linear",)
    decode_mode = "abs"
    self_guided = "unmasked"
    refit = "own"

    def __init__(self, weight: torch.Tensor, threshold: float):
        super().__init__()
        self.linear = column_major_linear(weight)
        self.scale = nn.Parameter(torch.ones(weight.shape[0], dtype=weight.dtype))
        self.register_buffer("threshold", torch.tensor(float(threshold), dtype=torch.float32))
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.macs_dense = float(self.in_features * self.out_features)
        self._init_meter()

    def to_spec(self, root: nn.Module) -> dict:
        return {"in": self.in_features, "out": self.out_features, "threshold": float(self.threshold)}

    @classmethod
    def from_spec(cls, s: dict, zeros, threshold: float, **_):
        return cls(zeros(s["out"], s["in"]), threshold)

    def unmasked(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.linear(x)

    def mask_width(self) -> int:
        return self.in_features

    def refit_scores(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().abs()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.decode_masked(self._modules["linear"], x, self._buffers["threshold"])
        if y is None:
            mask = x.abs() >= self.threshold
            self._record(mask)
            y = self.linear(x * mask)
        return self.scale * y

    def measured_macs(self) -> float:
        return self.out_features * self.mean_active()
'''


@pytest.fixture
def toy_kind(tmp_path, monkeypatch):
    """The toy kind as a new module of rana.modules (its file in a folder added to the package's path),
    unregistered afterwards."""
    folder = tmp_path / "new_kinds"
    folder.mkdir()
    (folder / f"{TOY_MODULE}.py").write_text(TOY_SOURCE, encoding="utf-8")
    monkeypatch.setattr(rana.modules, "__path__", [*rana.modules.__path__, str(folder)])
    name = f"rana.modules.{TOY_MODULE}"
    try:
        yield importlib.import_module(name).ScaledInputSparse
    finally:
        ADAPTER_KINDS.pop("toy_scaled_input_sparse", None)
        sys.modules.pop(name, None)
        if hasattr(rana.modules, TOY_MODULE):
            delattr(rana.modules, TOY_MODULE)


def _with_toy(model: nn.Module, kind: type, path: str) -> None:
    """`path` (an nn.Linear) replaced by the toy kind, its threshold the median |input| seen on a batch."""
    seen = []
    linear = model.get_submodule(path)
    handle = linear.register_forward_pre_hook(lambda _m, args: seen.append(args[0].abs().flatten()))
    with torch.no_grad():
        model(torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5)))
    handle.remove()
    toy = kind(linear.weight.detach(), float(torch.cat(seen).median()))
    with torch.no_grad():
        toy.scale.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(6))
    parent, leaf = path.rsplit(".", 1)
    setattr(model.get_submodule(parent), leaf, toy)


def test_a_new_kind_is_one_module(toy_kind, tmp_path):
    path = "model.layers.1.mlp.down_proj"
    model = tiny_model("llama").eval()
    _with_toy(model, toy_kind, path)
    prompt = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = model(prompt).logits

    # written and read back: rana_config.json, the schema, rana.load's rebuild
    folder = rio.save(model, None, tmp_path / "folder")
    assert [a["type"] for a in rio.read_meta(folder)["adapters"]] == ["toy_scaled_input_sparse"]
    loaded, _ = rana.load(folder)
    assert type(loaded.get_submodule(path)) is toy_kind
    with torch.no_grad():
        torch.testing.assert_close(loaded(prompt).logits, want)
        torch.testing.assert_close(loaded(prompt[:, :1]).logits, model(prompt[:, :1]).logits)  # one decode token

    # fine-tuning: LoRA wraps its linear child, the self-guided start blends it
    assert resolve_lora_targets(loaded, "adapters") == [f"{path}.linear"]
    assert toy_kind in guided_kinds() and guided_sites(loaded) == [path]

    # the FLOP accounting reads its meter
    with metering(loaded):
        with torch.no_grad():
            loaded(prompt)
    assert 0 < measured_macs(loaded)["modules"][path]["mean_active"] < loaded.get_submodule(path).in_features

    # exported: its module ships, and plain transformers rebuilds it in a fresh process without rana
    assert f"{TOY_MODULE}.py" in render_sources(loaded.config, type(loaded))
    out = export(folder, tmp_path / "exported", format="remote-code")
    assert (out / f"{TOY_MODULE}.py").is_file()
    got = exported_logits(out, prompt, tmp_path, model_check=f"assert type(m.get_submodule({path!r})).__name__ "
                                                          "== 'ScaledInputSparse'")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    # int8: its linear child quantized, its threshold refit on the quantized model's activations
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(8))
    report = quantize_model(loaded, ids, batch_size=2)
    assert type(loaded.get_submodule(path).linear) is Int8Linear
    assert path in report["refit"] and report["refit"][path]["threshold_after"] is not None
