"""The layer registry and the Mamba2 layer.

* Every ``layer_pattern`` letter resolves through ``models.hybrid.layers.LAYERS``; the error for an
  unknown letter lists the registered ones; the FLOPs count is the registry's sum.
* ``[model]`` has every decoder field (no second copy): value_head_dim, conv_width, rope_theta
  and the Mamba2 options are settable from TOML and the command line.
* A kind has only its kernels' backends: ``fla`` for a kind without it is one line naming the
  key, the letter and what it has; ``auto`` builds it on what it has.
* The Mamba2 mixer equals a float64 token-by-token implementation of the reference layer
  (projection split, SiLU conv, softplus dt, exp(dt A) decay, dt-scaled x, D skip,
  rmsnorm(y * silu(z)) per group, output projection) over packed documents
  (``_check_on_documents``, the harness every layer kind's oracle test uses).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.reference import ssd_reference
from torchtitan_cp.models import model_config, parse_layer_pattern
from torchtitan_cp.models.hybrid.decoder import HybridDecoder
from torchtitan_cp.models.hybrid.layers import LAYERS, LayerOptions
from torchtitan_cp.models.mixers.mamba2 import Mamba2Mixer, Mamba2Options


def test_registry_letters() -> None:
    assert parse_layer_pattern("KGAM") == ["kda", "gdn", "attention", "mamba2"]
    with pytest.raises(ValueError, match=r"unknown layer letter\(s\) X; use K .*M \(Mamba2"):
        parse_layer_pattern("MXA")


def test_decoder_builds_registered_mixers_and_counts_their_flops() -> None:
    opts = LayerOptions(mamba2=Mamba2Options(head_dim=16, state_dim=8))
    cfg = model_config("debug", layer_pattern="MKA", vocab_size=97, layer_options=opts)
    model = cfg.build()
    assert isinstance(model.layers["0"].mixer, Mamba2Mixer)
    assert model.layers["0"].mixer.n_heads == 2 * cfg.dim // 16
    nparams, flops = cfg.get_nparams_and_flops(model, 128)
    emb = model.tok_embeddings.weight.numel()
    mixers = sum(LAYERS[c].flops(cfg, 128) for c in "MKA")
    assert flops == 6 * (nparams - emb) + mixers
    # Mamba2: 8 heads of 16 channels, state 8: update + readout 4·N·P, intra-chunk 64·(N+P).
    assert LAYERS["M"].flops(cfg, 128) == 6 * 8 * (4 * 8 * 16 + 64 * (8 + 16))


def test_heads_mixer_fields_come_from_the_decoder_or_keep_their_default() -> None:
    # A mixer's own constant can be a Config field: from_model copies only the fields the
    # decoder config has (rope_theta here) and leaves the others at the mixer's default.
    from torchtitan_cp.models.mixers.retention import RetentionMixer

    class Mixer(RetentionMixer):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(RetentionMixer.Config):
            window: int = 7

    cfg = dataclasses.replace(model_config("debug", layer_pattern="R"), rope_theta=123.0)
    mc = Mixer.from_model(cfg, 2, "torch")
    assert (mc.window, mc.rope_theta, mc.layer_id, mc.n_heads) == (7, 123.0, 2, cfg.n_heads)


def test_recipe_has_every_decoder_field() -> None:
    from torchtitan_cp.models.recipe import ModelRecipe

    recipe = {f.name for f in dataclasses.fields(ModelRecipe)}
    decoder = {f.name for f in dataclasses.fields(HybridDecoder.Config)}
    assert decoder - recipe == {"param_init", "sharding_config", "linear_attention_backend"}
    assert recipe - decoder == {"name", "flavor", "n_layers", "vision"}


def test_layer_fields_from_toml_and_cli(tmp_path) -> None:
    from torchtitan_cp.models import recipe_model_spec
    from torchtitan_cp.train import load_config

    toml = tmp_path / "m.toml"
    toml.write_text(
        '[model]\nlayer_pattern = "MGA"\nvalue_head_dim = 16\nconv_width = 3\n'
        "[model.layer_options.mamba2]\nhead_dim = 16\nstate_dim = 8\n"
    )
    config = load_config(
        [
            "--config_file",
            str(toml),
            "--model.rope_theta",
            "20000",
            "--model.layer_options.mamba2.n_groups",
            "2",
        ]
    )
    model = recipe_model_spec(config.model).model
    assert (model.value_head_dim, model.conv_width, model.rope_theta) == (16, 3, 20000.0)
    assert model.layer_options.mamba2 == Mamba2Options(head_dim=16, state_dim=8, n_groups=2)
    built = model.build()
    assert built.layers["0"].mixer.conv.width == 3


def test_bad_mamba2_sizes_name_the_keys() -> None:
    opts = LayerOptions(mamba2=Mamba2Options(head_dim=24))
    with pytest.raises(ValueError, match=r"model.layer_options.mamba2: expand\*dim = 128"):
        model_config("debug", layer_pattern="M", layer_options=opts)


def test_bad_mamba2_sizes_fail_the_prelaunch_check() -> None:
    # load_config runs the model checks (what ./scripts/train.sh's --check reports).
    from torchtitan_cp.train import load_config
    from torchtitan_cp.trainer.config import ConfigError

    with pytest.raises(ConfigError, match=r"heads a multiple of n_groups = 3"):
        load_config(
            [
                "--config_file",
                "configs/debug_mamba2_cpu.toml",
                "--model.layer_options.mamba2.n_groups",
                "3",
            ]
        )


def _reference_layer(m: Mamba2Mixer, x: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """The Mamba2 layer in float64, token by token per document (x ``[1, T, D]``)."""
    h, p, n, ng, di = m.n_heads, m.head_dim, m.state_dim, m.n_groups, m.d_inner
    # the reference's packed in_proj: the five projections' rows in its order
    in_proj = torch.cat([m.get_submodule(name).weight for name in m.in_projections])
    proj = x @ in_proj.double().T
    z, xbc, dt = proj.split([di, di + 2 * ng * n, h], -1)
    w = m.conv.weight.double()  # [C, W], column W-1 on the current token
    conv = torch.zeros_like(xbc)
    for a, b in zip(cu[:-1], cu[1:]):
        for t in range(a, b):
            for j in range(w.shape[1]):
                s = t - (w.shape[1] - 1) + j
                if s >= a:
                    conv[:, t] += w[:, j] * xbc[:, s]
    xbc = F.silu(conv)
    xx, B, C = xbc.split([di, ng * n, ng * n], -1)
    dt = F.softplus(dt + m.dt_bias.double())
    g = -torch.exp(m.A_log.double()) * dt
    xx = xx.unflatten(-1, (h, p))
    y, _ = ssd_reference(
        C.unflatten(-1, (ng, n)),
        B.unflatten(-1, (ng, n)),
        xx * dt[..., None],
        g,
        scale=1.0,
        cu_seqlens=cu,
    )
    y = (y + m.D.double()[:, None] * xx).flatten(-2)
    u = (y * F.silu(z)).unflatten(-1, (ng, -1))
    u = (u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + m.norm.eps)).flatten(-2)
    return (u * m.norm.weight.double()) @ m.out_proj.weight.double().T


def _check_on_documents(mixer, dim: int, reference) -> None:
    """The float64 ``mixer`` on two rows of two documents each (13 + 27 tokens) against
    ``reference(mixer, x [1, 80, D], cu_seqlens, positions [80])`` to 1e-10."""
    from torchtitan_cp.models.sequence import context_from_device_positions

    mixer = mixer.double()
    x = torch.randn(2, 40, dim, dtype=torch.float64)
    positions = torch.cat([torch.arange(13), torch.arange(27)]).expand(2, 40).contiguous()
    ctx = context_from_device_positions(x[..., 0].long(), positions, flex_mask=False)
    got = mixer(x, ctx, positions).reshape(1, 80, -1)
    want = reference(mixer, x.reshape(1, 80, -1), [0, 13, 40, 53, 80], positions.reshape(-1))
    assert (got - want).abs().max().item() <= 1e-10


@pytest.mark.parametrize("n_groups", [1, 2])
def test_mamba2_mixer_matches_reference(n_groups: int) -> None:
    torch.manual_seed(0)
    opts = Mamba2Options(head_dim=8, state_dim=4, n_groups=n_groups)
    mixer = Mamba2Mixer.Config(dim=16, options=opts, backend="torch").build()
    for mod in mixer.modules():
        if hasattr(mod, "reset_parameters"):
            mod.reset_parameters()
    with torch.no_grad():
        for name in mixer.in_projections:
            mixer.get_submodule(name).weight.normal_(0, 0.3)
        mixer.out_proj.weight.normal_(0, 0.3)
        mixer.norm.weight.uniform_(0.5, 1.5)
    _check_on_documents(mixer, 16, lambda m, x, cu, pos: _reference_layer(m, x, cu))


@pytest.mark.parametrize("letter", ["K", "G"])
def test_delta_net_decay_rate_is_float32_under_bf16_params(letter: str) -> None:
    """Under FSDP's bf16 param dtype the decay ``-exp(A_log) * softplus(f + dt_bias)`` is
    computed in float32 from the bf16 values: within 1e-6 of float64 (exp in bf16 was off by
    up to 2^-9, about 0.4 %)."""
    torch.manual_seed(0)
    cfg = model_config("debug", layer_pattern=letter, vocab_size=97)
    model = cfg.build()
    # build() allocates dt_bias (and A_log, the norms, the conv) with torch.empty: without
    # init_states the gate read whatever the allocator left there, and failed when an earlier
    # test (tests/test_fla_indices.py) left values that softplus or the 1e-6 bound could not
    # take (seen once under load).
    model.init_states()
    mixer = model.layers["0"].mixer.to(torch.bfloat16)
    with torch.no_grad():
        mixer.A_log.uniform_(-1.0, 2.5)  # decay rates e^-1 .. e^2.5, as init_decay spans
    x = torch.randn(1, 24, cfg.dim).to(torch.bfloat16)
    got = mixer._gate(x)
    assert got.dtype == torch.float32
    f, bias, _ = mixer._gate_logits(x)
    a = mixer.A_log.double().exp()
    a = a.view(mixer.n_heads, 1) if letter == "K" else a
    want = -a * F.softplus(f.double() + bias.double())
    rel = ((got.double() - want).abs() / want.abs().clamp(min=1e-30)).max().item()
    assert rel <= 1e-6, rel


def test_every_shipped_kind_compiles(monkeypatch) -> None:
    # Every registered letter has torch.compile custom ops (ops/<family>/custom_ops.py), so
    # compile.enable passes the config check with Mamba2 layers; a kind without them would be
    # refused before launch, naming it.
    from torchtitan_cp.models.hybrid.layers import Kernels
    from torchtitan_cp.train import load_config
    from torchtitan_cp.trainer.config import ConfigError

    assert all(kind.compiles for kind in LAYERS.values())
    args = ["--config_file", "configs/debug_mamba2_cpu.toml", "--compile.enable"]
    assert load_config(args).compile.enable
    no_ops = Kernels(LAYERS["M"].kernels.backends, compiles=False)
    monkeypatch.setitem(LAYERS, "M", dataclasses.replace(LAYERS["M"], kernels=no_ops))
    with pytest.raises(ConfigError, match=r"without torch.compile custom ops: M \(Mamba2"):
        load_config(args)


# Refused for layer T of ``register_torch_only_kind``; tests/test_failure_modes.py holds the
# documented line to the same refusal.
FLA_WITH_TORCH_ONLY_KIND = [
    "--config_file",
    "configs/debug_mamba2_cpu.toml",
    "--model.layer_pattern",
    "MTA",
    "--linear_attention.backend",
    "fla",
]


def register_torch_only_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registers letter T: Mamba2's mixer with its torch kernel only (no fla, no custom ops)."""
    from torchtitan_cp.models.hybrid.layers import Kernels

    only_torch = dataclasses.replace(
        LAYERS["M"],
        name="torch-only",
        description="SSD, torch only",
        kernels=Kernels(("torch",), compiles=False),
    )
    monkeypatch.setitem(LAYERS, "T", only_torch)


