"""docs/configuration.md's failure-mode table, held against the code so that it cannot drift.

Every line the table quotes (a backticked span of four words or more in a row's second column)
has a case here that makes the code write it: ``train --check`` in this process for what the
pre-launch check refuses, ``./scripts/train.sh`` for its own refusals, ``scripts/export_hf.py``
for the export's, and for what only a run meets (a busy lock, a resume plan, a checkpoint
that does not fit, a full disk, a silent rank, a spike, a signal) the very function that
writes the line, on real files. The documented line must then be found in what the code wrote:
its text literally, its placeholders (``D``, ``N``, ``FILE``, ``DIR``, ... in
``PLACEHOLDERS``) and elisions (``...``) as wildcards within one line.

A row whose line changes, a new quoted line without a case, or a case whose line left the
docs fails here with the line; ``CASES`` is keyed by the start of the documented line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import re
import shutil
import signal
import tempfile
import types
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from torchtitan_cp import compat

compat.apply()

from tests.dist_utils import free_port  # noqa: E402
from tests.helpers import flip  # noqa: E402
from tests.launch import REPO, train_sh  # noqa: E402
from tests.test_checkpoint_integrity import make_step  # noqa: E402
from torchtitan_cp.train import main  # noqa: E402

DOC = REPO / "docs" / "configuration.md"
PLACEHOLDERS = (
    "FILE",
    "DIR",
    "PATH",
    "PARENT",
    "RUN",
    "D",
    "N",
    "M",
    "P",
    "H",
    "T",
    "R",
    "O",
    "L",
    "X",
    "<run_id>",
)
QWEN = "configs/qwen35_debug_cpu.toml"
KIMI = "configs/kimi_linear_debug_cpu.toml"
TOKENIZER = REPO / "torchtitan_cp" / "assets" / "tokenizer"


def documented_lines(text: str) -> list[tuple[str, str]]:
    """(fault, line) for every quoted line of the failure-mode tables: the backticked spans
    of four words or more in the second column of each row under "## Failure modes"."""
    section = text[text.index("## Failure modes") :]
    out = []
    for row in section.splitlines():
        if not row.startswith("| ") or row.startswith(("| ---", "| fault ")):
            continue
        cells = [c.strip() for c in row.split(" | ")]
        if len(cells) < 3:
            continue
        for a, b in re.findall(r"``(.+?)``|`([^`]+)`", cells[1]):
            span = (a or b).strip()
            if len(span.split()) >= 4:
                out.append((cells[0].lstrip("| "), span))
    return out


def pattern(line: str) -> re.Pattern[str]:
    """``line`` as a regex: its text literal, ``...`` and the placeholders wildcards (within
    one line of output)."""
    names = "|".join(re.escape(p) for p in PLACEHOLDERS)
    # "..." with the spaces around it: "ranks ..." stands for "ranks; every rank ..."
    token = re.compile(rf"( ?\.\.\. ?)|(?<![\w<])({names})(?![\w>])")
    parts, at = [], 0
    for m in token.finditer(line):
        parts.append(re.escape(line[at : m.start()]))
        parts.append(".*?" if m.group(1) else ".+?")
        at = m.end()
    parts.append(re.escape(line[at:]))
    return re.compile("".join(parts))


# ----------------------------------------------------------------------------- what cases use


@dataclasses.dataclass
class Env:
    tmp: Path
    mp: pytest.MonkeyPatch
    capsys: Any
    shared: Shared


class Shared:
    """Files several cases start from, made once per module when first asked for."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._made: dict[str, Path] = {}

    def _once(self, name: str, make: Callable[[Path], None]) -> Path:
        if name not in self._made:
            path = self.root / name
            make(path)
            self._made[name] = path
        return self._made[name]

    def folder(self, config: str, flavor_model: bool = False) -> Path:
        """An HF folder of ``config``'s model as the export writes it (``flavor_model``: of
        Kimi Linear's debug flavor itself, vocabulary 1024, not the config file's 4096)."""

        def make(path: Path) -> None:
            from torchtitan_cp.models import recipe_model_spec
            from torchtitan_cp.train import load_config

            spec = recipe_model_spec(load_config(["--config_file", config]).model)
            cfg = spec.model
            if flavor_model:
                from torchtitan_cp.models.kimi_linear.model import kimi_linear_config

                cfg = kimi_linear_config("debug")
            torch.manual_seed(0)
            model = cfg.build()
            model.init_states()
            if config == QWEN:
                from torchtitan_cp.models.qwen35.hf import write_hf_folder
            else:
                from torchtitan_cp.models.kimi_linear.hf import write_hf_folder
            write_hf_folder(model, cfg, path, tokenizer_dir=TOKENIZER)

        return self._once(f"hf-{Path(config).stem}-{flavor_model}", make)

    def qwen_step(self) -> Path:
        """A sealed DCP step of the Qwen3.5 config's model (what the export reads)."""

        def make(path: Path) -> None:
            import torch.distributed.checkpoint as dcp

            from torchtitan_cp.models import recipe_model_spec
            from torchtitan_cp.run.manifest import write_manifest
            from torchtitan_cp.train import load_config

            model = recipe_model_spec(load_config(["--config_file", QWEN]).model).model.build()
            model.init_states()
            dcp.save(
                {k: v.detach().clone() for k, v in model.state_dict().items()},
                checkpoint_id=str(path),
            )
            write_manifest(str(path), step=10, run_id="r")

        return self._once("ckpt/step-10", make)


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Shared:
    return Shared(tmp_path_factory.mktemp("failure_modes"))


