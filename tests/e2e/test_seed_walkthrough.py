"""The seed document's walkthrough (docs/seeds/, a copy of ../shared/seeds/003_*): its curl commands, extracted
from the text and run as written by bash (jq included) against the default store's stack, with only
localhost:8000 / localhost:8001 swapped for the test stack's two HTTP ports. The replies have the reference
code's shapes (orca3/llm-model-inference, ch03)."""
from __future__ import annotations

import json
import math
import re
import shlex
import subprocess

import grpc

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc
from tests.helpers import REPO_ROOT

SEED = REPO_ROOT / "docs" / "seeds" / "003_30b5e5246002264f.txt"
SHARED_SEED = REPO_ROOT.parent / "shared" / "seeds" / SEED.name
SEED_SPAM_ID = "6ba7b810-9dad-11d1-80b4-00c04fd430c8"
SPAM_DETECTOR_ID = "7e083728-92bb-5cb5-af8d-7a2c04fcdd9b"


def seed_curl_commands(text: str | None = None) -> list[str]:
    """Every ``curl`` command of the seed text (or ``text``), as bash reads it: backslash-continued lines
    and a quoted body over several lines belong to it."""
    commands, current = [], None
    for line in (SEED.read_text() if text is None else text).splitlines():
        if current is None and line.startswith("curl "):
            current = []
        if current is not None:
            current.append(line)
            if not line.rstrip().endswith("\\") and _complete("\n".join(current)):
                commands.append("\n".join(current))
                current = None
    return commands


def _complete(command: str) -> bool:
    try:
        shlex.split(command)
        return True
    except ValueError:  # "No closing quotation": the quoted body goes on
        return False


def test_the_seed_copy_is_the_seed_and_has_the_walkthrough():
    if SHARED_SEED.is_file():
        assert SEED.read_bytes() == SHARED_SEED.read_bytes()
    commands = seed_curl_commands()
    paths = [c.split("http://", 1)[1].split()[0] for c in commands]
    assert '"The most efficient way to"' in commands[1] and commands[1].endswith("| jq")
    assert paths == ["localhost:8000/basic_generate", "localhost:8000/generate", "localhost:8000/generate_stream",
                     "localhost:8001/models", "localhost:8001/predict", "localhost:8001/models"]


def test_the_readme_shows_the_seed_commands_as_written():
    """The README's seed section is the seed's commands, character for character (run below)."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## The seed's HTTP API", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    assert seed_curl_commands(block) == seed_curl_commands()


def _run(stack, command: str) -> str:
    command = command.replace("localhost:8000", stack.http_address).replace("localhost:8001",
                                                                            stack.second_http_address)
    result = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{command}\n{result.stderr}"
    print(f"$ {command}\n{result.stdout[:1500]}")  # pytest -s shows the walkthrough as a user sees it
    return result.stdout


def test_the_seed_walkthrough_as_written(smol_stack):
    assert smol_stack.second_http_address
    basic, batch, stream, models_before, predict, models_after = seed_curl_commands()
    # The cold start is the point of the multi-model half: start with the spam detector unloaded.
    with grpc.insecure_channel(smol_stack.engines[0].address) as channel:
        engine_admin_pb2_grpc.EngineAdminStub(channel).UnloadModel(
            engine_admin_pb2.UnloadModelRequest(model="spam-detector"), timeout=60)

    reply = json.loads(_run(smol_stack, basic))
    assert set(reply) == {"generated_text"} and reply["generated_text"].strip()

    reply = json.loads(_run(smol_stack, batch))
    assert set(reply) == {"generated_texts"} and len(reply["generated_texts"]) == 5
    assert all(isinstance(t, str) and t.strip() for t in reply["generated_texts"])

    out = _run(smol_stack, stream)
    events = [json.loads(block[len("data: "):]) for block in out.split("\n\n") if block.strip()]
    assert len(events) >= 2 and all(set(e) == {"token", "sequence_id"} for e in events), out
    assert len({e["sequence_id"] for e in events}) == 1 and "".join(e["token"] for e in events).strip()

    before = json.loads(_run(smol_stack, models_before))
    assert set(before) == {"available_models", "loaded_models"}
    assert SPAM_DETECTOR_ID not in before["loaded_models"], before["loaded_models"]
    spam = before["available_models"][SPAM_DETECTOR_ID]
    assert spam["name"] == "spam-detector" and SEED_SPAM_ID in spam["aliases"]

    reply = json.loads(_run(smol_stack, predict))
    (probabilities,) = reply["predictions"]
    assert reply["labels"] == ["ham", "spam"] and math.isclose(sum(probabilities), 1.0, rel_tol=1e-4)
    assert probabilities[1] > 0.5 > probabilities[0], reply   # "Win a free iPhone now!" is spam

    after = json.loads(_run(smol_stack, models_after))
    assert after["loaded_models"][SPAM_DETECTOR_ID] == "spam-detector"
    assert after["available_models"][SPAM_DETECTOR_ID]["loaded"]


def test_generate_answers_in_prompt_order(smol_stack):
    """Greedy, so each text of the batch is the one its prompt gives alone."""
    url = f"http://{smol_stack.http_address}"
    prompts = ["The weather is", "I want to"]

    def post(path: str, body: dict) -> dict:
        result = subprocess.run(["curl", "-sf", "-X", "POST", url + path, "-H", "Content-Type: application/json",
                                 "-d", json.dumps(body)], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    alone = [post("/basic_generate", {"prompt": p, "max_tokens": 8, "temperature": 0})["generated_text"]
             for p in prompts]
    batch = post("/generate", {"prompts": prompts, "max_tokens": 8, "temperature": 0})["generated_texts"]
    assert batch == alone and alone[0] != alone[1]


def test_predict_on_an_embedding_model_answers_the_vector(smol_stack):
    result = subprocess.run(["curl", "-s", "-X", "POST", f"http://{smol_stack.second_http_address}/predict",
                             "-H", "Content-Type: application/json",
                             "-d", json.dumps({"model_id": "all-MiniLM-L6-v2", "input_data": "The cat sits on the mat"})],
                            capture_output=True, text=True, timeout=300)
    reply = json.loads(result.stdout)
    assert reply["dimension"] == len(reply["predictions"][0]) == 384, reply
