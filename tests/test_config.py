"""TOML + CLI configuration: precedence, and clear errors for bad input."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from tests.launch import REPO, run_module
from torchtitan_cp.train import load_config
from torchtitan_cp.trainer.config import ConfigError


def write(tmp_path, text: str):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return str(p)


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    path = write(
        tmp_path,
        '[model]\nflavor = "debug"\nlayer_pattern = "GGGA"\n'
        "[training]\nsteps = 7\nseq_len = 128\n"
        '[linear_attention]\nrouting_source = "device_readback"\n',
    )
    cfg = load_config(["--config_file", path, "--training.steps", "3"])
    assert cfg.training.steps == 3  # CLI beats TOML
    assert cfg.training.seq_len == 128  # TOML beats default
    assert cfg.training.local_batch_size == 2  # recipe default
    assert cfg.model.layer_pattern == "GGGA"
    assert cfg.linear_attention.routing_source == "device_readback"
    cfg = load_config(["--config_file", path, "--model.layer_pattern", "KA"])
    assert cfg.model.layer_pattern == "KA"


def test_shipped_configs_load():
    for name in ("debug_cpu", "debug_mamba2_cpu", "gpu_kda_1b", "gpu_gdn_1b"):
        cfg = load_config(["--config_file", str(REPO / "configs" / f"{name}.toml")])
        assert cfg.model.flavor


# ConfigError (a ValueError) for what the config file itself gets wrong; a plain ValueError for
# values the model or the plan cache refuse.
@pytest.mark.parametrize(
    "text, error, message",
    [
        ("[training]\nstepz = 3\n", ConfigError, "unknown key 'training.stepz'"),
        ("[training]\nsteps = 'three'\n", ConfigError, "key 'training.steps' expects int"),
        ("[metrics]\nenable_wandb = 1\n", ConfigError, "key 'metrics.enable_wandb' expects bool"),
        ("[nonsense]\nx = 1\n", ConfigError, "unknown key 'nonsense'"),
        (
            "[linear_attention]\nrouting_source = 'gpu'\n",
            ConfigError,
            "linear_attention.routing_source",
        ),
        ("[training\n", ConfigError, "invalid TOML"),
        ('[model]\nflavor = "huge"\n', ValueError, "unknown model.flavor 'huge'"),
        ('[model]\nlayer_pattern = "KXA"\n', ValueError, "unknown layer letter(s) X"),
        ("[linear_attention]\nplan_cache_size = 0\n", ValueError, "plan_cache_size must be >= 1"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path, text, error, message):
    path = write(tmp_path, text)
    with pytest.raises(error, match=re.escape(message)):
        load_config(["--config_file", path])


# Before: "key 'model.attention_cp' expects Optional, got str 'passkv'" from the file, and from
# the command line tyro's choices in an order that changed between runs, 'None' among them.
@pytest.mark.parametrize(
    "key, allowed, cli_extra",
    [
        ("model.attention_cp", "'all_gather', 'pass_kv'", " (or None to leave it unset)"),
        ("linear_attention.backend", "'auto', 'torch', 'fla'", ""),
        ("linear_attention.routing_source", "'host', 'device_readback'", ""),
    ],
)
def test_enum_keys_list_their_values_in_a_stable_order(tmp_path, key, allowed, cli_extra):
    section, name = key.split(".")
    path = write(tmp_path, f'[{section}]\n{name} = "passkv"\n')
    with pytest.raises(ConfigError) as e:
        load_config(["--config_file", path])
    assert str(e.value) == f"{path}: key '{key}' must be one of {allowed}, got 'passkv'"
    with pytest.raises(ConfigError) as e:
        load_config([f"--{key}", "passkv"])
    assert (
        str(e.value) == f"command line: --{key} must be one of {allowed}{cli_extra}, got 'passkv'"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="flex trains on CUDA")
def test_flex_attention_off_cuda_is_a_config_error(tmp_path):
    path = write(tmp_path, '[model]\nattention_backend = "flex"\n')
    with pytest.raises(ValueError, match="attention_backend = 'flex' cannot train on cpu"):
        load_config(["--config_file", path])
    # "auto" picks sdpa here; a layer pattern without attention never needs flex.
    load_config(["--config_file", write(tmp_path, '[model]\nattention_backend = "auto"\n')])
    no_attn = '[model]\nattention_backend = "flex"\nlayer_pattern = "KG"\n'
    load_config(["--config_file", write(tmp_path, no_attn)])


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return run_module("torchtitan_cp.train", *args)


@pytest.mark.slow
def test_cli_errors_are_one_line_and_exit_2(tmp_path):
    proc = run_cli("--config_file", str(tmp_path / "missing.toml"))
    assert proc.returncode == 2
    assert "config file not found" in proc.stderr
    assert "Traceback" not in proc.stderr
    bad = write(tmp_path, "[training]\nstepz = 3\n")
    proc = run_cli("--config_file", bad)
    assert proc.returncode == 2 and "unknown key 'training.stepz'" in proc.stderr


@pytest.mark.slow
def test_help_lists_options():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for option in ("--config_file", "--linear-attention.routing-source", "--model.flavor"):
        assert option.replace("-", "_") in proc.stdout.replace("-", "_")


def test_an_unboxed_error_keeps_its_message_not_its_title():
    """On a stream rich draws no box for (not UTF-8, or as under pytest's capture), tyro's
    title is a section of its own; an invalid choice, whose message has no colon, came out as
    "command line: Invalid choice" (found by tests/test_failure_modes.py)."""
    from torchtitan_cp.train import _one_line

    box = (
        " Invalid choice                                          \n"
        " ------------------------------------------------------- \n"
        "  invalid choice 'passkv' for argument '--model.attention-cp'. Expected one of  \n"
        "  ('pass_kv', 'None', 'all_gather').                      \n"
        "  -------------------------------------------------------\n"
        "  For full helptext, run x --help                         \n"
    )
    assert _one_line(box).startswith("invalid choice 'passkv' for argument")
    boxed = "╭─ Unrecognized options ─╮\n│ Unrecognized options: --x │\n╰───╯\n"
    assert _one_line(boxed) == "Unrecognized options: --x"


def _help_of_every_option() -> dict[str, tuple[str, str]]:
    """``--option``: (its help text without tyro's default, its group's description) for every
    option ``python -m torchtitan_cp.train --help`` lists, subcommands' included."""
    import argparse
    import warnings

    import tyro.extras
    from torchtitan.config.manager import ConfigManager, custom_registry

    from torchtitan_cp.trainer.trainer import recipe_config

    config = recipe_config()
    ConfigManager.register_tyro_rules(custom_registry)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # get_parser: the parser --help prints
        parser = tyro.extras.get_parser(type(config), default=config, registry=custom_registry)
    found: dict[str, tuple[str, str]] = {}

    def walk(p: argparse.ArgumentParser) -> None:
        for group in p._action_groups:
            for action in group._group_actions:
                if isinstance(action, argparse._SubParsersAction):
                    for sub in action.choices.values():
                        walk(sub)
                elif action.option_strings and action.option_strings[0] not in ("-h", "--help"):
                    text = re.sub(r"\((default|fixed)[^)]*\)|\(required\)", "", str(action.help))
                    found[action.option_strings[0]] = (text.strip(), group.description or "")

    walk(parser)
    return found


def test_every_option_has_a_docstring_that_help_shows():
    """Every option of ``--help`` says what it does: a docstring under its config field,
    ``[model]``'s generated ones included (they carry the decoder fields'). The keys of a
    free-form dict (``optimizer_kwargs``: lr, betas, ...) have no field of their own: their
    dict's docstring, the group's description, says what they are."""
    options = _help_of_every_option()
    assert "--model.layer-pattern" in options and "--linear-attention.backend" in options
    assert "One letter per layer" in options["--model.layer-pattern"][0]
    bare = [
        name
        for name, (text, group) in options.items()
        if not text and not (".optimizer-kwargs." in name and group)
    ]
    assert not bare, f"options without a docstring: {bare}"
