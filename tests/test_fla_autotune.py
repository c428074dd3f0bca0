"""fla-core's autotune results kept across processes (``ops/common/fla_autotune.py``): a second
process on the same machine launches every fla kernel without tuning it again.

Each process is fresh (``python -c``) and runs fla's kernels under Triton's interpreter (the
``fla_interpreter`` tier, tests/fla_interpreter.py): KDA forward and backward on packed sequences
and the causal conv, with ``persist(folder)``. The interpreter cannot benchmark (no GPU driver), so
its autotuners pick one candidate where a GPU would time them all (the tier's rule); that pick is
Triton's cache miss all the same (``Autotuner.prune_configs``, counted here), and what a miss
decides is what ``persist`` saves. The first process misses and writes fla-format files; the
second loads them, misses nothing and gives the same results bit for bit. What only a GPU can
show (the seconds saved) is the GPU check's ``autotune_reuse`` part (docs/gpu.md).
"""

from __future__ import annotations

import json

import pytest

from tests import fla_interpreter
from tests.launch import run_python

pytestmark = [
    pytest.mark.fla_interpreter,
    pytest.mark.slow,
    pytest.mark.skipif(fla_interpreter.reason() is not None, reason=str(fla_interpreter.reason())),
]

_PROCESS = """
import hashlib, json, sys
from tests import fla_interpreter
assert fla_interpreter.install() is None
from triton.runtime.autotuner import Autotuner
misses = []
prune = Autotuner.prune_configs
def counted(self, kwargs):
    misses.append(self.base_fn.__name__)
    return prune(self, kwargs)
Autotuner.prune_configs = counted
from torchtitan_cp.ops.common import fla_autotune
assert fla_autotune.persist(sys.argv[1])
import torch
from tests.recurrences import CASES
from torchtitan_cp.ops import causal_conv1d, chunk_delta_rule
cu = torch.tensor([0, 1, 70, 128], dtype=torch.int32)
kda = next(c for c in CASES if c.id == "kda")
xs = [x.requires_grad_() for x in kda.inputs(128, 0, torch.float32, K=32, V=32)]
o, _ = chunk_delta_rule(*xs, kind="kda", cu_seqlens=cu, cu_seqlens_cpu=cu, backend="fla")
o.square().sum().backward()
x = torch.randn(1, 128, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
w = torch.randn(64, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
y = causal_conv1d(x, w, None, cu_seqlens=cu, cu_seqlens_cpu=cu, backend="fla")
y.square().sum().backward()
out = [o, y, x.grad, w.grad, *(t.grad for t in xs)]
digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in out)).hexdigest()
print(json.dumps({**fla_autotune.stats(), "misses": sorted(set(misses)), "digest": digest}))
"""


def _process(folder) -> dict:
    code = f"import sys; sys.argv = ['-c', {str(folder)!r}]\n{_PROCESS}"
    proc = run_python(code, timeout=900, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_second_process_does_not_tune_again(tmp_path):
    # Three fresh processes, about 20 s of CPU each (KDA and the conv interpreted): 60 s.
    folder = tmp_path / "fla_autotune"
    first = _process(folder)
    assert first["tuned"] > 0 and first["loaded"] == 0, first
    assert first["misses"] and set(first["kernels_tuned"]) <= set(first["misses"]), first
    files = sorted(p.name for p in folder.glob("*.json"))
    assert files == sorted(f"{k}.json" for k in first["kernels_tuned"]), files
    entry = next(iter(json.loads((folder / files[0]).read_text())["autotune_entries"].values()))
    assert {"autotune_key", "config", "module"} <= entry.keys()  # fla's format, plus the module
    second = _process(folder)
    assert second["misses"] == [] and second["tuned"] == 0, second
    assert second["loaded"] == first["tuned"]
    assert second["digest"] == first["digest"]
    # A saved config that is not among a kernel's candidates is ignored, not trusted: the
    # kernels tune again (and give the same results).
    for path in folder.glob("*.json"):
        data = json.loads(path.read_text())
        for e in data["autotune_entries"].values():
            e["config"]["num_warps"] = 3
        path.write_text(json.dumps(data))
    third = _process(folder)
    assert third["loaded"] == 0 and third["tuned"] == first["tuned"], third
    assert third["digest"] == first["digest"]