def check(env: Env, *argv: str, nproc: str = "2", dump: str | None = None) -> str:
    """``train --check`` in this process: exit 2 and one line, which it returns."""
    code = main(["--check", "--nproc", nproc, "--dump_folder", dump or str(env.tmp / "run"), *argv])
    err = env.capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def hf_check(env: Env, config: str, folder: Path) -> str:
    return check(
        env,
        "--config_file",
        config,
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_path",
        str(folder),
    )


def copied(env: Env, folder: Path) -> Path:
    copy = env.tmp / "hf"
    shutil.copytree(folder, copy)
    return copy


def edit_config(folder: Path, edit: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def edit_tensors(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def raised(fn: Callable[[], Any], kind: type[BaseException] = Exception) -> str:
    """The message ``fn()`` raises (it must raise ``kind``)."""
    with pytest.raises(kind) as e:
        fn()
    return str(e.value)


def export(env: Env, *argv: str, config: str = QWEN) -> str:
    """``scripts/export_hf.py`` in this process: exit 2 and one line, which it returns."""
    from tests.test_export_hf import _export_main

    code = _export_main()(["--config_file", config, *argv])
    err = env.capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    return err.strip()


# ----------------------------------------------------------------------------- the cases

CASES: dict[str, Callable[[Env], str]] = {}


def case(*keys: str) -> Callable[[Callable[[Env], str]], Callable[[Env], str]]:
    """Register a producer for the documented lines starting with each of ``keys``."""

    def register(fn: Callable[[Env], str]) -> Callable[[Env], str]:
        for key in keys:
            assert key not in CASES, key
            CASES[key] = fn
        return fn

    return register


def toml(env: Env, text: str) -> str:
    path = env.tmp / "c.toml"
    path.write_text(text)
    return check(env, "--config_file", str(path))


case("c.toml: unknown key")(lambda env: toml(env, "[training]\nstepz = 3\n"))
case("c.toml: key 'model.attention_cp'")(
    lambda env: toml(env, '[model]\nattention_cp = "passkv"\n')
)
case("command line: Unrecognized options")(lambda env: check(env, "--training.stepz", "3"))
case("Error parsing --training.steps")(lambda env: check(env, "--training.steps", "three"))
case("command line: --model.attention_cp", "model.attention_cp must be one of")(
    lambda env: check(env, "--model.attention_cp", "passkv")
)
case("optimizer.param_groups.0.optimizer_kwargs.lr must be >= 0")(
    lambda env: check(env, "--optimizer.param_groups.0.optimizer_kwargs.lr", "-0.001")
)
case("validator.freq must be >= 1")(lambda env: check(env, "--validator.freq", "0"))
case("use seq_len 96 or 104")(lambda env: check(env, "--training.seq_len", "100"))
case("parallelism.tensor_parallel_degree must be >= 1")(
    lambda env: check(env, "--parallelism.tensor_parallel_degree", "0")
)
case("parallelism.data_parallel_shard_degree must be -1")(
    lambda env: check(env, "--parallelism.data_parallel_shard_degree", "0")
)
case("parallelism.tensor_parallel_degree = 4 does not divide")(
    lambda env: check(env, "--parallelism.tensor_parallel_degree", "4", nproc="4")
)
case("NPROC must be a whole number")(lambda env: check(env, nproc="0"))
case("the trainer (torchtitan 0.3.0) needs torch")(
    lambda env: raised(lambda: compat.check_trainer_torch(1, "2.10.1"), compat.TorchVersionError)
)
case("the trainer runs 2 processes")(
    lambda env: raised(
        lambda: compat.check_trainer_torch(2, "2.11.0+cu130"), compat.TorchVersionError
    )
)


@case("metrics.enable_tensorboard = true needs")
def _tensorboard(env: Env) -> str:
    env.mp.setattr(compat, "tensorboard_available", lambda: False)
    return check(env, "--metrics.enable_tensorboard")


def _train_sh(**variables: str) -> str:
    proc = train_sh([], check=False, timeout=120, **variables)
    assert proc.returncode == 2, proc.stderr
    return proc.stderr.strip().splitlines()[-1]


case("train.sh: error: NODE_RANK=2")(lambda env: _train_sh(NNODES="2", NODE_RANK="2"))
case("NNODES=2 needs the rendezvous endpoint")(lambda env: _train_sh(NNODES="2", NODE_RANK="1"))
case("RDZV_ENDPOINT=[::1:29500 must be")(
    lambda env: _train_sh(NNODES="2", NODE_RANK="1", RDZV_ENDPOINT="[::1:29500")
)


@case("torchtitan_cp.launch: error: node 1 of 2: no rendezvous")
def _no_rendezvous(env: Env) -> str:
    """Nothing listens at node 0's endpoint; the 300 s of waiting pass on a clock of the test's
    own (100 s a reading), the connection attempts are real."""
    from torchtitan_cp import launch

    ticks = iter(range(0, 10_000, 100))
    env.mp.setattr(launch.time, "monotonic", lambda: float(next(ticks)))
    env.mp.setattr(launch.time, "sleep", lambda s: None)
    message = raised(
        lambda: launch.wait_for_endpoint(
            "127.0.0.1", free_port(), node=1, nnodes=2, timeout=300, out=io.StringIO()
        ),
        launch.LaunchError,
    )
    return launch.LAUNCH_PREFIX + message


@case("node 0 of 2: the rendezvous at H:P did not complete")
def _rendezvous_timeout(env: Env) -> str:
    from torch.distributed import DistError

    from torchtitan_cp import launch

    store = DistError("Timed out after 301 seconds waiting for clients. 1/2 clients joined.")
    return launch._rendezvous_error(store, ("127.0.0.1", free_port(), 0, 2), 300)


case("parallelism.context_parallel_degree (2) and the 3 processes")(
    lambda env: check(env, "--parallelism.context_parallel_degree", "2", "--nnodes", "2", nproc="3")
)


@case("DIR/config.json: text_config.rope_parameters.rope_theta")
def _rope_theta(env: Env) -> str:
    folder = copied(env, env.shared.folder(QWEN))

    def multimodal(text: dict[str, Any]) -> dict[str, Any]:
        text["rope_parameters"]["rope_theta"] = 1000000.0
        tie = text.pop("tie_word_embeddings")
        return {
            "model_type": "qwen3_5",
            "tie_word_embeddings": tie,
            "text_config": {**text, "model_type": "qwen3_5_text"},
        }

    edit_config(folder, multimodal)
    return hf_check(env, QWEN, folder)


@case("... is absent, so transformers uses 10000.0")
def _rope_absent(env: Env) -> str:
    folder = copied(env, env.shared.folder(QWEN))
    edit_config(
        folder,
        lambda c: {
            **c,
            "rope_parameters": {k: v for k, v in c["rope_parameters"].items() if k != "rope_theta"},
        },
    )
    return hf_check(env, QWEN, folder)


def _qwen_file(env: Env, name: str, text: str) -> str:
    folder = copied(env, env.shared.folder(QWEN))
    (folder / name).write_text(text)
    return hf_check(env, QWEN, folder)


case("DIR/model.safetensors.index.json: weight_map is a list")(
    lambda env: _qwen_file(
        env, "model.safetensors.index.json", '{"weight_map": ["model.safetensors"]}'
    )
)
case("DIR/model.safetensors.index.json: invalid JSON")(
    lambda env: _qwen_file(
        env, "model.safetensors.index.json", '{"metadata": {}, "weight_map": {"a": "model.safet'
    )
)


@case("DIR/config.json: rope_parameters is a string")
def _rope_string(env: Env) -> str:
    folder = copied(env, env.shared.folder(QWEN))
    edit_config(folder, lambda c: {**c, "rope_parameters": "default"})
    return hf_check(env, QWEN, folder)


case("DIR: missing safetensors shard(s)")(
    lambda env: _qwen_file(
        env,
        "model.safetensors.index.json",
        json.dumps(
            {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}
        ),
    )
)


@case("DIR: weights named model.layers.*")
def _qwen_layout(env: Env) -> str:
    folder = copied(env, env.shared.folder(QWEN))

    def rename(t: dict[str, torch.Tensor]) -> None:
        for k in list(t):
            t[k.replace("model.language_model.", "model.")] = t.pop(k)

    edit_tensors(folder, rename)
    return hf_check(env, QWEN, folder)


case("DIR/config.json: vocab_size is 1024")(
    lambda env: hf_check(env, KIMI, env.shared.folder(KIMI, flavor_model=True))
)


@case("DIR/config.json: num_experts is 16")
def _kimi_experts(env: Env) -> str:
    folder = copied(env, env.shared.folder(KIMI))
    edit_config(
        folder,
        lambda c: {**{k: v for k, v in c.items() if k != "num_local_experts"}, "num_experts": 16},
    )
    return hf_check(env, KIMI, folder)


@case("DIR/config.json: num_key_value_heads is absent")
def _kimi_kv_heads(env: Env) -> str:
    folder = copied(env, env.shared.folder(KIMI))
    edit_config(folder, lambda c: {k: v for k, v in c.items() if k != "num_key_value_heads"})
    return hf_check(env, KIMI, folder)


@case("DIR: no *.safetensors weights")
def _kimi_no_weights(env: Env) -> str:
    folder = copied(env, env.shared.folder(KIMI))
    (folder / "model.safetensors").unlink()
    return hf_check(env, KIMI, folder)


@case("linear_attention.backend = 'fla': layer X")
def _no_fla_kernel(env: Env) -> str:
    from tests.test_layers import FLA_WITH_TORCH_ONLY_KIND, register_torch_only_kind

    register_torch_only_kind(env.mp)
    return check(env, *FLA_WITH_TORCH_ONLY_KIND)


@case("compile.enable: model.layer_pattern has layers without")
def _no_custom_ops(env: Env) -> str:
    from torchtitan_cp.models.hybrid.layers import LAYERS, Kernels

    no_ops = Kernels(LAYERS["M"].kernels.backends, compiles=False)
    env.mp.setitem(LAYERS, "M", dataclasses.replace(LAYERS["M"], kernels=no_ops))
    return check(env, "--config_file", "configs/debug_mamba2_cpu.toml", "--compile.enable")


case("dump_folder PATH: not writable")(lambda env: check(env, dump="/proc/torchtitan_cp_x"))


def _data(env: Env, texts: list[str], *argv: str) -> str:
    path = env.tmp / "data.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return check(
        env,
        "--dataloader.dataset",
        "jsonl",
        "--dataloader.dataset_path",
        str(path),
        "--validator.no-enable",
        *argv,
    )


case('FILE: all N documents have an empty "text"')(lambda env: _data(env, ["", "", ""]))
case("FILE: 1 document(s) for 2 data-parallel ranks")(lambda env: _data(env, ["a single one"]))
case("FILE: the N documents of data-parallel rank R")(
    lambda env: _data(env, ["", "", "some text", "more text"])
)
case("FILE: one row of training.seq_len = 1000000000")(
    lambda env: check(env, "--training.seq_len", "1000000000", "--model.max_seq_len", "1000000000")
)
case("optimizer.param_groups.0.optimizer_kwargs.lr must be a finite")(
    lambda env: check(env, "--optimizer.param_groups.0.optimizer_kwargs.lr", "inf")
)
case("checkpoint.load_step must be -1")(
    lambda env: check(env, "--checkpoint.enable", "--checkpoint.load_step", "-5")
)
case("checkpoint.initial_load_path = P is ignored")(
    lambda env: check(env, "--checkpoint.initial_load_path", "/tmp")
)
case("checkpoint.create_seed_checkpoint needs")(
    lambda env: check(env, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint")
)
case("config file configs is a folder")(lambda env: check(env, "--config_file", "configs"))
case("command line: unexpected argument 'x.conf'")(lambda env: check(env, "x.conf"))


@case("metrics.jsonl_file D/metrics.jsonl: cannot be appended")
def _metrics_read_only(env: Env) -> str:
    dump = env.tmp / "run"
    dump.mkdir()
    if os.geteuid() != 0:
        target = env.tmp / "ro.txt"
        target.write_text("")
        target.chmod(0o444)
    else:  # root appends to 0444 files: a read-only sysfs attribute
        target = Path("/sys/kernel/uevent_seqnum")
    (dump / "metrics.jsonl").symlink_to(target)
    return check(env)


@case("FILE is truncated: N bytes, its header describes M")
def _truncated(env: Env) -> str:
    folder = copied(env, env.shared.folder(QWEN))
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return hf_check(env, QWEN, folder)


@case("FILE: tensor model.embed_tokens.weight is stored as I32")
def _int_tensor(env: Env) -> str:
    folder = copied(env, env.shared.folder(KIMI))
    edit_config(folder, lambda c: {**c, "torch_dtype": "bfloat16"})
    key = "model.embed_tokens.weight"
    edit_tensors(folder, lambda t: t.update({key: (t[key] * 100).to(torch.int32)}))
    return hf_check(env, KIMI, folder)


@case("DIR: tensor X ([...]) is in none of its")
def _missing_tensor(env: Env) -> str:
    folder = copied(env, env.shared.folder(KIMI))
    edit_tensors(folder, lambda t: t.pop("model.layers.3.self_attn.kv_b_proj.weight"))
    return hf_check(env, KIMI, folder)


@case("FILE: tensor X is [...] but the model flavor has")
def _misshaped_tensor(env: Env) -> str:
    folder = copied(env, env.shared.folder(QWEN))
    key = "model.language_model.layers.1.linear_attn.in_proj_qkv.weight"
    edit_tensors(folder, lambda t: t.update({key: t[key][:-1].clone()}))
    return hf_check(env, QWEN, folder)


@case("DIR/config.json: torch_dtype is a string ('int8')")
def _int_dtype(env: Env) -> str:
    folder = copied(env, env.shared.folder(KIMI))
    edit_config(
        folder, lambda c: {**{k: v for k, v in c.items() if k != "dtype"}, "torch_dtype": "int8"}
    )
    return hf_check(env, KIMI, folder)


# ------------------------------------------------------------------ checkpoints and runs


def _busy(env: Env, folder: Path, **kw: str) -> str:
    from torchtitan_cp.run.errors import RunError
    from torchtitan_cp.run.lock import RunLock

    first = RunLock(str(folder), **kw)
    assert first.acquire("run-1", "2026-01-01T00:00:00Z") is None
    try:
        return raised(lambda: RunLock(str(folder), **kw).acquire("run-2", "t"), RunError)
    finally:
        first.release()


case("dump folder D is in use by another run")(lambda env: _busy(env, env.tmp / "run"))
case("checkpoint folder D/checkpoint is in use")(
    lambda env: _busy(
        env, env.tmp / "run" / "checkpoint", what="checkpoint folder", option="--checkpoint.folder"
    )
)


def _lock_record(env: Env, **record: Any) -> str:
    import socket
    import time

    from torchtitan_cp.run.errors import RunError
    from torchtitan_cp.run.lock import RunLock

    dump = env.tmp / "run"
    dump.mkdir()
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    base = {"host": socket.gethostname(), "pid": 1, "run_id": "r-old", "start_time": now}
    (dump / "run.lock").write_text(json.dumps({**base, **record}) + "\n")
    return raised(lambda: RunLock(str(dump)).acquire("run-new", "t"), RunError)


case("dump folder D: its lock D/run.lock names pid")(
    lambda env: _lock_record(env, host="other-host", pid=4242)
)
case("..., and process P is still running on this host")(lambda env: _lock_record(env))


def _plan(env: Env, *, training_steps: int = 100) -> str:
    """The resume plan's lines for the checkpoint folder ``tmp/run/checkpoint``."""
    from torchtitan_cp.run.resume import plan_resume

    folder = env.tmp / "run" / "checkpoint"
    plan = plan_resume(str(folder), run_id="run-b", training_steps=training_steps)
    return "\n".join(plan.lines)


@case("checkpoint step-N skipped: incomplete:")
def _bad_manifest(env: Env) -> str:
    folder = env.tmp / "run" / "checkpoint"
    make_step(folder, 2)
    step = make_step(folder, 4)
    manifest = step / "manifest.sha256.json"
    manifest.write_text(json.dumps({"format": json.loads(manifest.read_text())["format"]}))
    return _plan(env)


@case("checkpoint step-N skipped: D/checkpoint/step-N/__0_0.distcp is truncated")
def _truncated_shard(env: Env) -> str:
    from torchtitan_cp.run.manifest import write_manifest

    folder = env.tmp / "run" / "checkpoint"
    make_step(folder, 2)
    step = make_step(folder, 4, sealed=False)
    shard = step / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:200])
    write_manifest(str(step), step=4, run_id="run-a")  # sealed cut short
    return _plan(env)


