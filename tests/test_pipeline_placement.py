"""Where pipeline stages fall (``models/blocks/pipeline.py``, ``models/hybrid/stages.py``): the
balance is the exact min-max cut, a split is the layer pattern with '|', the cost model
weighs attention by the context it reads, and ``--check`` prints the split."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from tests.test_validate import check
from torchtitan_cp.models.blocks.pipeline import StagePlan, balanced_boundaries, schedule_problem
from torchtitan_cp.models.hybrid.flavors import model_config
from torchtitan_cp.models.hybrid.stages import stage_plan


def _largest(costs: list[int], bounds: tuple[int, ...]) -> int:
    edges = [0, *bounds, len(costs)]
    return max(sum(costs[a:b]) for a, b in zip(edges, edges[1:]))


def test_balanced_boundaries_is_the_min_max_cut():
    """Against every cut of up to 8 units into 2-4 stages: no cut has a smaller largest part."""
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(2, 8)
        costs = [rng.randint(1, 50) for _ in range(n)]
        for stages in range(2, min(4, n) + 1):
            bounds = balanced_boundaries(costs, stages)
            assert len(bounds) == stages - 1 and list(bounds) == sorted(set(bounds))
            best = min(
                _largest(costs, cut) for cut in itertools.combinations(range(1, n), stages - 1)
            )
            assert _largest(costs, bounds) == best, (costs, stages, bounds)


def test_a_split_is_the_pattern_with_bars():
    plan = StagePlan.build("KGMRA", [1, 1, 1, 1, 1], 0, 2, "KG|MRA")
    assert plan.boundaries == (2,) and plan.split_text() == "KG|MRA"
    assert plan.module_names() == [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "layers.4", "norm", "lm_head"],
    ]
    for split, needle in (
        ("KG|MR", "must be model.layer_pattern 'KGMRA'"),
        ("KG||MRA", "no empty stage"),
        ("K|G|MRA", "has 3 stages, but this pipeline has 2"),
    ):
        with pytest.raises(ValueError, match=needle.replace("|", r"\|")):
            StagePlan.build("KGMRA", [1] * 5, 0, 2, split)


def test_attention_weighs_more_at_long_context():
    """150M (KKKA x 3) in 6 stages: at 4k tokens attention costs little more than KDA and the
    stages take two layers each (the LM head's stage one); at 128k an attention layer (12 x
    heads x head_dim x seq_len FLOPs per token) costs more than three KDA blocks and holds a
    stage alone."""
    cfg = model_config("150M")
    assert stage_plan(cfg, 6, 4096).split_text() == "KK|KA|KK|KA|KKK|A"
    long = stage_plan(cfg, 6, 131072)
    assert long.split_text() == "KKK|A|KKK|A|KKK|A"
    assert long.costs[1] > 3 * long.costs[0]


def test_schedule_rules():
    assert schedule_problem("1F1B", 2, 2, 2) is None
    assert "at least as many microbatches" in (schedule_problem("GPipe", 2, 2, 1) or "")
    assert "exactly two stages per rank" in (schedule_problem("ZBVZeroBubble", 2, 6, 4) or "")
    assert "rounds" in (schedule_problem("Interleaved1F1B", 2, 4, 5) or "")
    assert schedule_problem("InterleavedZeroBubble", 2, 4, 4) is None


def test_check_prints_the_split(capsys, tmp_path):
    pp = ["--parallelism.pipeline_parallel_degree", "2"]
    code, out, err = check(
        capsys, "--dump_folder", str(tmp_path), *pp, "--model.layer_pattern", "KGMRA"
    )
    assert (code, out) == (0, "2\n"), err
    assert "[mesh] pp 2 (2 processes)\n[pipeline] KGMR|A (cost model; MFLOPs/token" in err


def test_pipeline_models_are_the_registry_entries_with_a_stage_plan():
    from torchtitan_cp.models.recipe import MODELS, recipe_model
    from torchtitan_cp.trainer.validate import PIPELINE_MODELS

    have = [n for n in MODELS if recipe_model(n).stage_plan is not None]
    assert PIPELINE_MODELS == ", ".join(have) == "hybrid, qwen3_5, kimi_linear"


def test_qwen35_stages_follow_its_layer_letters():
    """Qwen3.5 2B (GGGA x 6, built on the meta device): the split is over its own letters. At
    4k tokens its LM head (6 x dim x 248320 vocab FLOPs per token) outweighs seven blocks, so
    the last stage holds one layer; at 256k each attention layer weighs more and the middle
    stages shrink to six and seven layers, the last growing to four."""
    from torchtitan_cp.models.qwen35.model import qwen35_config
    from torchtitan_cp.models.qwen35.stages import stage_plan as qwen35_plan

    cfg = qwen35_config("2B")
    short = qwen35_plan(cfg, 4, 4096)
    assert short.pattern == "GGGA" * 6 and short.source == "cost model"
    assert short.split_text() == "GGGAGGG|AGGGAGGG|AGGGAGGG|A"
    assert qwen35_plan(cfg, 4, 262144).split_text() == "GGGAGGG|AGGGAG|GGAGGGA|GGGA"
    with pytest.raises(ValueError, match="must be the qwen3_5 layers"):
        qwen35_plan(cfg, 2, 4096, "GG|GA")


def test_check_prints_the_qwen35_split(capsys, tmp_path):
    code, out, err = check(
        capsys,
        "--config_file",
        "configs/qwen35_debug_cpu.toml",
        "--dump_folder",
        str(tmp_path),
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "1",
    )
    assert (code, out) == (0, "2\n"), err
    assert "[pipeline] GGG|A (cost model; MFLOPs/token" in err


def test_kimi_linear_stages_count_the_experts_a_token_runs():
    """Kimi-Linear-48B-A3B (KKKA x 6 + KKA, built on the meta device): an MoE block costs the
    parameters a token runs (8 of its 256 routed experts, the router and shared expert in
    full), so the blocks a token runs total 2.7B of the model's 48B, and the split is over K/A
    letters. Counting all experts weighed every block alike and gave ``KKKAKKK|AKKKAKK|...`` at
    any length; with the active share the LM head and MLA's context cost decide."""
    from torchtitan_cp.models.blocks.pipeline import params_per_token
    from torchtitan_cp.models.kimi_linear.model import kimi_linear_config
    from torchtitan_cp.models.kimi_linear.stages import stage_plan as kimi_plan

    cfg = kimi_linear_config("48B-A3B")
    with torch.device("meta"):
        model = cfg.build()
    blocks = list(model.layers.values())
    moe = blocks[1].get_submodule("moe")
    routed = sum(p.numel() for p in moe.routed_experts.parameters())
    assert (moe.router.top_k, moe.router.num_experts) == (8, 256)
    every = sum(p.numel() for p in blocks[1].parameters())
    assert params_per_token(blocks[1]) == every - routed + routed * 8 // 256
    assert params_per_token(blocks[0]) == sum(p.numel() for p in blocks[0].parameters())
    assert 2.6e9 < sum(params_per_token(b) for b in blocks) < 2.8e9
    plan = kimi_plan(cfg, 4, 4096, model=model)
    assert plan.pattern == "KKKA" * 6 + "KKA" and plan.source == "cost model"
    assert plan.split_text() == "KKKAKKKA|KKKAKKK|AKKKAKKK|AKKA"
    with pytest.raises(ValueError, match="must be the kimi_linear layers"):
        kimi_plan(kimi_linear_config("debug"), 2, 256, "KK|AK")
