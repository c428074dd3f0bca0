"""Single-rank properties of the hybrid decoder (no context parallelism).

Document isolation, causality, layer-pattern and flavor parsing, flavor sizes, initialisation,
gradient reach, the fla backend on CPU and the positions-less direct call. The models are the
debug flavor with a small vocabulary, in float64 wherever logits are compared, so a leak shows
up far above rounding (the comparisons use 1e-12 absolute).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torchtitan.models.common.nn_modules import RMSNorm

from tests.dist_utils import max_abs
from torchtitan_cp.models import model_config, parse_layer_pattern
from torchtitan_cp.models.blocks.norm import GatedRMSNorm
from torchtitan_cp.models.mixers.attention import SoftmaxAttention
from torchtitan_cp.models.mixers.delta_net import DeltaNetMixer

VOCAB = 97
TOL = 1e-12  # float64: a real dependence moves logits by far more than this
CHANGED = 1e-8  # a perturbed document's logits must move by more than this
# Document lengths per row; every row starts a document. Row 0 has a document longer than the
# torch delta rule's 64-token chunk, a 1-token document and a document shorter than the conv
# width; row 1 begins with a short document, so the row boundary is also tested.
DOCS = [[66, 1, 2, 11], [3, 30, 47]]
B, L = len(DOCS), sum(DOCS[0])
PATTERNS = ["K", "G", "A", "KGA"]


def positions_for(docs: list[list[int]]) -> torch.Tensor:
    rows = [torch.cat([torch.arange(n) for n in row]) for row in docs]
    return torch.stack(rows)


def doc_ranges(docs: list[list[int]]) -> list[tuple[int, int, int]]:
    """(row, start, stop) of every document."""
    out = []
    for r, row in enumerate(docs):
        start = 0
        for n in row:
            out.append((r, start, start + n))
            start += n
    return out


@functools.cache
def _model(pattern: str, seed: int = 0):
    torch.manual_seed(seed)
    model = model_config("debug", layer_pattern=pattern, vocab_size=VOCAB).build()
    model.init_states()
    return model.double().eval()


def _tokens(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (B, L), generator=g)


def _perturb(tokens: torch.Tensor, row: int, start: int, stop: int, seed: int) -> torch.Tensor:
    """A copy with every token of ``[start, stop)`` in ``row`` replaced by a different one."""
    g = torch.Generator().manual_seed(seed)
    out = tokens.clone()
    shift = torch.randint(1, VOCAB, (stop - start,), generator=g)
    out[row, start:stop] = (tokens[row, start:stop] + shift) % VOCAB
    return out


def _logits(model, tokens, positions) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens, positions)


# 1. No information flows between documents.


@pytest.mark.parametrize("pattern", PATTERNS)
def test_documents_do_not_see_each_other(pattern):
    model = _model(pattern)
    tokens, positions = _tokens(), positions_for(DOCS)
    base = _logits(model, tokens, positions)
    docs = doc_ranges(DOCS)
    for i, (r, a, b) in enumerate(docs):
        new = _logits(model, _perturb(tokens, r, a, b, seed=10 + i), positions)
        assert max_abs(new[r, a:b], base[r, a:b]) > CHANGED, (pattern, (r, a, b))
        for r2, a2, b2 in docs:
            if (r2, a2, b2) == (r, a, b):
                continue
            leak = max_abs(new[r2, a2:b2], base[r2, a2:b2])
            assert leak <= TOL, f"{pattern}: changing doc {(r, a, b)} moved doc {(r2, a2, b2)}"


@pytest.mark.parametrize("pattern", PATTERNS)
def test_document_start_does_not_depend_on_previous_document(pattern):
    """Each document's logits equal those of the same document alone in a row of its own:
    zero recurrent state, zero conv history and document-relative RoPE at every start."""
    model = _model(pattern)
    tokens, positions = _tokens(), positions_for(DOCS)
    packed = _logits(model, tokens, positions)
    for r, a, b in doc_ranges(DOCS):
        alone = _logits(model, tokens[r : r + 1, a:b], torch.arange(b - a)[None])
        diff = max_abs(packed[r, a:b], alone[0])
        assert diff <= TOL, f"{pattern}: doc {(r, a, b)} differs alone by {diff:.3g}"


@pytest.mark.parametrize("pattern", PATTERNS)
def test_isolation_check_is_sensitive(pattern):
    """Control for the two tests above: without the boundary (one document per row) the same
    perturbation of the first document does reach the first token of the next one."""
    model = _model(pattern)
    tokens = _tokens()
    one_doc = torch.arange(L).repeat(B, 1)
    base = _logits(model, tokens, one_doc)
    new = _logits(model, _perturb(tokens, 0, 0, DOCS[0][0], seed=3), one_doc)
    first_of_next = DOCS[0][0]
    assert max_abs(new[0, first_of_next], base[0, first_of_next]) > CHANGED


# 2. Causality.


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("row, t", [(0, 0), (0, 40), (0, 66), (0, 70), (1, 20), (1, L - 1)])
def test_causality(pattern, row, t):
    """Changing token t moves no logit before t in the packed stream (earlier tokens of the same
    document, earlier documents, earlier rows), and does move the logits at t."""
    model = _model(pattern)
    tokens, positions = _tokens(), positions_for(DOCS)
    base = _logits(model, tokens, positions).reshape(B * L, -1)
    new = _logits(model, _perturb(tokens, row, t, t + 1, seed=7), positions).reshape(B * L, -1)
    s = row * L + t
    assert max_abs(new[:s], base[:s]) <= TOL, f"{pattern}: token {(row, t)} moved earlier logits"
    assert max_abs(new[s], base[s]) > CHANGED


# 3. Layer pattern and flavor parsing.


def test_parse_layer_pattern():
    assert parse_layer_pattern("KGA") == ["kda", "gdn", "attention"]
    assert parse_layer_pattern("KKKA") == ["kda", "kda", "kda", "attention"]
    with pytest.raises(ValueError, match="empty"):
        parse_layer_pattern("")
    with pytest.raises(ValueError, match="X, Z"):
        parse_layer_pattern("KXGZ")
    with pytest.raises(ValueError, match="a, g, k"):  # letters are case-sensitive
        parse_layer_pattern("kga")


def test_model_config_errors():
    with pytest.raises(ValueError, match="'nope'"):
        model_config("nope")
    with pytest.raises(ValueError, match="bogus"):
        model_config("debug", bogus=1)
    with pytest.raises(ValueError, match="Q"):
        model_config("debug", layer_pattern="KQA")
    with pytest.raises(ValueError, match="'bogus'"):
        model_config("debug", linear_attention_backend="bogus")
    cfg = model_config("debug", layer_pattern="GA", vocab_size=VOCAB)
    assert (cfg.layer_pattern, cfg.vocab_size) == ("GA", VOCAB)


# 4. Flavor sizes.


@pytest.mark.parametrize(
    "flavor, low, high",
    [("debug", 0, 2_000_000), ("150M", 120e6, 180e6), ("1B", 0.85e9, 1.2e9)],
)
def test_flavor_parameter_counts(flavor, low, high):
    with torch.device("meta"):
        model = model_config(flavor).build()
    n = sum(p.numel() for p in model.parameters())  # tied weights count once
    assert low <= n < high, f"{flavor}: {n:,} parameters"


# 5. Initialisation.

INIT_PATTERN = "KGAKGA"


@functools.cache
def _init_model():
    """Built on meta, materialised as NaN and initialised, as the trainer does (meta ->
    to_empty -> init_states): every value read below was written by init_states."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = model_config("debug", layer_pattern=INIT_PATTERN).build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.init_states()
    return model


