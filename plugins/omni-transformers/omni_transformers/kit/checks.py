"""The stages' argument checks, run by ``omni validate`` and before a pipeline starts any process
(``register(..., check=...)``): nothing here imports torch or transformers or loads a model."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from omni_core.errors import ConfigIssue

#: The environment variable naming the checkpoint when a stage has no ``model`` argument.
MODEL_ENV = "OMNI_TRANSFORMERS_MODEL"

_TINY = "for tests, python -m omni_transformers.tiny DIR writes a tiny one"


def check_model(args: Mapping[str, Any], *, env: Mapping[str, str]) -> Iterator[ConfigIssue]:
    """``model`` (else ``$OMNI_TRANSFORMERS_MODEL`` in the stage's environment) must name a local
    checkpoint folder, one holding ``config.json``: the plugin never downloads."""
    model = args.get("model")
    where = "model"
    if model in (None, ""):
        model = env.get(MODEL_ENV)
        where = MODEL_ENV
        if not model:
            yield ConfigIssue("model", f"no checkpoint: the stage has no model argument and {MODEL_ENV} is not set",
                              f"set {MODEL_ENV}=DIR or args.model to a local checkpoint folder; {_TINY}")
            return
    if not isinstance(model, (str, os.PathLike)):
        yield ConfigIssue("model", f"model must be a folder path, got {model!r}", "give a local checkpoint folder")
        return
    path = Path(model).expanduser()
    if not path.is_dir():
        yield ConfigIssue("model", f"{where}={str(model)!r}: no such folder",
                          f"give a local checkpoint folder (this plugin never downloads); {_TINY}")
    elif not (path / "config.json").is_file():
        yield ConfigIssue("model", f"{where}={str(model)!r} is not a checkpoint folder (no config.json in it)",
                          "give the folder save_pretrained wrote (config.json beside the weights)")


#: A streaming vocoder's chunk modes (``kit.vocoder.MODES`` reads them from here).
VOCODER_MODES = ("exact", "fast")


def check_vocoder(args: Mapping[str, Any], *, env: Mapping[str, str]) -> Iterator[ConfigIssue]:
    """:func:`check_model`, and ``mode`` one of :data:`VOCODER_MODES`."""
    yield from check_model(args, env=env)
    mode = args.get("mode", "exact")
    if mode not in VOCODER_MODES:
        yield ConfigIssue("mode", f"mode must be one of {', '.join(VOCODER_MODES)}, got {mode!r}",
                          "mode: exact (equal to the unchunked synthesis) or fast (the first audio after a few "
                          "frames; docs/models.md)")
