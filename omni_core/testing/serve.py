"""Test a pipeline or an API plugin behind a real ``omni serve`` process.

::

    from omni_core.testing.serve import ServerProcess

    with ServerProcess("demo") as server:          # waits until /ready answers 200
        r = httpx.post(f"{server.url}/v1/pipelines/demo/requests", json={"input": {...}})
    assert server.returncode == 0                  # SIGTERM, drained, stopped
    server.assert_nothing_left()                   # no process, runtime dir, socket or shm segment

The server listens on 127.0.0.1 on a free port (``--port 0``; the port is read from its first
line). Its log lines are kept in :attr:`ServerProcess.lines`.

A config written in the test (YAML text, or a mapping such as a shipped config edited), served from
a folder of its own, with the test's stage modules importable by the server's processes::

    @pytest.fixture(scope="module")
    def server(tmp_path_factory):
        folder = tmp_path_factory.mktemp("tts")
        with ServerProcess.of_config(TTS_YAML, folder, pythonpath=[HERE]).serving() as srv:
            yield srv

and the official ``openai`` SDK on it, counting the POSTs it sends (a client's mistake must cost
one POST: no retry)::

    posts = []
    with openai_client(server, posts) as client:
        ...
    assert posts == ["/v1/chat/completions"]
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence

from .leaks import processes_with_env, runtime_dirs, shm_segments

_URL = re.compile(r"omni serve: .* on (https?://\S+:\d+)$")


class ServerProcess:
    """``omni serve CONFIG --port 0 ...`` as a subprocess, with its whole process tree tracked
    (an environment marker) so a test can check nothing outlives it."""

    def __init__(self, config: str, *args: str, env: Mapping[str, str] | None = None, cwd: str | None = None,
                 ready_timeout: float = 90.0):
        self.config = config
        self.args = list(args)
        self.marker = f"OMNI_TEST_SERVER={secrets.token_hex(8)}"
        self.env = {**os.environ, **(env or {})}
        key, value = self.marker.split("=")
        self.env[key] = value
        self.env.setdefault("OMNI_LOG_FORMAT", "json")
        self.cwd = cwd
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.lines: list[str] = []
        self._url_found = threading.Event()
        self._reader: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    @classmethod
    def of_config(cls, config: str | Mapping[str, object], folder: str | os.PathLike, *args: str,
                  name: str = "pipeline", env: Mapping[str, str] | None = None,
                  pythonpath: Sequence[str | os.PathLike] = (), cwd: str | os.PathLike | None = None,
                  ready_timeout: float = 300.0) -> ServerProcess:
        """A server of ``config`` (YAML text, or a mapping written as YAML) saved as
        ``folder/NAME.yaml``, started in ``cwd`` (default ``folder``), its processes importing from
        ``pythonpath`` first (the test's stage modules). Not started yet: ``.serving()``."""
        path = os.path.join(os.fspath(folder), f"{name}.yaml")
        if not isinstance(config, str):
            import yaml

            config = yaml.safe_dump(dict(config), sort_keys=False)
        with open(path, "w", encoding="utf-8") as f:
            f.write(config)
        env = dict(env or {})
        paths = [os.fspath(p) for p in pythonpath]
        if paths:
            before = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
            env["PYTHONPATH"] = os.pathsep.join([*paths, *([before] if before else [])])
        return cls(path, *args, env=env, cwd=os.fspath(cwd if cwd is not None else folder),
                   ready_timeout=ready_timeout)

    def command(self) -> list[str]:
        """The server's command line: ``omni serve`` through this interpreter (override to run,
        say, the installed console script)."""
        return [sys.executable, "-c", "from omni_core.cli import main; main()", *self.serve_args()]

    def serve_args(self) -> list[str]:
        return ["serve", self.config, "--host", "127.0.0.1", "--port", "0", *self.args]

    def start(self, *, wait_ready: bool = True) -> ServerProcess:
        """Start the server and wait for its URL (and ``/ready`` unless ``wait_ready`` is false);
        a start that fails or times out stops the server before it raises."""
        self.proc = subprocess.Popen(self.command(), env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + self.ready_timeout
        try:
            while not self._url_found.wait(0.05):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"omni serve did not start (exit {self.proc.poll()}):\n" + self.output())
            if wait_ready:
                self.wait_ready(deadline)
        except BaseException:
            # A start that failed stops what it started (SIGTERM: the server drains and stops its
            # stage processes; SIGKILL past 30 s); the original error is the one to raise.
            with contextlib.suppress(AssertionError):
                self.stop(30)
            raise
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if self.url is None and (m := _URL.search(line)):
                self.url = m.group(1)
                self._url_found.set()

    def wait_ready(self, deadline: float | None = None) -> None:
        """Poll ``/ready`` until it answers 200."""
        import httpx

        proc = self.proc
        if proc is None:
            raise RuntimeError("omni serve is not started: call start()")
        deadline = deadline or time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"omni serve exited with {proc.returncode}:\n" + self.output())
            try:
                if httpx.get(f"{self.url}/ready", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError("omni serve was not ready in time:\n" + self.output())

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout)
        finally:
            if self._reader is not None:
                self._reader.join(5)
        return code

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait; kill (and fail) if it does not exit within ``timeout``."""
        if self.proc is None:
            return 0
        self.signal(signal.SIGTERM)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.wait(10)
            raise AssertionError(f"omni serve did not exit within {timeout:g} s of SIGTERM:\n" + self.output()) from None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for_lines(self, *parts: str, timeout: float = 10.0) -> list[str]:
        """The log lines holding every one of ``parts``, once there is at least one: the server
        writes a request's log line around the time it answers, so a test that reads the log
        right after the answer polls for it (until ``timeout``, then an AssertionError with the
        output)."""
        deadline = time.monotonic() + timeout
        while True:
            found = [line for line in list(self.lines) if all(part in line for part in parts)]
            if found:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"no log line with {parts!r} within {timeout:g} s:\n" + self.output())
            time.sleep(0.02)

    def stop_cleanly(self, timeout: float = 60.0) -> None:
        """Stop; the server must exit 0 and leave nothing behind."""
        code = self.stop(timeout)
        assert code == 0, self.output()
        self.assert_nothing_left()

    @contextlib.contextmanager
    def serving(self, stop_timeout: float = 60.0) -> Iterator[ServerProcess]:
        """Start (a start that fails stops what it started), yield the server, and at the end of
        the block :meth:`stop_cleanly`: a test fixture's whole life."""
        self.start()
        try:
            yield self
        finally:
            self.stop_cleanly(stop_timeout)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- leaks ---------------------------------------------------------------------------------

    def leftovers(self) -> list[str]:
        left = [f"process {pid}" for pid in processes_with_env(self.marker)]
        if self.proc is not None:
            left += [f"runtime dir {d}" for d in runtime_dirs(self.proc.pid)]
            left += [f"shm segment {s}" for s in shm_segments(self.proc.pid)]
        return left

    def assert_nothing_left(self, wait: float = 5.0) -> None:
        """No process of the server's tree, runtime dir (ipc socket files live there) or /dev/shm
        segment of its runs is left."""
        deadline = time.monotonic() + wait
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not self.leftovers(), f"omni serve left behind: {self.leftovers()}"


