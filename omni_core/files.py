"""The local-file rule: which server paths a request may name.

A stage that treats an input as a file on the server (a WAV to write, an audio or image file to
read) asks :func:`local_path` for it instead of opening the value as it is::

    from omni_core.files import local_path

    path = local_path(ctx, payload["wav_path"], "wav_path", write=True)

- A request made locally (``omni run``, the Python API) may name any file, as before: the value
  comes back as a path (``~`` expanded).
- A request that came over the network (any ``omni serve`` route: ``ctx.from_network``) may
  not, unless the operator opted in with ``serve.allow_local_files: DIR``. Then the path
  (relative paths are taken relative to ``DIR``) must resolve, after ``..`` and symlinks, to a
  file inside ``DIR``. Anything else raises :class:`~omni_core.errors.InvalidInput` naming the
  field.

The refusal never depends on the file: the same message for a file that exists, one that does
not and one that cannot be read, and nothing outside ``DIR`` is opened, created or even looked
at (``os.path.realpath`` reads the links of the path's own components only), so a client cannot
probe which server files exist.

The policy is the pipeline config's ``serve.allow_local_files``: every stage process sets it
from its config when it starts (:func:`configure`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .errors import InvalidInput

__all__ = ["allowed_root", "configure", "from_network", "local_path"]

#: The directory requests from the network may name files in (None: they may name none).
_root: str | None = None


def configure(root: str | os.PathLike[str] | None) -> None:
    """This process's policy: ``root`` is ``serve.allow_local_files`` (None: requests from the
    network name no file). A relative ``root`` is taken relative to the current directory."""
    global _root
    _root = None if root is None else os.path.realpath(os.path.expanduser(os.fspath(root)))


def allowed_root() -> str | None:
    """The directory requests from the network may name files in, resolved (None: none)."""
    return _root


def from_network(origin: Any) -> bool:
    """Whether ``origin`` (a :class:`~omni_core.StageContext`, a bool, or None for a local
    caller) stands for a request that came over the network."""
    if origin is None or isinstance(origin, bool):
        return bool(origin)
    flag = getattr(origin, "from_network", None)
    if flag is None:
        raise TypeError(f"local_path needs the stage's context (ctx), a bool or None, got {type(origin).__name__}")
    return bool(flag)


def _refused(field: str, value: str, why: str) -> InvalidInput:
    return InvalidInput(f"{field}: {value!r} {why}", field=field)


def local_path(origin: Any, value: Any, field: str, *, write: bool = False) -> Path:
    """The server path ``value`` names, if the request may name it (see the module docstring).

    ``origin``: the stage's context (``ctx``), or ``ctx.from_network``; ``field``: the input's
    name in the caller's terms (``"wav_path"``, ``"messages[0].content[1]"``), used in the error;
    ``write``: the file is to be written (the message says so). Raises
    :class:`~omni_core.errors.InvalidInput` for a value that is not a path, and for a path a
    request from the network may not name."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"{field}: expected a file path (a non-empty string), got {type(value).__name__}",
                           field=field)
    if "\x00" in value:
        raise InvalidInput(f"{field}: a file path cannot contain a NUL character", field=field)
    if not from_network(origin):
        return Path(os.path.expanduser(value))
    root = _root
    verb = "written to" if write else "read from"
    if root is None:
        raise _refused(field, value, f"names a file on the server, which requests over the network may not: files are "
                                     f"not {verb} server paths unless the operator sets serve.allow_local_files "
                                     "to a directory (send the content itself instead)")
    # Taken literally: "~", "%2e%2e" and "file:" are names inside the root like any other, never expanded or decoded.
    candidate = value if os.path.isabs(value) else os.path.join(root, value)
    resolved = os.path.realpath(candidate)
    if resolved == root or os.path.commonpath([root, resolved]) != root:
        raise _refused(field, value, "is not a file inside the directory this server lets requests name "
                                     "(serve.allow_local_files): give a path relative to it")
    return Path(resolved)
