"""A checkpoint folder is something omni serves: ``omni plan|run DIR`` pick the model family by the
folder's ``config.json`` ``model_type`` and run its pipeline on it; ``--model DIR`` gives a
family's pipeline its checkpoint; a folder no family knows is one line naming its model type and
the families installed. Through the real console script, without ``OMNI_TRANSFORMERS_MODEL``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from omni_core.testing.leaks import no_leaks  # noqa: F401 - a fixture

pytestmark = [pytest.mark.timeout(600)]


def omni(*args, cwd):
    exe = shutil.which("omni")
    assert exe, "the omni console script is not installed"
    env = {k: v for k, v in os.environ.items() if k != "OMNI_TRANSFORMERS_MODEL"}
    return subprocess.run([exe, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=500)


def test_omni_plan_on_a_checkpoint_folder_plans_its_familys_pipeline_with_the_folder_as_every_stages_model(
        tiny_model, tmp_path):
    out = omni("plan", str(tiny_model), "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["pipeline"] == "qwen2_5_omni"
    given = omni("plan", "qwen2_5_omni.split", "--model", str(tiny_model), "--json", cwd=tmp_path)
    assert given.returncode == 0, given.stderr
    # The stages' argument checks see the folder as their model (and no checkpoint without it).
    checked = omni("validate", str(tiny_model), cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    without = omni("validate", "qwen2_5_omni", cwd=tmp_path)
    assert without.returncode != 0 and "OMNI_TRANSFORMERS_MODEL is not set" in without.stdout + without.stderr


def test_a_folder_no_family_serves_is_one_line_naming_its_model_type_and_the_installed_families(tmp_path):
    folder = tmp_path / "mamba"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    for command in ("plan", "run"):
        extra = ["--input", "{}"] if command == "run" else []
        out = omni(command, str(folder), *extra, cwd=tmp_path)
        assert out.returncode != 0
        line = [x for x in out.stderr.splitlines() if "model_type" in x]
        assert len(line) == 1, out.stderr
        assert "'mamba'" in line[0] and "installed families: " in line[0]
        families = ("qwen2_5_omni (qwen2_5_omni)", "qwen3_omni (qwen3_omni_moe)", "whisper (whisper)", "csm (csm)")
        assert all(family in line[0] for family in families), line[0]
    empty = omni("plan", str(tmp_path / "mamba" / ".."), cwd=tmp_path)
    assert empty.returncode != 0 and "no config.json in it" in empty.stderr


@pytest.mark.usefixtures("no_leaks")
def test_omni_run_on_a_checkpoint_folder_and_with_model_answers_from_that_checkpoint(tiny_model, tmp_path):
    inputs = json.dumps({"text": "hello", "max_new_tokens": 4, "return_audio": False})
    by_folder = omni("run", str(tiny_model), "--input", inputs, cwd=tmp_path)
    assert by_folder.returncode == 0, by_folder.stderr
    by_model = omni("run", "qwen2_5_omni", "--model", str(tiny_model), "--input", inputs, cwd=tmp_path)
    assert by_model.returncode == 0, by_model.stderr
    first, second = json.loads(by_folder.stdout), json.loads(by_model.stdout)
    assert first["completion_tokens"] == 4 and first["token_ids"] == second["token_ids"]


def test_omni_serve_on_a_checkpoint_folder_serves_its_familys_pipeline_with_the_openai_sdk(tiny_model, tmp_path):
    import openai
    from omni_core.testing.serve import ServerProcess

    srv = ServerProcess(str(tiny_model), env={"OMNI_TRANSFORMERS_MODEL": ""}, cwd=str(tmp_path), ready_timeout=300)
    with srv.serving(stop_timeout=120):
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["qwen2_5_omni"]
        reply = client.chat.completions.create(model="qwen2_5_omni", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, modalities=["text"])
        assert reply.usage.completion_tokens == 4 and reply.choices[0].finish_reason == "length"


def test_omni_serve_with_model_gives_a_family_pipeline_its_checkpoint(tiny_model, tmp_path):
    import openai
    from omni_core.testing.serve import ServerProcess

    srv = ServerProcess("qwen2_5_omni", "--model", str(tiny_model), env={"OMNI_TRANSFORMERS_MODEL": ""},
                        cwd=str(tmp_path), ready_timeout=300)
    with srv.serving(stop_timeout=120):
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
        reply = client.chat.completions.create(model="qwen2_5_omni", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3, modalities=["text"])
        assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
    missing = omni("serve", "qwen2_5_omni", "--model", str(tmp_path / "nowhere"), "--port", "0", cwd=tmp_path)
    assert missing.returncode != 0 and "nowhere" in missing.stderr, missing.stderr
