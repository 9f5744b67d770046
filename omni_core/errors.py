"""Every error omni raises on purpose.

Each one is written for the person who reads it: it says what went wrong, where (config path, stage,
process, plugin) and, where there is one, what to do about it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import attrs


class OmniError(Exception):
    """Base class of every error omni raises on purpose."""


@attrs.frozen
class ConfigIssue:
    """One problem in a configuration: where it is, what is wrong, how to fix it."""

    path: str
    message: str
    hint: str | None = None

    def __str__(self) -> str:
        where = self.path or "<config>"
        text = f"{where}: {self.message}"
        return f"{text} ({self.hint})" if self.hint else text


class ConfigError(OmniError):
    """A configuration is invalid. ``issues`` holds every problem found, not only the first."""

    def __init__(self, issues: Iterable[ConfigIssue] | str, *, source: str | None = None):
        if isinstance(issues, str):
            issues = [ConfigIssue("", issues)]
        self.issues: list[ConfigIssue] = list(issues)
        self.source = source
        super().__init__(self._render())

    def _render(self) -> str:
        head = f"invalid pipeline config {self.source}" if self.source else "invalid pipeline config"
        count = len(self.issues)
        lines = [f"{head}: {count} error{'s' if count != 1 else ''}"]
        lines += [f"  - {issue}" for issue in self.issues]
        return "\n".join(lines)


class PluginError(OmniError):
    """A plugin failed to load, registered something badly, or a name could not be resolved."""


class StartupError(OmniError):
    """The pipeline could not start.

    ``process`` names the process that failed, when one did; ``stage`` and ``path`` the stage it
    was building and that stage's config path (``stages[1]``: its factory raised;
    ``stages[1].factory``: it could not be imported; ``stages[1].args``: its arguments do not fit
    the factory), when the process knew; ``detail`` is the child's own message and
    ``traceback`` the child's traceback text. When several processes failed before the start was
    abandoned, ``failures`` lists each one's error (this error is the first of them)."""

    def __init__(self, message: str, *, process: str | None = None, traceback: str | None = None,
                 stage: str | None = None, path: str | None = None, detail: str | None = None,
                 failures: list[StartupError] | None = None):
        self.process = process
        self.traceback = traceback
        self.stage = stage
        self.path = path
        self.detail = detail
        self.message = message
        self.failures: list[StartupError] = list(failures) if failures else [self]
        text = message if not traceback else f"{message}\n\n--- traceback from {process} ---\n{traceback}"
        super().__init__(text)

    @classmethod
    def several(cls, failures: list[StartupError]) -> StartupError:
        """One error for the processes that failed together (the first when only one did)."""
        if len(failures) == 1:
            return failures[0]
        first = failures[0]
        message = f"{len(failures)} processes failed to start: " + "; ".join(f.message for f in failures)
        return cls(message, process=first.process, traceback=first.traceback, stage=first.stage, path=first.path,
                   detail=first.detail, failures=failures)


class InvalidInput(ValueError):
    """A request's input is wrong: the caller's mistake, not a bug (``omni serve`` answers 400).

    Stages and plugins raise it for inputs they refuse (a wrong type, a value out of range, a
    file the request may not name, undecodable media, a sequence longer than the model takes).
    ``field`` names the input at fault (``"max_tokens"``, ``"messages[0].content[1]"``) where
    there is one; the message says what was expected. A subclass of ``ValueError``, so code
    that catches ``ValueError`` still catches it. When a stage raises it, the request fails with
    a :class:`StageError` whose ``invalid_input`` is True and whose ``field`` is this one's."""

    def __init__(self, message: str, *, field: str | None = None):
        self.field = field
        self.message = message
        super().__init__(message)


class RequestError(OmniError):
    """Base class of the errors a single request can end with."""

    def __init__(self, message: str, *, request_id: str | None = None):
        self.request_id = request_id
        super().__init__(message)


class StageError(RequestError):
    """A request failed inside a stage (its code, a user function, or payload encoding).

    ``stage`` is the stage's name, ``traceback`` the remote traceback text, ``error_type`` the
    exception's class name, ``invalid_input`` whether it was an :class:`InvalidInput` (then
    ``field`` is its field). The stage and the pipeline go on serving other requests."""

    def __init__(
        self,
        message: str,
        *,
        stage: str,
        request_id: str | None = None,
        error_type: str = "Exception",
        traceback: str = "",
        invalid_input: bool = False,
        field: str | None = None,
    ):
        self.stage = stage
        self.error_type = error_type
        self.traceback = traceback
        self.reason = message
        #: The stage raised :class:`InvalidInput` (or a subclass): the caller's mistake, and
        #: ``field`` the input it names (None when it names none).
        self.invalid_input = invalid_input
        self.field = field
        text = f"request {request_id!r} failed in stage {stage!r}: {error_type}: {message}"
        if traceback:
            text += f"\n\n--- remote traceback (stage {stage!r}) ---\n{traceback.rstrip()}"
        super().__init__(text, request_id=request_id)


