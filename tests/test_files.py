"""The local-file rule (omni_core.files.local_path): local callers name any file; requests from the
network none, unless serve.allow_local_files names a directory their paths resolve inside — after
``..`` and symlinks — with one answer whatever the file outside is (there, missing, unreadable)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from omni_core import InvalidInput
from omni_core.files import allowed_root, configure, from_network, local_path


@pytest.fixture
def root(tmp_path):
    """A root directory allowed to requests from the network, beside a folder that is not."""
    inside = tmp_path / "root"
    (inside / "sub").mkdir(parents=True)
    (inside / "in.wav").write_bytes(b"x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    (outside / "locked.txt").write_text("locked")
    os.chmod(outside / "locked.txt", 0)
    (inside / "link-out").symlink_to(outside)  # a symlink in the root that leads out of it
    (inside / "link-file").symlink_to(outside / "secret.txt")
    (inside / "link-in").symlink_to(inside / "sub")
    configure(inside)
    yield inside, outside
    configure(None)
    os.chmod(outside / "locked.txt", 0o600)


class Ctx:
    def __init__(self, from_network: bool):
        self.from_network = from_network


def test_a_local_caller_names_any_file_as_before(tmp_path):
    configure(None)
    assert local_path(None, str(tmp_path / "a.wav"), "wav_path") == tmp_path / "a.wav"
    assert local_path(Ctx(False), "~/x.wav", "wav_path") == Path.home() / "x.wav"
    assert local_path(False, "../rel.wav", "wav_path") == Path("../rel.wav")


def test_without_a_root_a_request_from_the_network_names_no_file(tmp_path):
    configure(None)
    assert allowed_root() is None
    for value in ("/etc/hostname", str(tmp_path / "missing.wav"), "rel.wav", "../x.wav", "%2e%2e/x"):
        with pytest.raises(InvalidInput) as info:
            local_path(Ctx(True), value, "wav_path", write=True)
        assert info.value.field == "wav_path"
        assert "serve.allow_local_files" in str(info.value) and str(info.value).startswith("wav_path: ")
    assert not (tmp_path / "missing.wav").exists()


def test_inside_the_root_paths_resolve_there(root):
    inside, _ = root
    net = Ctx(True)
    assert local_path(net, "in.wav", "audio") == inside / "in.wav"
    assert local_path(net, str(inside / "sub" / "new.wav"), "wav_path", write=True) == inside / "sub" / "new.wav"
    assert local_path(net, "sub/../in.wav", "audio") == inside / "in.wav"
    assert local_path(net, "link-in/new.wav", "wav_path") == inside / "sub" / "new.wav"
    # taken literally: URL-encoded dots, "~" and "file:" are names inside the root
    assert local_path(net, "%2e%2e/%2e%2e/etc/passwd", "audio") == inside / "%2e%2e" / "%2e%2e" / "etc" / "passwd"
    assert local_path(net, "~/x", "audio") == inside / "~" / "x"
    assert local_path(net, "file:///etc/passwd", "audio") == inside / "file:" / "etc" / "passwd"


@pytest.mark.parametrize("value", [
    "../outside/secret.txt", "../outside/missing.txt", "../outside/locked.txt",
    "{outside}/secret.txt", "{outside}/missing.txt", "{outside}/locked.txt",
    "link-out/secret.txt", "link-out/missing.txt", "link-file", "sub/../../outside/secret.txt",
    "/etc/passwd", "/", ".", "", "sub/..",
])
def test_nothing_outside_the_root_and_one_answer_whatever_is_there(root, value):
    inside, outside = root
    value = value.format(outside=outside)
    with pytest.raises(InvalidInput) as info:
        local_path(Ctx(True), value, "messages[0].content[1]")
    assert info.value.field == "messages[0].content[1]"
    message = str(info.value)
    # the answer names the value sent, never what is (or is not) there
    assert message.replace(repr(value), "VALUE") in {
        "messages[0].content[1]: VALUE is not a file inside the directory this server lets requests name "
        "(serve.allow_local_files): give a path relative to it",
        "messages[0].content[1]: expected a file path (a non-empty string), got str",
    }
    assert str(outside) not in message.replace(value, "") and str(inside) not in message.replace(value, "")
    assert not (outside / "missing.txt").exists()


def test_not_a_path_is_refused_naming_the_field(root):
    for value in (5, None, b"x", "a\x00b", ""):
        with pytest.raises(InvalidInput) as info:
            local_path(Ctx(True), value, "image")
        assert info.value.field == "image"
        with pytest.raises(InvalidInput):
            local_path(None, value, "image")


def test_the_origin_is_a_context_a_bool_or_none():
    assert from_network(Ctx(True)) and not from_network(Ctx(False))
    assert from_network(True) and not from_network(None) and not from_network(False)
    with pytest.raises(TypeError, match="needs the stage's context"):
        from_network(object())


def test_invalid_input_is_a_value_error_naming_its_field():
    exc = InvalidInput("max_tokens must be at most 64", field="max_tokens")
    assert isinstance(exc, ValueError) and exc.field == "max_tokens" and str(exc) == "max_tokens must be at most 64"
    assert InvalidInput("bad").field is None


def test_serve_allow_local_files_is_a_directory_or_null():
    from omni_core import ConfigError, load_config

    base = {"name": "p", "stages": [{"name": "a", "factory": "x.y", "terminal": True}]}
    assert load_config(base, validate=False).serve.allow_local_files is None
    assert load_config({**base, "serve": {"allow_local_files": "/srv/files"}},
                       validate=False).serve.allow_local_files == "/srv/files"
    for bad in (True, "", 5):
        with pytest.raises(ConfigError, match=r"serve\.allow_local_files: expected the directory requests may name "
                                              r"files in \(a path\), or null for none"):
            load_config({**base, "serve": {"allow_local_files": bad}}, validate=False)