def test_init_writes_every_parameter():
    for name, p in _init_model().named_parameters():
        assert torch.isfinite(p).all(), f"{name} not initialised by init_states"


def test_init_gates_and_decay_parameters():
    model = _init_model()
    mixers = [m for m in model.modules() if isinstance(m, DeltaNetMixer)]
    assert sorted(m.kind for m in mixers) == ["gdn", "gdn", "kda", "kda"]
    x = torch.randn(1, 32, model.config.dim, generator=torch.Generator().manual_seed(0))
    for m in mixers:
        with torch.no_grad():
            g = m._gate(x)
        want = [1, 32, m.n_heads, m.head_dim] if m.kind == "kda" else [1, 32, m.n_heads]
        assert list(g.shape) == want
        assert (g < 0).all(), f"{m.kind}: gate not strictly negative (max {float(g.max())})"
        a_log = m.A_log.detach()
        assert (a_log >= 0).all() and (a_log <= math.log(16) + 1e-6).all(), a_log
        assert torch.isfinite(m.dt_bias).all()
        dt = F.softplus(m.dt_bias.detach())  # the documented dt range [1e-3, 1e-1]
        assert (dt >= 1e-3 * (1 - 1e-5)).all() and (dt <= 1e-1 * (1 + 1e-5)).all(), dt


