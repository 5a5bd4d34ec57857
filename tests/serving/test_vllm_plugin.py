"""moesq's vLLM plugin against the real vLLM wheel (its Python layers, on the CPU): the entry point registers the
`moesq` method; `vllm.config.ModelConfig(model=pack)` is claimed by moesq for p48-nvfp4 (both layouts) and s24-fp8
packs and by stock compressed-tensors for dense-nvfp4 and dense-fp8 (a plugin that failed to import would leave
every pack to compressed-tensors, so each test asserts who claimed it); vLLM's own expert-parameter mapping and
weight loader put every expert tensor into exactly one parameter, tensor-parallel shards included; the layer's
`apply` (one custom op) gives exactly the reference experts module of the pack's files. The tests that need vLLM
skip without it; CI installs the pinned wheel."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from moesq_core.formats import get_format
from moesq_core.naming import PROJECTIONS, parse_expert_tensor
from moesq_core.serving.experts import MoesqExperts

from conftest import PACK_FORMATS, REPO, finished_stage, routing

# pack name -> (format, dense layout) and the method vLLM must pick for it
PACKS = {"p48-nvfp4": ("p48-nvfp4", False), "p48-nvfp4-dense": ("p48-nvfp4", True), "s24-fp8": ("s24-fp8", False),
         "dense-nvfp4": ("dense-nvfp4", False), "dense-fp8": ("dense-fp8", False)}
CLAIMED = ("p48-nvfp4", "p48-nvfp4-dense", "s24-fp8")
PLUGIN = "moesq_core.serving.vllm_plugin:register"


@pytest.fixture(scope="module")
def vllm_packs(packs, micro_path, tmp_path_factory):
    """{pack name: packed dir} of the micro model, one per PACKS entry."""
    from moesq_core.compression.export import export_packed

    out = {fmt: packs[fmt][1] for fmt in PACK_FORMATS}
    root = tmp_path_factory.mktemp("vllm-packs")
    export_packed(packs["p48-nvfp4"][0], "init-rtn", root / "p48-nvfp4-dense", sparse_layout=False)
    out["p48-nvfp4-dense"] = root / "p48-nvfp4-dense"
    export_packed(finished_stage(micro_path, root / "wd-dense-fp8", "dense-fp8"), "init-rtn", root / "dense-fp8")
    out["dense-fp8"] = root / "dense-fp8"
    return out


@pytest.fixture(scope="module")
def vllm():
    """vLLM with moesq's plugin loaded the way vLLM loads it (its `vllm.general_plugins` entry points)."""
    vllm = pytest.importorskip("vllm", reason='vLLM is not installed (pip install ".[vllm]")')
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return vllm


# -- without vLLM --------------------------------------------------------------------------------------------------
def test_pyproject_declares_the_entry_point_and_extra():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"]["moesq"] == PLUGIN
    assert any(r.startswith("vllm") for r in project["optional-dependencies"]["vllm"])


