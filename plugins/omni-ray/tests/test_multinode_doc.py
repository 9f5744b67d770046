"""docs/multinode.md's commands, as the page writes them, on this machine: ``omni plugins list``,
the two ``ray start`` of section 2 (a head with ``node_a``, a second node with ``node_b``),
``ray status``, section 3's ``omni plan`` and ``omni run`` of the demo across the two nodes, and
``ray stop``. Real subprocesses, one bash script, under a timeout.

What the test changes, so that it cannot collide with any other Ray on the machine:
``<ip of A>`` (127.0.0.1), Ray's temp dir (``RAY_TMPDIR``) and ``HOME`` (private: an auth token
that a ``ray.init()`` elsewhere wrote to ``~/.ray`` makes the head demand it from a second
``ray start`` that does not send it). The script runs in PID and
network namespaces of its own (``unshare --pid --net --fork --mount-proc``, loopback up): ``ray
stop`` there sees only this cluster's processes, whatever outlives the script dies with the
namespace, and the page's fixed ports (6379, the dashboard's, the Ray client server's, the
dashboard agents') are this cluster's alone, so they stay as written. Where a network namespace
cannot be made (no ``ip`` to bring loopback up), the PID namespace alone is used and those ports
become ports free a moment before (appended to each ``ray start``, the GCS port replacing 6379):
another process could take one in between. Without ``unshare`` at all the script runs in a
session of its own and ``ray stop`` is left out; either way every process that carries this
run's marker in its environment is killed at the end, failure included.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid

import pytest
from omni_core.testing.leaks import processes_with_env

from omni_ray.testing import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PAGE = os.path.join(ROOT, "docs", "multinode.md")
pytestmark = pytest.mark.timeout(600)


def section(title_start: str) -> str:
    """The text of the page's ``## <title_start>...`` section."""
    with open(PAGE, encoding="utf-8") as f:
        text = f.read()
    parts = re.split(r"^## ", text, flags=re.M)
    found = [p for p in parts if p.startswith(title_start)]
    assert found, f"docs/multinode.md has no section '## {title_start}...'"
    return found[0]


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def commands(block: str) -> list[str]:
    """The block's lines without comments (here-documents kept whole)."""
    lines = [re.sub(r"\s+# [^'\"]*$", "", line) for line in block.splitlines()]
    return [line for line in lines if line.strip() and not line.lstrip().startswith("# ")]