@case("step-N skipped: D/checkpoint/step-N/__0_0.distcp does not match")
def _flipped(env: Env) -> str:
    folder = env.tmp / "run" / "checkpoint"
    make_step(folder, 2)
    step = make_step(folder, 4)
    flip(step / "__0_0.distcp", offset=100)
    return _plan(env)


@case("holds step-24, past training.steps = 12")
def _past(env: Env) -> str:
    from torchtitan_cp.run.errors import CheckpointError

    make_step(env.tmp / "run" / "checkpoint", 24)
    return raised(lambda: _plan(env, training_steps=12), CheckpointError)


def _fit(env: Env, saved: dict[str, Any], state: dict[str, Any], dp: int | None = None) -> str:
    import torch.distributed.checkpoint as dcp

    from torchtitan_cp.run.checkpoint import fit_error, fit_problem

    step = env.tmp / "run" / "checkpoint" / "step-4"
    dcp.save(saved, checkpoint_id=str(step))
    problem = fit_problem(state, str(step), dp_world_size=dp)
    assert problem is not None
    return str(fit_error(str(step), problem))


W = torch.zeros(2, 2)
case("checkpoint D/checkpoint/step-4 does not fit this run: this m")(
    lambda env: _fit(env, {"layers.0.w": W}, {"layers.0.w": W, "layers.3.mixer.dt_bias": W})
)
case("parameter X is [...] in the checkpoint")(
    lambda env: _fit(env, {"layers.0.w": W}, {"layers.0.w": torch.zeros(3, 2)})
)
case("the checkpoint's parameter X is not in this model")(
    lambda env: _fit(env, {"layers.0.w": W, "layers.1.w": W}, {"layers.0.w": W})
)
case("checkpoint D/checkpoint/step-4 does not fit this run: it was")(
    lambda env: _fit(
        env,
        {"layers.0.w": W, "dataloader.dp_rank_0": torch.zeros(1)},
        {"layers.0.w": W, "dataloader": object()},
        dp=2,
    )
)