def test_a_kind_has_only_its_backends(monkeypatch) -> None:
    # A kind declares its kernels' backends. Register one with the torch kernel only (Mamba2's
    # mixer): backend = "fla" is refused in one line naming the key, the letter and what it has,
    # before launch; "auto" builds it on torch, while a kind with both keeps "auto" (fla on CUDA).
    from torchtitan_cp.train import load_config
    from torchtitan_cp.trainer.config import ConfigError

    register_torch_only_kind(monkeypatch)
    want = (
        r"^linear_attention.backend = 'fla': layer T \(SSD, torch only\) has no fla kernel, "
        r"only torch; use 'auto' or one of those$"
    )
    with pytest.raises(ValueError, match=want):
        model_config("debug", layer_pattern="TA", linear_attention_backend="fla")
    with pytest.raises(ConfigError, match=want):
        load_config(FLA_WITH_TORCH_ONLY_KIND)
    opts = LayerOptions(mamba2=Mamba2Options(head_dim=16, state_dim=8))
    model = model_config("debug", layer_pattern="TMA", layer_options=opts).build()
    assert model.layers["0"].mixer.backend == "torch"
    assert model.layers["1"].mixer.backend == "auto"
    assert LAYERS["T"].backend("auto") == "torch" and LAYERS["M"].backend("auto") == "auto"
    assert LAYERS["A"].backend("fla") == "fla"  # attention does not read the key