class ProcessDied(RequestError):
    """A stage process died while it held the request (or while the pipeline ran)."""

    def __init__(
        self,
        *,
        process: str,
        pid: int | None,
        exitcode: int | None = None,
        signal: str | None = None,
        request_id: str | None = None,
        stages: tuple[str, ...] = (),
        reason: str | None = None,
    ):
        self.process = process
        self.name = process
        self.pid = pid
        self.exitcode = exitcode
        self.signal = signal
        self.stages = stages
        self.reason = reason
        how = reason or (f"killed by {signal}" if signal else f"exit code {exitcode}")
        hosted = f" (stages: {', '.join(stages)})" if stages else ""
        what = f"request {request_id!r} failed: " if request_id else ""
        super().__init__(
            f"{what}process {process!r}{hosted} pid {pid} died ({how})", request_id=request_id
        )


class ProcessHung(ProcessDied):
    """A stage process stopped answering heartbeats for ``limits.heartbeat_timeout`` (stopped
    with SIGSTOP, or wedged so that not even its heartbeat thread runs): it was killed, and the
    requests it held fail with this error."""

    def __init__(self, *, process: str, pid: int | None, silent_for: float, request_id: str | None = None,
                 stages: tuple[str, ...] = ()):
        self.silent_for = silent_for
        super().__init__(process=process, pid=pid, signal="SIGKILL", request_id=request_id, stages=stages)
        hosted = f" (stages: {', '.join(stages)})" if stages else ""
        what = f"request {request_id!r} failed: " if request_id else ""
        self.args = (
            f"{what}process {process!r}{hosted} pid {pid} hung: no heartbeat for {silent_for:.1f} s "
            "(limits.heartbeat_timeout); it was killed",
        )


class Overloaded(RequestError):
    """The pipeline is at its admission limit (``limits.max_in_flight``); retry later."""


class RequestAborted(RequestError):
    """The request was aborted (by ``Pipeline.abort`` or because the pipeline stopped)."""


class RequestTimeout(RequestError):
    """The request exceeded ``limits.request_timeout``."""


class PipelineClosed(OmniError):
    """The pipeline is not running (not started yet, stopping, or stopped)."""


# -- tracebacks as users read them ----------------------------------------------------------------

#: Frames from these places are Python's machinery, not the user's code (omni's own frames are
#: those under this package's folder).
_MACHINERY = tuple(
    f"{os.sep}{name}" for name in ("asyncio" + os.sep, "multiprocessing" + os.sep, "concurrent" + os.sep,
                                   "importlib" + os.sep, "threading.py", "runpy.py")
) + ("<frozen importlib", "<frozen runpy")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _is_machinery(filename: str) -> bool:
    return filename.startswith(_PACKAGE_DIR + os.sep) or any(part in filename for part in _MACHINERY)


def trim_traceback(text: str) -> str:
    """A formatted traceback with the frames of omni and of Python's machinery (asyncio,
    multiprocessing, importlib) removed, so that what is left is the user's own code.

    Works on text, so it applies to a traceback that came from another process. Chained
    exceptions keep their "During handling ..." separators; a block left without frames keeps
    only its exception line. Text that is not a traceback comes back unchanged."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith('  File "'):
            filename = line[len('  File "'):].split('"', 1)[0]
            frame = [line]
            i += 1
            while i < len(lines) and lines[i].startswith("    "):
                frame.append(lines[i])
                i += 1
            if not _is_machinery(filename):
                out.extend(frame)
            continue
        out.append(line)
        i += 1
    # A "Traceback (most recent call last):" header directly followed by the exception line
    # (every frame trimmed) says nothing: drop it.
    cleaned = [
        line for k, line in enumerate(out)
        if not (line.startswith("Traceback (most recent call last):")
                and (k + 1 >= len(out) or not out[k + 1].startswith('  File "')))
    ]
    return "\n".join(_drop_omni_wrappers(cleaned)) + ("\n" if text.endswith("\n") else "")


_CHAIN_SEPARATORS = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)


def _drop_omni_wrappers(lines: list[str]) -> list[str]:
    """Drop a last chained block that is only omni's own error wrapping the user's (every frame
    trimmed, its exception an ``omni_core`` class): the user's exception above says it all, and
    the message the traceback goes with says the rest."""
    for k in range(len(lines) - 1, -1, -1):
        if lines[k] in _CHAIN_SEPARATORS:
            block = lines[k + 1:]
            frames = any(line.startswith('  File "') for line in block)
            last = next((line for line in reversed(block) if line.strip()), "")
            if not frames and last.startswith("omni_core."):
                head = lines[:k]
                while head and not head[-1].strip():
                    head.pop()
                return head
            break
    return lines


def user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` (and its causes) without omni's own frames: what a stage process
    sends back when it fails to start, so that the user sees their code only."""
    import traceback

    return trim_traceback("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


def has_user_frames(text: str) -> bool:
    """Whether a (trimmed) traceback still shows any frame."""
    return any(line.startswith('  File "') for line in text.splitlines())
