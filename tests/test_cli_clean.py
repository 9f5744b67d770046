"""`omni clean`: report and remove what runs killed with SIGKILL left behind."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from typer.testing import CliRunner

from omni_core.cli import app
from omni_core.relay.shm_segment import MAGIC, pid_namespace

DEAD_PID = 999_999_998


def leave_segment(name: str) -> None:
    """An shm segment of omni's relay whose owner pid is dead."""
    header = bytearray(4096)
    for index, value in {0: MAGIC, 10: pid_namespace()}.items():
        header[index * 8 : index * 8 + 8] = value.to_bytes(8, "little")
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(header)


@pytest.fixture
def leftovers(tmp_path, monkeypatch):
    """A runtime dir and an shm segment whose owner pid is dead."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    run_dir = tmp_path / f"omni-run-{DEAD_PID}-abc"
    run_dir.mkdir()
    live_dir = tmp_path / f"omni-run-{os.getpid()}-live"
    live_dir.mkdir()
    name = f"omni-{DEAD_PID}xclean-p{DEAD_PID}-fake"
    leave_segment(name)
    yield run_dir, live_dir, name
    if os.path.exists(f"/dev/shm/{name}"):
        os.unlink(f"/dev/shm/{name}")


def test_dry_run_reports_and_keeps_everything(leftovers):
    run_dir, live_dir, segment = leftovers
    # Any pipeline starting on this machine meanwhile (another test run beside this one) sweeps a dead
    # run's segment, as it should: a dry run that found the segment swept by someone else is tried
    # again on a new one. A dry run itself never removes it.
    for _ in range(20):
        if not os.path.exists(f"/dev/shm/{segment}"):
            leave_segment(segment)
        result = CliRunner().invoke(app, ["clean", "--dry-run", "--json"])
        assert result.exit_code == 0, result.output
        found = json.loads(result.stdout)["found"]
        if segment in found["relay shm"]:
            break
        assert not os.path.exists(f"/dev/shm/{segment}"), f"the dry run missed {segment}, which is still there"
    assert found["runtime_dirs"] == [str(run_dir)]
    assert segment in found["relay shm"]
    assert run_dir.exists() and os.path.exists(f"/dev/shm/{segment}")


def test_clean_removes_leftovers_of_dead_runs_only(leftovers):
    run_dir, live_dir, segment = leftovers
    result = CliRunner().invoke(app, ["clean"])
    assert result.exit_code == 0, result.output
    assert f"removed: runtime_dirs: {run_dir}" in result.stdout
    assert not run_dir.exists() and not os.path.exists(f"/dev/shm/{segment}")
    assert live_dir.exists()
