"""Export a checkpoint of this recipe to a Hugging Face folder (a model with HF folders in
``models.recipe.MODELS``: Qwen3.5, Kimi Linear).

    python -m torchtitan_cp.export_hf --config_file configs/qwen35_debug_cpu.toml \
        --checkpoint outputs/qwen35_debug_cpu/checkpoint/step-30 --out hf_out [--overwrite] \
        [--model.x v ...]

(``python scripts/export_hf.py ...`` is the same command.) Checks the step against its manifest
first (the same check, and the same message, as a resume:
``python -m torchtitan_cp.checkpoint verify``), reads the model weights of the torchtitan DCP
checkpoint (any sharding; optimizer state is left behind), converts them with the model's HF
writer (``RecipeModel.hf``: torchtitan's ``Qwen35StateDictAdapter``; Kimi Linear, the recipe's
``KimiLinearStateDictAdapter``, published layout) and writes ``config.json``,
``model.safetensors`` and the tokenizer
files of ``hf_assets_path`` into a temporary folder beside ``--out``, checks it, then renames it
into place. A non-empty ``--out`` is refused unless ``--overwrite``, which replaces the whole
folder (older shards and their index included) and only ever a folder that holds nothing but a
previous HF export: an ``--out`` holding the ``--checkpoint`` step, a dump folder, a checkpoint
folder, a run lock or any other file, or lying inside a checkpoint step, is refused with or
without ``--overwrite`` (symlinks are followed first). Every failure is one line, exit status 2.
The result loads back with ``[checkpoint] initial_load_path = OUT, initial_load_in_hf = true``
(or in transformers). One process, CPU; the same ``[model]`` keys as the training run select
the architecture.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys


class ExportError(Exception):
    """A one-line export failure."""


def _check_step(step_dir: str) -> None:
    from torchtitan_cp.run.manifest import MANIFEST, check_step
    from torchtitan_cp.run.resume import scan_steps

    if not os.path.isdir(step_dir):
        raise ExportError(f"--checkpoint {step_dir}: no such step folder")
    steps = scan_steps(step_dir)
    if steps and not os.path.exists(os.path.join(step_dir, MANIFEST)):
        names = ", ".join(os.path.basename(s.path) for s in steps)
        raise ExportError(
            f"--checkpoint {step_dir} is a checkpoint folder ({names}); pass one step, e.g. "
            f"{steps[-1].path}"
        )
    problem = check_step(step_dir)
    if problem is not None:
        raise ExportError(f"--checkpoint {step_dir} fails verification: {problem}")


# What a previous export leaves (write_hf_folder, or a published HF folder): the only files
# --overwrite may replace. Anything else (a run's checkpoint/, metrics.jsonl, run.lock, a
# step's .distcp files) makes the folder someone's data, never replaced.
_HF_FILES = re.compile(
    r"config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors|"
    r"model\.safetensors\.index\.json|(tokenizer|special_tokens|vocab|added_tokens)[\w.-]*|"
    r"merges\.txt|chat_template\.jinja|README\.md|\.gitattributes"
)
# Names that mark a training run's folders, for the refusal's reason.
_RUN_MARKS = ("run.lock", "metrics.jsonl", "manifest.sha256.json", ".metadata")


def _inside(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies under it (both real paths)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _run_folder_above(out: str) -> str | None:
    """The nearest folder at or above ``out`` (a real path) that is a checkpoint step (it holds
    a manifest or DCP metadata): writing there changes a saved step."""
    from torchtitan_cp.run.manifest import MANIFEST

    here = out
    while True:
        if any(os.path.exists(os.path.join(here, m)) for m in (MANIFEST, ".metadata")):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def _check_out(out: str, checkpoint: str, overwrite: bool) -> str:
    """The real path ``out`` may be written to: absent, empty, or (``overwrite``) a previous
    HF export. A folder that holds the ``checkpoint`` step, a run (dump folder, checkpoint
    folder, run lock) or anything but HF files is refused, ``overwrite`` or not."""
    real, source = os.path.realpath(out), os.path.realpath(checkpoint)
    shown = out if real == os.path.abspath(out) else f"{out} (= {real})"
    if _inside(source, real):
        raise ExportError(
            f"--out {shown} contains the --checkpoint step {checkpoint}: an export never "
            "replaces its own source; choose an --out outside the run"
        )
    step = _run_folder_above(real)
    if step is not None:
        raise ExportError(
            f"--out {shown} lies inside the checkpoint step {step}: writing there changes a "
            "saved step; choose an --out outside the run"
        )
    if os.path.lexists(real) and not os.path.isdir(real):
        raise ExportError(f"--out {shown} is a file, not a folder")
    names = sorted(os.listdir(real)) if os.path.isdir(real) else []
    if not names:
        return real
    foreign = [
        n + ("/" if os.path.isdir(os.path.join(real, n)) else "")
        for n in names
        if not _HF_FILES.fullmatch(n) or not os.path.isfile(os.path.join(real, n))
    ]
    if foreign:
        marks = [n for n in names if n in _RUN_MARKS or n.startswith("step-")]
        what = "a training run's folder" if marks else "not an HF export"
        listed = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
        raise ExportError(
            f"--out {shown} is {what} ({len(foreign)} other entries: {listed}); --overwrite "
            "only replaces a previous HF export: choose another --out"
        )
    if not overwrite:
        listed = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        raise ExportError(
            f"--out {shown} is not empty ({len(names)} entries: {listed}); pass --overwrite to "
            "replace that HF export, or choose another --out"
        )
    return real


def _staging_folder(out: str) -> str:
    """A new empty folder beside ``out`` to write into."""
    parent = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out))}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.mkdir(tmp)
    except OSError as e:
        raise ExportError(f"--out {out}: cannot write into {parent} ({e.strerror or e})") from None
    return tmp


def _replace(tmp: str, out: str) -> None:
    """Rename the finished ``tmp`` to ``out``; an existing ``out`` is renamed aside first and
    removed once the new folder is in place."""
    old = None
    if os.path.isdir(out):
        old = f"{tmp}.old"
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export(argv: list[str] | None) -> str:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="DCP checkpoint step folder (step-N)")
    parser.add_argument("--out", required=True, help="HF folder to write")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an --out that holds a previous HF export (and nothing else)",
    )
    args, rest = parser.parse_known_args(argv)
    checkpoint, out = args.checkpoint.rstrip("/") or "/", args.out.rstrip("/") or "/"

    from torchtitan_cp import compat

    compat.apply()
    _check_step(checkpoint)  # first: the same check and message as a resume
    out = _check_out(out, checkpoint, args.overwrite)
    import torch.distributed.checkpoint as dcp

    from torchtitan_cp.models.recipe import (
        choice_text,
        model_names,
        recipe_model,
        recipe_model_spec,
    )
    from torchtitan_cp.run.checkpoint import fit_problem
    from torchtitan_cp.train import load_config
    from torchtitan_cp.trainer.config import ConfigError

    try:
        config = load_config(rest)
    except (ConfigError, ValueError) as e:
        raise ExportError(str(e)) from None
    hf = recipe_model(config.model.name).hf
    if hf is None:
        names = choice_text(model_names(lambda m: m.hf is not None))
        raise ExportError(f"export_hf.py exports model.name = {names} checkpoints only")
    tmp = _staging_folder(out)
    try:
        spec = recipe_model_spec(config.model)
        model = spec.model.build()
        state = model.state_dict()
        problem = fit_problem(state, checkpoint)
        if problem is not None:
            raise ExportError(
                f"--checkpoint {checkpoint} does not fit this model: {problem}; it was saved "
                "with other [model] settings (layer_pattern, flavor, n_layers or a size): pass "
                "the --config_file and --model.* options of the run that saved it"
            )
        dcp.load(state, checkpoint_id=checkpoint)
        model.load_state_dict(state)
        hf.write(model, spec.model, tmp, tokenizer_dir=config.hf_assets_path)
        hf.check(tmp, spec.model)
        _replace(tmp, out)
    except OSError as e:
        where = getattr(e, "filename", None) or out
        raise ExportError(f"writing {out} failed: {where}: {e.strerror or e}") from None
    except ValueError as e:  # check_hf_folder: the folder just written does not check
        raise ExportError(f"the exported folder does not check: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    try:
        out = export(argv)
    except ExportError as e:
        print(f"export_hf.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