def test_importing_the_plugin_imports_neither_vllm_nor_torch():
    script = ("import sys, moesq_core.serving.vllm_plugin as p; assert callable(p.register); "
              "print(sorted(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_requirements_admit_the_installed_vllms_pins():
    """moesq's dependencies intersect every pin of the installed vLLM on the packages both name."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    try:
        pins = {Requirement(r).name.lower(): Requirement(r) for r in requires("vllm") or []}
    except PackageNotFoundError:
        pytest.skip("vLLM is not installed")
    ours = [Requirement(r) for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]]
    checked = 0
    for req in ours:
        pin = pins.get(req.name.lower())
        if pin is None or pin.marker is not None or not any(s.operator == "==" or s.operator == "<" for s in
                                                            pin.specifier):
            continue
        # the pinned version (==) or the newest allowed below a bound must satisfy ours
        exact = [s.version for s in pin.specifier if s.operator == "=="]
        if exact:
            assert req.specifier.contains(exact[0], prereleases=True), (req, pin)
        else:
            assert any(SpecifierSet(str(pin.specifier)).contains(v) and req.specifier.contains(v)
                       for v in _candidate_versions(pin.specifier)), (req, pin)
        checked += 1
    assert checked >= 3  # torch, compressed-tensors and transformers


def _candidate_versions(spec) -> list[str]:
    """Versions near the specifier's bounds (enough to find one inside a '>=a,<b' range)."""
    out = []
    for s in spec:
        parts = [int(p) for p in s.version.split(".")[:3] if p.isdigit()]
        while len(parts) < 3:
            parts.append(0)
        major, minor, patch = parts
        out += [s.version, f"{major}.{minor}.{patch + 1}", f"{major}.{max(minor - 1, 0)}.99"]
    return out


# -- registration and the claim ---------------------------------------------------------------------------------
def test_entry_point_registers_moesq_once(vllm):
    from importlib.metadata import entry_points

    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from moesq_core.serving.vllm_plugin import register
    from moesq_core.serving.vllm_plugin.config import MoesqConfig

    assert [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "moesq"] == [PLUGIN]
    assert get_quantization_config("moesq") is MoesqConfig
    register()
    register()
    assert QUANTIZATION_METHODS.count("moesq") == 1


@pytest.mark.parametrize("name", list(PACKS))
def test_model_config_is_claimed_by_the_right_method(vllm, vllm_packs, name):
    from vllm.config import ModelConfig

    want = "moesq" if name in CLAIMED else "compressed-tensors"
    assert ModelConfig(model=str(vllm_packs[name])).quantization == want


def _copy_config(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg["quantization_config"]["moesq"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("name", ["p48-nvfp4", "dense-fp8"])
def test_unknown_moesq_version_or_format_is_refused(vllm, vllm_packs, name, tmp_path):
    from vllm.config import ModelConfig

    newer = _copy_config(vllm_packs[name], tmp_path / "v2", lambda m: m.update(version=2))
    with pytest.raises(Exception, match=r"moesq pack of version 2, but the installed moesq reads version 1"):
        ModelConfig(model=str(newer))
    unknown = _copy_config(vllm_packs[name], tmp_path / "fmt", lambda m: m.update(format="q3-int2"))
    with pytest.raises(Exception, match=r"unknown format 'q3-int2'"):
        ModelConfig(model=str(unknown))


def test_get_quant_method_serves_experts_and_leaves_linears_unquantized(vllm, vllm_packs):
    from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod

    from moesq_core.serving.vllm_plugin.moe import MoesqMoEMethod

    layer, _ = _moe_layer(vllm_packs["p48-nvfp4"], 0, 1, 0)
    assert isinstance(layer.quant_method, MoesqMoEMethod)
    gate = ReplicatedLinear.__new__(ReplicatedLinear)  # a linear the pack leaves dense (no process group needed)
    torch.nn.Module.__init__(gate)
    assert isinstance(layer.quant_config.get_quant_method(gate, "model.layers.0.mlp.gate"), UnquantizedLinearMethod)
    assert layer.quant_config.get_quant_method(torch.nn.LayerNorm(4), "model.norm") is None


# -- weights: vLLM's mapping and loader ---------------------------------------------------------------------------
def _vllm_context():
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    return set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu")))


def _moe_layer(pack: Path, block: int, tp: int, rank: int, **factory_args):
    """(vLLM's RoutedExperts of MoE block `block` of the pack, built by FusedMoEFactory for tensor-parallel rank
    `rank` of `tp` under the pack's MoesqConfig, the runner that loads it)."""
    import vllm.model_executor.layers.fused_moe.config as moe_config
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory
    from vllm.model_executor.layers.quantization import get_quantization_config

    cfg = json.loads((pack / "config.json").read_text())
    quant = get_quantization_config("moesq").from_config(cfg["quantization_config"])
    real_rank = moe_config.get_tensor_model_parallel_rank
    moe_config.get_tensor_model_parallel_rank = lambda: rank  # the rank vLLM's process group would give
    try:
        with _vllm_context():
            runner = FusedMoEFactory(
                num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"], hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["moe_intermediate_size"], params_dtype=torch.bfloat16, quant_config=quant,
                tp_size=tp, dp_size=1, pcp_size=1, prefix=f"model.layers.{block}.mlp.experts", **factory_args)
    finally:
        moe_config.get_tensor_model_parallel_rank = real_rank
    return runner.routed_experts, runner


def _pack_tensors(pack: Path, block: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    prefix = f"model.layers.{block}.mlp.experts."
    return {k[len(prefix):]: t for k, t in load_file(pack / "model.safetensors").items() if k.startswith(prefix)}


def _per_expert(tensors: dict[str, torch.Tensor], num_experts: int) -> list[dict[str, dict[str, torch.Tensor]]]:
    out = [{p: {} for p in PROJECTIONS} for _ in range(num_experts)]
    for name, t in tensors.items():
        _, e, p, suffix = parse_expert_tensor("x.mlp.experts." + name)
        out[e][p][suffix] = t
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("name", CLAIMED)
def test_every_expert_tensor_loads_into_exactly_one_parameter(vllm, vllm_packs, name):
    cfg = json.loads((vllm_packs[name] / "config.json").read_text())
    for block in range(cfg["num_hidden_layers"]):
        layer, runner = _moe_layer(vllm_packs[name], block, 1, 0)
        params = dict(layer.named_parameters())
        tensors = _pack_tensors(vllm_packs[name], block)
        assert len(tensors) == cfg["num_local_experts"] * 3 * len(layer.quant_method.suffixes)
        for k, t in tensors.items():
            loaded = list(runner.load_weights([(k, t)]))
            assert len(loaded) == 1, (k, loaded)
            suffix = k.rsplit(".", 1)[1]
            assert loaded[0].removeprefix("routed_experts.").endswith("_" + suffix), (k, loaded)
            assert params[loaded[0].removeprefix("routed_experts.")].dtype == t.dtype, k
        # every parameter was written, and holds exactly the pack's tensors
        got = layer.quant_method.packed_experts(layer)
        want = _per_expert(tensors, cfg["num_local_experts"])
        for e in range(cfg["num_local_experts"]):
            for p in PROJECTIONS:
                assert set(got[e][p]) == set(want[e][p])
                for s, t in want[e][p].items():
                    assert got[e][p][s].shape == t.shape and torch.equal(_bits(got[e][p][s]), _bits(t)), (e, p, s)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", CLAIMED)
def test_tensor_parallel_shards_reassemble_to_the_packs_tensors(vllm, vllm_packs, name, tp):
    cfg = json.loads((vllm_packs[name] / "config.json").read_text())
    tensors = _pack_tensors(vllm_packs[name], 1)
    want = _per_expert(tensors, cfg["num_local_experts"])
    shards = []
    for rank in range(tp):
        layer, runner = _moe_layer(vllm_packs[name], 1, tp, rank)
        assert layer.intermediate_size_per_partition == cfg["moe_intermediate_size"] // tp
        assert len(list(runner.load_weights(tensors.items()))) == len(tensors)
        shards.append(layer.quant_method.packed_experts(layer))
    for e in range(cfg["num_local_experts"]):
        for p in PROJECTIONS:
            dim = -1 if p == "down" else 0  # down is split along its input columns, gate and up along their rows
            for s, t in want[e][p].items():
                parts = [shard[e][p][s] for shard in shards]
                if parts[0].shape == t.shape:  # replicated: per-tensor scalars, down's per-row scales
                    assert all(torch.equal(_bits(q), _bits(t)) for q in parts), (e, p, s)
                else:
                    assert torch.equal(_bits(torch.cat(parts, dim)), _bits(t)), (e, p, s)


def test_layers_moesq_cannot_serve_are_refused_with_the_reason(vllm, vllm_packs):
    with pytest.raises(ValueError, match=r"p48-nvfp4 cannot hold this layer's experts split for tensor parallelism "
                                         r"\(intermediate size 16 per partition\)"):
        _moe_layer(vllm_packs["p48-nvfp4"], 0, 8, 0)  # 128 / 8 columns: less than one 32-column scale block
    with pytest.raises(NotImplementedError, match=r"the gelu activation \(moesq experts compute SwiGLU\)"):
        _moe_layer(vllm_packs["s24-fp8"], 0, 1, 0, activation="gelu")


# -- the op --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CLAIMED)
@torch.no_grad()
def test_apply_is_one_op_equal_to_the_reference_experts(vllm, vllm_packs, name):
    cfg = json.loads((vllm_packs[name] / "config.json").read_text())
    moesq = cfg["quantization_config"]["moesq"]
    tensors = _pack_tensors(vllm_packs[name], 2)
    layer, runner = _moe_layer(vllm_packs[name], 2, 1, 0)
    list(runner.load_weights(tensors.items()))
    layer.quant_method.process_weights_after_loading(layer)
    assert not [n for n, _ in layer.named_parameters(recurse=False)]  # the packed copies are released
    ref = MoesqExperts.from_packed(get_format(moesq["format"]), _per_expert(tensors, cfg["num_local_experts"]),
                                   moesq["act_quant"])
    H, E, k = cfg["hidden_size"], cfg["num_local_experts"], cfg["num_experts_per_tok"]
    calls = []
    real = torch.ops.moesq.routed_experts
    for T, seed in ((1, 0), (7, 1), (33, 2)):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        ids, w = routing(T, E, k, seed=seed)
        with torch.profiler.profile() as prof:
            got = layer.quant_method.apply(layer, x, w, ids.to(torch.int32))
        calls.append(sum(e.key == "moesq::routed_experts" for e in prof.key_averages() for _ in range(e.count)))
        assert got.dtype == x.dtype and torch.equal(got, ref(x, ids, w)), (T, seed)
    assert calls == [1, 1, 1]
    x = torch.randn(5, H).to(torch.bfloat16)
    ids, w = routing(5, E, k, seed=3)
    torch.library.opcheck(real.default, (x, ids.to(torch.int32), w, layer.layer_name))


@pytest.mark.parametrize("name", list(PACKS))
def test_model_card_says_how_vllm_serves_the_pack(vllm_packs, name):
    card = (vllm_packs[name] / "README.md").read_text()
    assert ("`vllm serve DIR`: moesq's vLLM plugin claims this pack" in card) == (name in CLAIMED)
    assert ("not verified: a run of vLLM itself on a GPU" in card) == (name in CLAIMED)
