"""Where a config's own Python code is imported from: the config file's folder and the working
directory, in the ``omni`` process and in every stage process it starts.

A config beside its code (``factory: my_stages:Upper`` with ``my_stages.py`` next to
``pipeline.yaml``) works the way ``python script.py`` does for a script: the folder of the file
comes first on the import path, then the directory ``omni`` was started in. Commands that load a
config (``omni run``, ``omni validate``, ``omni serve``) call :func:`add_config_import_paths`
before anything is imported or started.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def config_import_paths(config: str | os.PathLike, cwd: str | None = None) -> list[str]:
    """The folders to import a config's code from: the folder of ``config`` when it is a file,
    then the working directory (absolute paths, no duplicates)."""
    cwd = os.path.abspath(cwd or os.getcwd())
    paths = []
    candidate = Path(os.fspath(config))
    if candidate.is_file():
        paths.append(str(candidate.resolve().parent))
    paths.append(cwd)
    return list(dict.fromkeys(paths))


def add_config_import_paths(config: str | os.PathLike) -> list[str]:
    """Put :func:`config_import_paths` first on ``sys.path`` of this process and first on
    ``PYTHONPATH``, so that stage processes see them too, whichever launcher starts them
    (the local launcher hands its ``sys.path`` to its children; others start a fresh
    interpreter that reads ``PYTHONPATH``). Returns the folders added."""
    paths = config_import_paths(config)
    for path in reversed(paths):
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)
    existing = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in paths]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + existing)
    return paths
