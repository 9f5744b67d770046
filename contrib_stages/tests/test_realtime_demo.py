"""The ``realtime`` API on the demo pipeline (``omni serve demo --api realtime``) with the official
``openai`` SDK: a spoken turn reaches the demo's audio encoder and comes back as streamed speech and
transcript, and the examples of docs/serving.md ("Realtime") run as written."""

from __future__ import annotations

import asyncio
import base64
import math
import os
import re
import subprocess
import sys
import wave
from pathlib import Path

import openai
import pytest

from omni_core.testing.serve import ServerProcess

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).parent
SPEECH_WAV = HERE / "data" / "hello_24k.wav"
DOCS = HERE.parents[1] / "docs" / "serving.md"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess("demo", "--api", "realtime", cwd=str(tmp_path_factory.mktemp("serve")), ready_timeout=300)
    with srv.serving():
        yield srv


def test_a_spoken_turn_reaches_the_demo_and_comes_back_as_speech(server):
    with wave.open(str(SPEECH_WAV)) as w:
        speech = w.readframes(w.getnframes())

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        async with client.realtime.connect(model="demo", max_retries=0) as conn:
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
            for i in range(0, len(speech), 4800):
                await conn.input_audio_buffer.append(audio=base64.b64encode(speech[i:i + 4800]).decode())
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            events = []
            async for event in conn:
                events.append(event)
                if event.type == "response.done":
                    return events

    events = asyncio.run(asyncio.wait_for(main(), 120))
    kinds = [e.type for e in events]
    assert "error" not in kinds, [e for e in events if e.type == "error"]
    done = events[-1].response
    assert done.status == "completed"
    words = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta").split()
    assert len(words) == 13 == done.usage.output_tokens  # one sentence of the demo's thinker
    pcm = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    assert len(pcm) == (13 * 4 + 1) * 1200 * 2  # the demo vocoder's 24 kHz audio for 13 words
    assert kinds.index("response.output_audio.delta") < kinds.index("response.output_audio_transcript.done")
    # The demo read the speech: its prompt tokens count the audio encoder's rows of these samples
    # (16 kHz, 10 ms frames pooled by 4), the image encoder's 16 and the prompt's bytes.
    samples = round(len(speech) // 2 * 16000 / 24000)
    assert done.usage.input_tokens == math.ceil((samples // 160 + 1) / 4) + 16 + len(b"user: (audio)")


def docs_examples() -> list[str]:
    text = DOCS.read_text()
    section = text[text.index("\n## Realtime\n"):]
    section = section[: section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_docs_examples_run_as_written(server, tmp_path):
    quickstart, wav_script = docs_examples()
    (tmp_path / "quickstart.py").write_text(quickstart)
    (tmp_path / "realtime_wav.py").write_text(wav_script)
    env = {**os.environ, "OMNI_URL": server.url}
    out = subprocess.run([sys.executable, "quickstart.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    transcript, summary = out.stdout.strip().splitlines()
    assert len(transcript.split()) == 13
    assert re.fullmatch(r"completed: 2\.65 s of audio, 13 tokens", summary), summary
    out = subprocess.run([sys.executable, "realtime_wav.py", str(SPEECH_WAV)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("[speech from ") and lines[1].startswith("[speech until ")
    assert len(lines[2].split()) == 13 and lines[3] == "[completed]"
    assert lines[4] == "answer.wav: 2.65 s"
    with wave.open(str(tmp_path / "answer.wav")) as w:
        assert (w.getframerate(), w.getnchannels(), w.getnframes()) == (24000, 1, 53 * 1200)