@case("saving checkpoint D/checkpoint/step-2 failed: no space left")
def _disk_full(env: Env) -> str:
    from torchtitan_cp.run import checkpoint

    folder = env.tmp / "run" / "checkpoint"
    folder.mkdir(parents=True)
    env.mp.setattr(checkpoint, "_free_bytes", lambda path: 0)
    return str(checkpoint.disk_full_error(str(folder / "step-2"), int(10.4 * 2**20)))


@case("rank 0: no answer from rank 1 within 5 s")
def _silent_rank(env: Env) -> str:
    from torch.distributed import TCPStore

    from torchtitan_cp.run.rank_timeout import timeout_error

    store = TCPStore("127.0.0.1", free_port(), 1, True, timedelta(seconds=10))
    err = timeout_error(0, 2, key="comm.train_timeout_seconds", seconds=5, store=store, grace=0.2)
    return str(err)


@case("Signal 11 (SIGSEGV) received by PID")
def _torchrun_signal(env: Env) -> str:
    """torchrun's own words for a rank a signal ended (its ProcessFailure)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(
        local_rank=1, pid=4242, exitcode=-signal.SIGSEGV, error_file=str(env.tmp / "none.json")
    )
    return failure.message


@case("rank 1 was killed by SIGSEGV without an error of its own")
def _crashed_rank(env: Env) -> str:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from torchtitan_cp.launch import report_silent_failures

    logs = Path(tempfile.mkdtemp(prefix="torchelastic_"))  # as the launcher makes it
    try:
        path = logs / "run_x" / "attempt_0" / "1" / "stderr.log"
        path.parent.mkdir(parents=True)
        path.write_text("Fatal Python error: Segmentation fault\n")
        failure = ProcessFailure(
            local_rank=1, pid=4242, exitcode=-signal.SIGSEGV, error_file=str(env.tmp / "none.json")
        )
        out = io.StringIO()
        report_silent_failures({1: failure}, str(logs), out)
        return out.getvalue()
    finally:
        shutil.rmtree(logs)


@case("D/metrics.jsonl: moved 1 line(s) that are not JSON objects")
def _cut_metrics(env: Env) -> str:
    from torchtitan_cp.run.start import repair_jsonl

    path = env.tmp / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)) + '{"step": 6')
    line = repair_jsonl(str(path), "run-b")
    assert line is not None
    return line


def _checkpoint_cli(env: Env, *argv: str) -> str:
    from torchtitan_cp.checkpoint import main as checkpoint_main

    assert checkpoint_main(list(argv)) == 2
    return env.capsys.readouterr().err.strip()


@case("checkpoint: error: DIR is empty: not a checkpoint step")
def _verify_empty(env: Env) -> str:
    (env.tmp / "empty").mkdir()
    return _checkpoint_cli(env, "verify", str(env.tmp / "empty"))


@case("DIR is a checkpoint folder (step-2, step-4); seal one step")
def _seal_folder(env: Env) -> str:
    folder = env.tmp / "checkpoint"
    make_step(folder, 2)
    make_step(folder, 4)
    return _checkpoint_cli(env, "seal", str(folder))


@case("checkpoint: error: will not seal DIR: FILE is truncated")
def _seal_truncated(env: Env) -> str:
    step = make_step(env.tmp / "checkpoint", 2, sealed=False)
    shard = step / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:200])
    return _checkpoint_cli(env, "seal", str(step))


@case("wandb: no credentials")
def _wandb(env: Env) -> str:
    from torchtitan_cp.trainer.metrics import wandb_offline_fallback

    for key in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC", "WANDB_BASE_URL"):
        env.mp.delenv(key, raising=False)
    env.mp.setenv("WANDB_MODE", "online")
    env.mp.setenv("HOME", str(env.tmp))
    env.mp.setenv("WANDB_CONFIG_DIR", str(env.tmp / "wandb"))
    line = wandb_offline_fallback(str(env.tmp / "run" / "tb" / "*" / "wandb" / "offline-run-*"))
    assert line is not None
    return line


@case("Nothing to train:")
def _nothing_to_train(env: Env) -> str:
    """``HybridTrainer.train`` on a plan that already reached training.steps (the trainer's
    own method; nothing else of a trainer is needed to say it)."""
    from torchtitan_cp.trainer import trainer

    said: list[str] = []
    env.mp.setattr(trainer, "logger", types.SimpleNamespace(info=said.append))
    fake = types.SimpleNamespace(
        run=types.SimpleNamespace(plan=types.SimpleNamespace(complete=True, step=12)),
        config=types.SimpleNamespace(training=types.SimpleNamespace(steps=12)),
    )
    trainer.HybridTrainer.train(fake)  # pyrefly: ignore[bad-argument-type]
    return "\n".join(said)


@case("loss spike at step 23: ..., 4 spikes in a row")
def _spikes_in_a_row(env: Env) -> str:
    from torchtitan_cp.run.errors import LossSpikeError
    from torchtitan_cp.run.spike_guard import SpikeGuard, SpikeGuardConfig

    guard = SpikeGuard(SpikeGuardConfig(factor=1.5, min_history=3, action="skip", max_skips=3))
    for step in range(1, 20):
        assert guard.check(step, 8.0) is None
    for step in (20, 21, 22):
        assert guard.check(step, 40.0) is not None
    return raised(lambda: guard.check(23, 40.0), LossSpikeError)


def _hint(env: Env) -> str:
    from torchtitan_cp.run.spike_guard import resume_hint

    return resume_hint(str(env.tmp / "run" / "checkpoint"), 1)


@case("loss is not finite (nan) at step 2, after its update")
def _non_finite_after_update(env: Env) -> str:
    from torchtitan_cp.run.spike_guard import non_finite_error

    return str(non_finite_error(2, math.nan, resume=_hint(env)))


@case("no checkpoint to resume from (checkpoint.enable is off)")
def _no_checkpoint(env: Env) -> str:
    from torchtitan_cp.run.spike_guard import resume_hint

    return resume_hint(None, None)


def _guard(env: Env, action: str) -> str:
    from torchtitan_cp.run.errors import NonFiniteLossError
    from torchtitan_cp.run.spike_guard import SpikeGuard, SpikeGuardConfig

    guard = SpikeGuard(SpikeGuardConfig(factor=3.0, action=action))  # pyrefly: ignore[bad-argument-type]
    assert guard.check(1, 8.0) is None
    if action == "skip":
        return guard.check(2, math.nan) or ""
    return raised(lambda: guard.check(2, math.nan, resume=_hint(env)), NonFiniteLossError)


case("loss is not finite (nan) at step 2; stopped before the update")(lambda e: _guard(e, "stop"))
case("loss is not finite (nan) at step 2; update skipped")(lambda e: _guard(e, "skip"))


def _stopped(env: Env, folder: Path | None) -> str:
    from torchtitan_cp.launch import LAUNCH_PREFIX, stopped_line

    info = env.tmp / "run_info.json"
    info.write_text(json.dumps({"checkpoint_folder": None if folder is None else str(folder)}))
    return LAUNCH_PREFIX + stopped_line(signal.SIGTERM, str(info))


@case("torchtitan_cp.launch: error: stopped by SIGTERM")
def _sigterm(env: Env) -> str:
    folder = env.tmp / "run" / "checkpoint"
    make_step(folder, 2)
    make_step(folder, 4)
    make_step(folder, 6, sealed=False)  # a save the signal cut short: not a resume point
    return _stopped(env, folder)


case("... no checkpoint to resume from")(lambda env: _stopped(env, None))


# ----------------------------------------------------------------------------- export


def _step_copy(env: Env, where: Path) -> Path:
    shutil.copytree(env.shared.qwen_step(), where)
    return where


@case("--checkpoint D/step-10 fails verification")
def _export_corrupted(env: Env) -> str:
    step = _step_copy(env, env.tmp / "D" / "step-10")
    flip(step / "__0_0.distcp", offset=(step / "__0_0.distcp").stat().st_size // 2)
    return export(env, "--checkpoint", str(step), "--out", str(env.tmp / "out"))


case("--checkpoint D/step-7: no such step folder")(
    lambda env: export(env, "--checkpoint", str(env.tmp / "step-7"), "--out", str(env.tmp / "o"))
)


@case("--checkpoint D is a checkpoint folder (step-2, step-4)")
def _export_folder(env: Env) -> str:
    for n in (2, 4):
        (env.tmp / "D" / f"step-{n}").mkdir(parents=True)
    return export(env, "--checkpoint", str(env.tmp / "D"), "--out", str(env.tmp / "o"))


def _out_with(env: Env, names: list[str], *, step: Path | None = None, out: Path | None = None):
    out = out or env.tmp / "out"
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        if name.endswith("/"):
            (out / name).mkdir()
        else:
            (out / name).write_text("x")
    step = step or env.shared.qwen_step()
    return export(env, "--checkpoint", str(step), "--out", str(out))


case("--out O is not empty (3 entries")(
    lambda env: _out_with(env, ["config.json", "model.safetensors", "tokenizer.json"])
)


@case("--out RUN contains the --checkpoint step", "--out L (= RUN) contains")
def _out_holds_source(env: Env) -> str:
    run = env.tmp / "RUN"
    step = _step_copy(env, run / "checkpoint" / "step-2")
    link = env.tmp / "L"
    link.symlink_to(run)
    lines = [export(env, "--checkpoint", str(step), "--out", str(out)) for out in (run, link)]
    return "\n".join(lines)


case("--out RUN is a training run's folder (4 other entries")(
    lambda env: _out_with(env, ["checkpoint/", "metrics.jsonl", "run.lock", "tb/"])
)
case("--out O is not an HF export (1 other entries")(lambda env: _out_with(env, ["notes.txt"]))


@case("--out D/step-2/hf lies inside the checkpoint step")
def _out_in_step(env: Env) -> str:
    step = env.tmp / "D" / "step-2"
    step.mkdir(parents=True)
    (step / "manifest.sha256.json").write_text("{}")
    return export(env, "--checkpoint", str(env.shared.qwen_step()), "--out", str(step / "hf"))


case("--out O: cannot write into PARENT")(
    lambda env: export(
        env, "--checkpoint", str(env.shared.qwen_step()), "--out", "/proc/torchtitan_cp_x/hf"
    )
)
case("--checkpoint D/step-10 does not fit this model")(
    lambda env: export(
        env,
        "--checkpoint",
        str(env.shared.qwen_step()),
        "--out",
        str(env.tmp / "o"),
        "--model.n_layers",
        "5",
    )
)


# ----------------------------------------------------------------------------- the tests


def keyed(lines: list[tuple[str, str]]) -> tuple[dict[str, list[str]], list[str]]:
    """(case key -> the documented lines it covers, the lines no key covers)."""
    by_key: dict[str, list[str]] = {key: [] for key in CASES}
    lonely = []
    for _, line in lines:
        keys = [key for key in CASES if line.startswith(key)]
        assert len(keys) <= 1, f"documented line {line!r} starts with several keys: {keys}"
        if keys:
            by_key[keys[0]].append(line)
        else:
            lonely.append(line)
    return by_key, lonely


def test_every_documented_line_has_a_case_and_every_case_a_line():
    by_key, lonely = keyed(documented_lines(DOC.read_text()))
    stale = [key for key, lines in by_key.items() if not lines]
    assert not lonely, "documented failure lines with no case in CASES (add one): " + "; ".join(
        lonely
    )
    assert not stale, "cases whose line left docs/configuration.md: " + "; ".join(stale)


# Cases that start a process (./scripts/train.sh, about 2 s of CPU each): the slow tier.
STARTS_A_PROCESS = {
    "train.sh: error: NODE_RANK=2",
    "NNODES=2 needs the rendezvous endpoint",
    "RDZV_ENDPOINT=[::1:29500 must be",
}


@pytest.mark.parametrize(
    "key",
    [
        pytest.param(k, marks=pytest.mark.slow) if k in STARTS_A_PROCESS else k
        for k in sorted(CASES)
    ],
)
def test_the_documented_line_is_what_the_code_writes(key, tmp_path, monkeypatch, capsys, shared):
    by_key, _ = keyed(documented_lines(DOC.read_text()))
    lines = by_key[key]
    assert lines, f"no documented line starts with {key!r}"
    with contextlib.chdir(REPO):
        wrote = CASES[key](Env(tmp_path, monkeypatch, capsys, shared))
    for line in lines:
        assert pattern(line).search(wrote), (
            f"docs/configuration.md says\n  {line}\nbut the code wrote\n  {wrote}"
        )


def test_the_match_is_not_vacuous():
    """Placeholders and elisions stand for text, the rest must be there: a changed word, a
    different number or a missing clause fails."""
    wrote = "torchtitan_cp.train: error: holds step-24, past training.steps = 12: nothing"
    assert pattern("holds step-N, past training.steps = 12").search(wrote)
    assert pattern("holds step-24, past ...").search(wrote)
    assert not pattern("holds step-24, past training.steps = 13").search(wrote)
    assert not pattern("holds step-N, beyond training.steps = 12").search(wrote)
    assert not pattern("NPROC must be >= N").search("NPROC must be a whole number >= 1")
    assert not pattern("a ... b").search("a\nb"), "one line of output"
    rows = documented_lines(
        "## Failure modes\n| fault | says | do |\n| --- |\n| x | "
        "`one two three four` and `short one` | y |\n"
    )
    assert rows == [("x", "one two three four")]
