"""The README's sample pipeline config exists and runs: every name it uses is registered (by
omni-core and omni-contrib-stages, which the README's first command installs) and it gives the
result the README prints."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import arun

from omni_core import Pipeline
from omni_core.config import load_config

README = Path(__file__).resolve().parents[2] / "README.md"

pytestmark = [pytest.mark.timeout(180)]


def readme_config(tmp_path: Path) -> Path:
    text = README.read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    assert len(blocks) == 1, "README.md should have one yaml block, the sample config"
    path = tmp_path / "tiny.yaml"
    path.write_text(blocks[0])
    return path


def readme_promise() -> tuple[dict, dict]:
    """The input and the output the README shows for `omni run tiny.yaml`."""
    found = re.search(r"`omni run tiny\.yaml --input '(\{.*?\})'` prints `(\{.*?\})`", README.read_text().replace("\n", " "))
    assert found, "README.md no longer says what `omni run tiny.yaml` prints"
    return json.loads(found.group(1)), json.loads(found.group(2))


def test_the_readme_sample_config_names_only_what_exists(tmp_path):
    cfg = load_config(readme_config(tmp_path))  # every factory and function resolves, the graph is valid
    assert [s.process or s.name for s in cfg.stages] == ["upper", "workers", "workers", "join"]


def test_the_readme_sample_config_runs_and_prints_what_the_readme_says(tmp_path, no_leaks):
    given, expected = readme_promise()

    async def run():
        async with Pipeline(str(readme_config(tmp_path))) as pipeline:
            return await pipeline.submit(given)

    assert arun(run(), timeout=150) == expected