def sse_events(lines: Sequence[str]) -> list[tuple[str | None, str]]:
    """``(event, data)`` pairs of a text/event-stream body given as lines."""
    events: list[tuple[str | None, str]] = []
    name: str | None = None
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                events.append((name, "\n".join(data)))
            name, data = None, []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
    if data:
        events.append((name, "\n".join(data)))
    return events


@contextlib.contextmanager
def openai_client(server: ServerProcess | str, posts: list[str] | None = None, *, timeout: float = 60.0,
                  api_key: str = "unused", **options: object) -> Iterator[object]:
    """The official ``openai`` SDK on ``server`` (a :class:`ServerProcess`, or its URL): its
    ``base_url`` is the server's ``/v1``, and the path of every POST it sends is appended to
    ``posts`` (retries included, so a test can check that a client's mistake cost exactly one).
    ``options`` go to ``openai.OpenAI`` (``max_retries``...). Closed at the end of the block."""
    import httpx
    import openai

    url = server if isinstance(server, str) else server.url
    seen = posts if posts is not None else []

    def count(request: httpx.Request) -> None:
        if request.method == "POST":
            seen.append(request.url.path)

    with httpx.Client(event_hooks={"request": [count]}, timeout=timeout) as http, openai.OpenAI(
        base_url=f"{url}/v1", api_key=api_key, http_client=http, **options  # type: ignore[arg-type]
    ) as client:
        yield client


__all__ = ["ServerProcess", "openai_client", "sse_events"]
