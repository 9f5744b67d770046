"""``omni run`` summarises tensors (dtype and shape) in streamed chunks, results and ``--output``
JSON lines, unless ``--tensor-data`` asks for their elements in omni's JSON encoding. Runs the
real ``omni`` console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from runtime_helpers import no_leaks  # noqa: F401

from omni_core.encoding import from_jsonable

OMNI = str(Path(sys.executable).parent / "omni")

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("no_leaks")]

STAGES = '''
import numpy as np
import torch


class Audio:
    async def __call__(self, payload, ctx):
        n = payload["samples"]
        await ctx.emit({"audio": torch.arange(n, dtype=torch.float32), "index": 0})
        return {"audio": torch.arange(n, dtype=torch.float32), "codes": np.arange(6, dtype=np.int64).reshape(2, 3),
                "rate": np.float32(24000), "text": "hi"}
'''

CONFIG = """
name: tensors
stages:
  - {name: voice, factory: "tensor_stages:Audio", terminal: true}
"""


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "tensor_stages.py").write_text(STAGES)
    (tmp_path / "tensors.yaml").write_text(CONFIG)
    return tmp_path


def omni(work: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "PYTEST_", "PYTHONPATH"))}
    out = subprocess.run([OMNI, "run", "tensors.yaml", *args], cwd=work, env={**env, "PYTHONPATH": str(work)},
                         capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr
    return out


def test_streamed_chunks_and_the_result_summarise_tensors(work):
    out = omni(work, "--input", '{"samples": 24000}', "--stream")
    assert [json.loads(line) for line in out.stdout.splitlines()] == [
        {"stage": "voice", "chunk": {"audio": {"tensor": {"dtype": "float32", "shape": [24000]}}, "index": 0}},
        {"result": {"audio": {"tensor": {"dtype": "float32", "shape": [24000]}},
                    "codes": {"tensor": {"dtype": "int64", "shape": [2, 3]}}, "rate": 24000.0, "text": "hi"}},
    ]
    assert len(out.stdout) < 1000  # no data


def test_tensor_data_writes_tensors_whole_and_batches_summarise_by_default(work):
    (work / "in.jsonl").write_text('{"samples": 5}\n{"samples": 3}\n')
    omni(work, "--inputs", "in.jsonl", "--output", "whole.jsonl", "--tensor-data")
    records = {r["line"]: r["result"] for r in map(json.loads, (work / "whole.jsonl").read_text().splitlines())}
    assert torch.equal(from_jsonable(records[1]["audio"]), torch.arange(5, dtype=torch.float32))
    assert torch.equal(from_jsonable(records[2]["codes"]), torch.from_numpy(np.arange(6).reshape(2, 3)))
    out = omni(work, "--inputs", "in.jsonl", "--output", "summary.jsonl")
    assert "2 requests, 0 failed" in out.stderr
    records = {r["line"]: r["result"] for r in map(json.loads, (work / "summary.jsonl").read_text().splitlines())}
    assert records[2]["audio"] == {"tensor": {"dtype": "float32", "shape": [3]}}
    whole = omni(work, "--input", '{"samples": 2}', "--tensor-data", "--stream").stdout.splitlines()
    assert json.loads(whole[0])["chunk"]["audio"] == {"dtype": "float32", "shape": [2], "data": "AAAAAAAAgD8="}
