"""Export a Qwen3.5 checkpoint of this recipe to a Hugging Face folder.

    python scripts/export_hf.py --config_file configs/qwen35_debug_cpu.toml \
        --checkpoint outputs/qwen35_debug_cpu/checkpoint/step-30 --out hf_out [--model.x v ...]

Reads the model weights of a torchtitan DCP checkpoint (any sharding; optimizer state is left
behind), converts them with torchtitan's ``Qwen35StateDictAdapter`` and writes ``config.json``,
``model.safetensors`` and the tokenizer files of ``hf_assets_path``. The result loads back with
``[checkpoint] initial_load_path = OUT, initial_load_in_hf = true`` (or in transformers). One
process, CPU; the same ``[model]`` keys as the training run select the architecture.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="DCP checkpoint folder (step-N)")
    parser.add_argument("--out", required=True, help="HF folder to write")
    args, rest = parser.parse_known_args(argv)

    import torch.distributed.checkpoint as dcp

    from torchtitan_cp import compat

    compat.apply()
    from torchtitan_cp.models import recipe_model_spec
    from torchtitan_cp.models.qwen35.hf import check_hf_folder, write_hf_folder
    from torchtitan_cp.train import load_config
    from torchtitan_cp.trainer.config import ConfigError

    try:
        config = load_config(rest)
        if config.model.name != "qwen3_5":
            raise ConfigError("export_hf.py exports model.name = 'qwen3_5' checkpoints only")
    except (ConfigError, ValueError) as e:
        print(f"export_hf.py: error: {e}", file=sys.stderr)
        return 2
    spec = recipe_model_spec(config.model)
    model = spec.model.build()
    state = model.state_dict()
    dcp.load(state, checkpoint_id=args.checkpoint)
    model.load_state_dict(state)
    out = write_hf_folder(model, spec.model, args.out, tokenizer_dir=config.hf_assets_path)
    check_hf_folder(out, spec.model)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