def namespaces() -> list[str]:
    """The ``unshare`` flags this machine allows: PID and network namespaces (with ``ip`` to bring
    loopback up), the PID namespace alone, or none."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    for flags, probe in ((["--pid", "--net"], "ip link set lo up"), (["--pid"], "true")):
        if flags[-1] == "--net" and shutil.which("ip") is None:
            continue
        argv = [unshare, *flags, "--fork", "--mount-proc", "sh", "-c", probe]
        if subprocess.run(argv, capture_output=True, timeout=30).returncode == 0:
            return flags
    return []


def kill_marked(marker: str) -> list[int]:
    """Kill every process whose environment carries ``marker`` (set to 1): all the script started."""
    pids = sorted(processes_with_env(f"{marker}=1"))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def script(
    install: str, start: list[str], demo: list[str], stop: bool, ports: dict[str, int] | None
) -> str:
    """The page's commands as one bash script; ``ports``: Ray's fixed ports replaced by these
    (None: a network namespace of its own, the page's ports as written)."""
    lines = ["set -euo pipefail"]
    if ports is None:
        lines.append("ip link set lo up")
    lines.append("set -x")
    lines += [line for line in commands(install) if not line.startswith("pip install")]
    for line in start:
        if ports is None:  # the page's ports, as written
            lines.append(line.replace("<ip of A>", "127.0.0.1"))
            continue
        if line.startswith("ray start --head"):
            line += (
                f" --dashboard-port {ports['dashboard']} --ray-client-server-port {ports['client']}"
                f" --dashboard-agent-listen-port {ports['agent_head']}"
            )
        elif line.startswith("ray start --address"):
            line += f" --dashboard-agent-listen-port {ports['agent_b']}"
        lines.append(line.replace("6379", str(ports["gcs"])).replace("<ip of A>", "127.0.0.1"))
    lines += demo
    if stop:
        lines += ["ray stop", "echo STOPPED", "ps -eo pid,args"]
    return "\n".join(lines) + "\n"


def test_the_pages_commands_work_as_written_on_a_local_two_node_cluster(tmp_path):
    install, start, demo = (
        bash_blocks(section(t)) for t in ("1. Install", "2. Start a cluster", "3. Run the demo")
    )
    assert len(install) == len(start) == len(demo) == 1, "each of sections 1-3 has one bash block"
    start_cmds = commands(start[0])
    assert [c.split(" --")[0] for c in start_cmds] == ["ray start", "ray start", "ray status"], (
        start_cmds
    )
    demo_cmds = commands(demo[0])
    assert any(c.startswith("omni plan ") for c in demo_cmds) and any(
        c.startswith("omni run ") for c in demo_cmds
    )
    assert "`ray stop`" in section("2. Start a cluster")

    flags = namespaces()
    namespaced = bool(flags)
    ports = None
    if "--net" not in flags:
        ports = {k: free_port() for k in ("gcs", "dashboard", "client", "agent_head", "agent_b")}
    marker = f"OMNI_DOC_TEST_{uuid.uuid4().hex}"
    work = tempfile.mkdtemp(prefix="omr", dir="/tmp")  # short: Ray's unix sockets live under it
    os.symlink(
        os.path.join(ROOT, "plugins"), os.path.join(work, "plugins")
    )  # the page's relative paths
    os.makedirs(os.path.join(work, "tmp"))
    body = script(install[0], start_cmds, demo_cmds, namespaced, ports)
    with open(os.path.join(work, "page.sh"), "w") as f:
        f.write(body)
    env = {
        **os.environ,
        marker: "1",
        "RAY_TMPDIR": os.path.join(work, "tmp"),
        "HOME": work,  # ~/.ray private: a token another Ray left there would be half used
        "TMPDIR": os.path.join(work, "tmp"),
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    for key in ("RAY_ADDRESS", "PYTHONPATH"):
        env.pop(key, None)
    argv = ["bash", "page.sh"]
    if namespaced:
        argv = ["unshare", *flags, "--fork", "--mount-proc", "--kill-child", *argv]
    proc = subprocess.Popen(
        argv,
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the page's commands did not finish within 540 s; output:\n{out[-6000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        left = kill_marked(marker)
        shutil.rmtree(work, ignore_errors=True)
    (tmp_path / "page.log").write_text(out)  # the whole transcript, for a failure's post-mortem
    tail = out[-8000:]
    assert proc.returncode == 0, f"the page's commands failed (exit {proc.returncode}):\n{tail}"
    assert not left, f"processes of the page's cluster outlived it: {left}\n{tail}"
    plugins = out.split("+ omni plugins list", 1)[1].split("\n+ ", 1)[0]
    ray_part = plugins.split("omni-ray:", 1)[-1]
    assert (
        "omni-ray:" in plugins
        and re.search(r"launcher +ray", ray_part)
        and re.search(r"placement +ray", ray_part)
    ), plugins
    status = out.split("+ ray status", 1)[1]
    assert "node_a" in status and "node_b" in status, tail
    plan = out.split("+ omni plan ", 1)[1].split("\n+ omni run", 1)[0]
    assert re.search(r"speech +machine-b", plan) and re.search(r"thinker +machine-a", plan), plan
    assert re.search(r"thinker +talker +stream +\S+ +yes", plan), plan  # inline, or tcp where omni-tcp is installed
    run = out.split("+ omni run ", 1)[1].split("\n+ ray stop", 1)[0]
    assert '"thinker": {"text": ' in run and '"vocoder": {"wav_path": ' in run, tail
    if namespaced:
        after = out.split("STOPPED", 1)[1]
        survivors = [
            line
            for line in after.splitlines()
            if re.match(r"\s*\d+ ", line) and "page.sh" not in line and "ps -eo" not in line
        ]
        assert not survivors, f"'ray stop' left processes running: {survivors}"
