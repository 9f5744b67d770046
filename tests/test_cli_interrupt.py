"""Ctrl-C and a killed ``omni run``: stage processes run in sessions of their own, so a terminal's
SIGINT (sent to the whole foreground process group) reaches ``omni`` alone, which finishes the
requests in flight, prints the summary and exits 130; and a SIGKILLed ``omni`` leaves no stage
process behind (each one's parent watch ends it).

Each test runs the real console script in a process group of its own and signals that group, as
a terminal does."""

from __future__ import annotations

import glob
import json
import os
import pty
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from omni_core.testing.leaks import processes_with_env

OMNI = str(Path(sys.executable).parent / "omni")

pytestmark = pytest.mark.timeout(240)

STAGES = '''
import asyncio
import os


class Gated:
    """Answers at once, or (``gate`` given) says it started and answers once the gate exists."""

    async def __call__(self, payload, ctx):
        gate = payload.get("gate")
        if gate:
            open(gate + ".started", "w").close()
            for _ in range(12000):  # at most 120 s
                if os.path.exists(gate):
                    break
                await asyncio.sleep(0.01)
        return {"text": payload["text"], "pid": os.getpid()}
'''


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "PYTEST_", "PYTHONPATH"))}
    env.update(extra)
    return env


def wait_for(condition, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class Terminal:
    """``omni`` with stderr on a pty (so it behaves as on a terminal), in a process group of its
    own; ``ctrl_c()`` signals that whole group, as a terminal's Ctrl-C does."""

    def __init__(self, args: list[str], cwd: Path, marker: str):
        master, slave = pty.openpty()
        self.proc = subprocess.Popen([OMNI, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=slave, text=True,
                                     start_new_session=True,
                                     env=environment(OMNI_LOG_LEVEL="info", OMNI_LOG_FORMAT="json", OMNI_TEST_MARK=marker))
        os.close(slave)
        self.master = master
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._drain, daemon=True)
        self.reader.start()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self.master, 4096)
            except OSError:
                return
            if not data:
                return
            self.chunks.append(data)

    @property
    def stderr(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)

    def stage_pids(self) -> set[int]:
        """From the ``process started`` events (JSON, perhaps after the progress line)."""
        pids = set()
        for line in self.stderr.replace("\r", "\n").splitlines():
            at = line.find('{"')
            if at >= 0 and '"process started"' in line:
                pids.add(json.loads(line[at:])["pid"])
        return pids

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(timeout=10)
        os.close(self.master)


@pytest.fixture
def work(tmp_path) -> Path:
    (tmp_path / "tstages.py").write_text(textwrap.dedent(STAGES).lstrip())
    (tmp_path / "p.yaml").write_text("name: gated\nstages:\n  - {name: a, factory: 'tstages:Gated', terminal: true}\n")
    return tmp_path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_ctrl_c_in_a_terminal_finishes_the_requests_in_flight_then_exits_130(work):
    gate = work / "gate"
    lines = [{"text": "a"}, {"text": "b", "gate": str(gate)}, {"text": "c"}]
    (work / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    marker = uuid.uuid4().hex
    term = Terminal(["run", "p.yaml", "--inputs", "in.jsonl", "-c", "1"], work, marker)
    try:
        first = json.loads(term.proc.stdout.readline())["result"]
        assert first["text"] == "a"
        wait_for(lambda: Path(f"{gate}.started").exists(), "line 2 to reach the stage")
        pids = term.stage_pids()
        assert pids == {first["pid"]} and all(os.getpgid(pid) != term.proc.pid for pid in pids)  # not in omni's group
        term.ctrl_c()
        wait_for(lambda: "interrupted: finishing 1 request in flight" in term.stderr, "omni to start draining")
        assert all(alive(pid) for pid in pids)  # the stage process did not get the Ctrl-C
        gate.touch()  # line 2 may finish now
        assert term.proc.wait(timeout=120) == 130
        records = [json.loads(line) for line in term.proc.stdout.read().splitlines()]
    finally:
        term.close()
    assert [(r["line"], r["result"]["text"], r["result"]["pid"]) for r in records] == [(2, "b", first["pid"])]  # line 3 was never sent
    assert "interrupted: 2 of 3 requests finished, 0 failed, 1 not finished" in term.stderr
    assert "Traceback" not in term.stderr
    wait_for(lambda: not any(alive(pid) for pid in pids), "the stage processes to be stopped", 30)
    wait_for(lambda: not processes_with_env(f"OMNI_TEST_MARK={marker}"), "no process left behind", 30)


def held_request(work: Path) -> tuple[Terminal, str]:
    """``omni run --inputs`` of one request whose stage waits for a gate that never opens, once
    that request has reached the stage; and the run's environment marker."""
    gate = work / "never"
    (work / "in.jsonl").write_text(json.dumps({"text": "b", "gate": str(gate)}) + "\n")
    marker = uuid.uuid4().hex
    term = Terminal(["run", "p.yaml", "--inputs", "in.jsonl"], work, marker)
    try:
        wait_for(lambda: Path(f"{gate}.started").exists(), "the request to reach the stage")
    except BaseException:
        term.close()
        raise
    return term, marker


def test_a_second_ctrl_c_aborts_what_is_in_flight(work):
    term, marker = held_request(work)
    try:
        term.ctrl_c()
        wait_for(lambda: "interrupted: finishing 1 request in flight" in term.stderr, "omni to start draining")
        term.ctrl_c()
        assert term.proc.wait(timeout=120) == 130
    finally:
        term.close()
    assert "interrupted: 0 of 1 requests finished, 0 failed, 1 not finished" in term.stderr
    wait_for(lambda: not processes_with_env(f"OMNI_TEST_MARK={marker}"), "no process left behind", 30)


def test_a_sigkilled_omni_leaves_no_stage_process_behind(work):
    term, marker = held_request(work)
    try:
        pids = term.stage_pids()
        assert pids
        os.kill(term.proc.pid, signal.SIGKILL)
        term.proc.wait(timeout=30)
        # Each stage process sees its parent gone and ends itself, out of omni's session as it is.
        wait_for(lambda: not processes_with_env(f"OMNI_TEST_MARK={marker}"), "the orphans to end", 60)
    finally:
        term.close()
    assert not any(alive(pid) for pid in pids)
    left = glob.glob(os.path.join(tempfile.gettempdir(), f"omni-run-{term.proc.pid}-*"))
    wait_for(lambda: not any(os.path.exists(p) for p in left), "the runtime dir to be removed", 30)
