"""Decoding a request's audio and images: files (paths), encoded bytes or tensors → what
a family's feature extractor and image processor take (16 kHz mono float32, RGB images).

Every error names the part it is about (``messages[1].content[0] (audio)``) and says what was
expected, so one bad part fails its request with a message the caller can act on. Every one is a
:class:`MediaError`, an :class:`omni_core.InvalidInput` whose ``field`` is that part (``omni serve``
answers 400).

A path is a server file: it goes through :func:`omni_core.files.local_path` with the request's
context (``origin``), so a request from the network names none unless ``serve.allow_local_files``
allows it.
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np
from omni_core.errors import InvalidInput
from omni_core.files import local_path

#: Image sides whose ratio is larger than this are refused (the limit of the image processors transformers ships).
MAX_ASPECT_RATIO = 200


class MediaError(InvalidInput):
    """A bad audio or image part of a request (``field``: the part, e.g. ``messages[1].content[0]``)."""

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message, field=field if field is not None else message.partition(":")[0].split(" (")[0])


def _array(value: Any) -> np.ndarray | None:
    """A torch tensor or numpy array as numpy (None for anything else)."""
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        tensor = value.detach().cpu()
        if str(tensor.dtype) == "torch.bfloat16":  # numpy has no bfloat16
            tensor = tensor.float()
        return tensor.numpy()
    if isinstance(value, np.ndarray):
        return value
    return None


def _describe(value: Any) -> str:
    if isinstance(value, (str, os.PathLike)):
        return f"file {os.fspath(value)!r}"
    return type(value).__name__


def _source(value: Any, where: str, origin: Any) -> Any:
    """What to decode ``value`` from: its bytes, or the server path the request may name."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return io.BytesIO(bytes(value))
    try:
        return os.fspath(local_path(origin, value, where))
    except InvalidInput as exc:  # a MediaError like the others, its field the part without "(audio)"
        raise MediaError(str(exc)) from None


def load_audio(value: Any, where: str, *, sample_rate: Any = None, target_rate: int = 16000,
               max_samples: int | None = None, origin: Any = None) -> np.ndarray:
    """``value`` (a path, an encoded file's bytes, or a 1-D float tensor/array at ``sample_rate``)
    as 1-D float32 mono samples at ``target_rate``, at most ``max_samples`` of them. ``origin``:
    the request's context (or ``ctx.from_network``), for the local-file rule."""
    array = _array(value)
    if array is not None:
        if array.ndim != 1:
            raise MediaError(f"{where}: audio samples must be a 1-D tensor (mono), got shape {list(array.shape)}")
        if not np.issubdtype(array.dtype, np.floating):
            raise MediaError(f"{where}: audio samples must be float (in [-1, 1]), got dtype {array.dtype}")
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate <= 0:
            raise MediaError(f"{where}: audio given as samples needs 'sample_rate' (a positive int), "
                             f"got {sample_rate!r}")
        rate, samples = sample_rate, array.astype(np.float32, copy=False)
    elif isinstance(value, (str, os.PathLike, bytes, bytearray, memoryview)):
        import soundfile

        source = _source(value, where, origin)
        try:
            data, rate = soundfile.read(source, dtype="float32", always_2d=True)
        except Exception as exc:  # noqa: BLE001 - soundfile raises several kinds; all mean "unreadable"
            raise MediaError(f"{where}: cannot read audio from {_describe(value)}: {exc} "
                             "(give a WAV, FLAC or OGG file, or 1-D float samples with 'sample_rate')") from None
        samples = data.mean(axis=1) if data.shape[1] > 1 else data[:, 0]
    else:
        raise MediaError(f"{where}: audio must be a file path, an encoded file's bytes or a 1-D float tensor, "
                         f"got {type(value).__name__}")
    if samples.size == 0:
        raise MediaError(f"{where}: the audio is empty")
    if not np.isfinite(samples).all():
        raise MediaError(f"{where}: the audio has NaN or infinite samples")
    if rate != target_rate:
        import soxr

        samples = soxr.resample(samples, rate, target_rate).astype(np.float32, copy=False)
    if max_samples is not None and samples.size > max_samples:
        raise MediaError(f"{where}: the audio is {samples.size / target_rate:.2f} s long; this model takes at most "
                         f"{max_samples / target_rate:g} s (its feature extractor's chunk_length)")
    return np.ascontiguousarray(samples)


def load_image(value: Any, where: str, *, origin: Any = None):
    """``value`` (a path, an encoded image's bytes, or an H x W x 3 uint8 tensor/array) as an RGB
    ``PIL.Image``. ``origin``: the request's context (or ``ctx.from_network``), for the local-file
    rule."""
    from PIL import Image

    array = _array(value)
    if array is not None:
        if array.ndim != 3 or array.shape[2] != 3:
            raise MediaError(f"{where}: an image tensor must be H x W x 3 (RGB), got shape {list(array.shape)}")
        if array.dtype != np.uint8:
            raise MediaError(f"{where}: an image tensor must be uint8 (0-255), got dtype {array.dtype}")
        image = Image.fromarray(np.ascontiguousarray(array), "RGB")
    elif isinstance(value, (str, os.PathLike, bytes, bytearray, memoryview)):
        source = _source(value, where, origin)
        try:
            with Image.open(source) as opened:
                image = opened.convert("RGB")
        except Exception as exc:  # noqa: BLE001 - Pillow raises OSError, UnidentifiedImageError, ValueError ...
            raise MediaError(f"{where}: cannot read an image from {_describe(value)}: {exc} "
                             "(give a PNG or JPEG file, or an H x W x 3 uint8 tensor)") from None
    else:
        raise MediaError(f"{where}: an image must be a file path, an encoded image's bytes or an H x W x 3 uint8 "
                         f"tensor, got {type(value).__name__}")
    width, height = image.size
    if min(width, height) < 1:
        raise MediaError(f"{where}: the image is empty ({width} x {height})")
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise MediaError(f"{where}: the image is {width} x {height}; its sides' ratio must be at most "
                         f"{MAX_ASPECT_RATIO}")
    return image