def test_init_output_projections_are_depth_scaled():
    model = _init_model()
    trunc = 0.9867  # std of a normal truncated at ±3σ, relative to σ
    for i, block in enumerate(model.layers.values()):
        mixer = block.mixer
        if isinstance(mixer, SoftmaxAttention):
            w_in, w_out = mixer.wq.weight, mixer.wo.weight
        else:
            w_in, w_out = mixer.q_proj.weight, mixer.o_proj.weight
        ffn = block.feed_forward
        out_std = 0.02 / math.sqrt(2 * (i + 1)) * trunc
        for name, win, wout in [("mixer", w_in, w_out), ("ffn", ffn.w1.weight, ffn.w2.weight)]:
            s_in, s_out = float(win.detach().std()), float(wout.detach().std())
            assert s_out < s_in, f"layer {i} {name}: out std {s_out:.4g} >= in std {s_in:.4g}"
            assert abs(s_in / (0.02 * trunc) - 1) < 0.1, (i, name, s_in)
            assert abs(s_out / out_std - 1) < 0.1, (i, name, s_out, out_std)


def test_init_norms_are_ones_and_biases_zero():
    model = _init_model()
    norms = [m for m in model.modules() if isinstance(m, (RMSNorm, GatedRMSNorm))]
    # 2 per block, the final norm, and one gated output norm per KDA/GDN mixer
    assert len(norms) == 2 * len(INIT_PATTERN) + 1 + 4
    for m in norms:
        assert torch.equal(m.weight, torch.ones_like(m.weight))
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            assert torch.equal(p, torch.zeros_like(p)), name


# 6. Gradients reach every parameter.


def test_gradients_reach_every_parameter():
    torch.manual_seed(0)
    model = model_config("debug", layer_pattern="KGA", vocab_size=VOCAB).build()
    model.init_states()
    model = model.double()
    tokens, positions = _tokens(), positions_for(DOCS)
    logits = model(tokens[:, :24], positions[:, :24])
    # A random weighting (not a plain sum) so no gradient can vanish by symmetry.
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0), dtype=logits.dtype)
    (logits * w).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name}: no gradient"
        assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient"
        assert p.grad.abs().max() > 0, f"{name}: all-zero gradient"


# 7. The fla backend on CPU tensors.


@pytest.mark.parametrize("pattern", ["K", "G"])
def test_fla_backend_on_cpu_is_a_clear_error(pattern, interpreter_off):
    model = model_config(
        "debug", layer_pattern=pattern, vocab_size=VOCAB, linear_attention_backend="fla"
    ).build()
    model.init_states()
    tokens = _tokens()[:, :8]
    with pytest.raises(ValueError, match="fla.*CUDA"):
        model(tokens, torch.arange(8).repeat(B, 1))


# 8. A direct call without positions.


@pytest.mark.parametrize("pattern", ["KGA", "A"])
def test_no_positions_means_one_document_per_row(pattern):
    model = _model(pattern)
    tokens = _tokens()
    without = _logits(model, tokens, None)
    rows = _logits(model, tokens, torch.arange(L).repeat(B, 1))
    # Bitwise: without positions every row's RoPE restarts at 0, exactly as arange per row.
    assert torch.equal(without, rows)
    # ... and not the multi-document reading of the same tokens.
    assert max_abs(without, _logits(model, tokens, positions_for(DOCS))) > CHANGED
