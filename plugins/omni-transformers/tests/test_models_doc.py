"""docs/models.md's first console block runs as written (but for ``pip install``, which the test
environment already did, and /tmp paths moved into the test's own folder): the tiny checkpoint,
``omni run --stream`` with text, then with an audio file and an image file."""

from __future__ import annotations

import json
import os
import re
import subprocess
import wave
from pathlib import Path

import pytest
from omni_core.testing.leaks import no_leaks  # noqa: F401 - a fixture

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("no_leaks")]

DOC = Path(__file__).resolve().parents[3] / "docs" / "models.md"


def first_console_block(text: str) -> list[str]:
    """The commands of the first ```console block: `$ ` lines with their continuation lines
    (a trailing backslash) and here-documents."""
    block = re.search(r"```console\n(.*?)```", text, re.S).group(1).splitlines()
    commands, i = [], 0
    while i < len(block):
        line = block[i]
        if not line.startswith("$ "):
            i += 1
            continue
        command = [line[2:]]
        while command[-1].endswith("\\"):
            i += 1
            command.append(block[i])
        heredoc = re.search(r"<<'?(\w+)'?", command[0])
        if heredoc:
            while block[i + 1] != heredoc.group(1):
                i += 1
                command.append(block[i])
            i += 1
            command.append(block[i])
        commands.append("\n".join(command))
        i += 1
    return commands


def test_the_first_console_block_runs_as_written(tmp_path):
    commands = first_console_block(DOC.read_text())
    assert any("omni run" in c and '"audio"' in c and '"image"' in c for c in commands), commands
    script = "set -euo pipefail\n" + "\n".join(c for c in commands if not c.startswith("pip install"))
    script = script.replace("/tmp/", f"{tmp_path}/")
    env = {k: v for k, v in os.environ.items() if k != "OMNI_TRANSFORMERS_MODEL"}
    out = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"stage"')]
    audio = [line["chunk"]["audio"]["tensor"] for line in lines if "audio" in line["chunk"]]
    assert len(audio) >= 2 and all(a["dtype"] == "float32" for a in audio)
    with wave.open(str(tmp_path / "qwen2_5_omni.wav")) as w:  # the last run's speech
        assert w.getframerate() == 24000 and w.getnframes() > 0
