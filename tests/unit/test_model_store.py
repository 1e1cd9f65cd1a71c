"""The model store file: the shipped store parses; malformed ones fail naming the line."""
from __future__ import annotations

import pytest

from services.common.errors import NotFound
from services.engine.models.store import StoreError, load_store, single_model_store
from tests.helpers import REPO_ROOT

ENTRY = """  - id: {id}
    name: {name}
    task: {task}
    format: safetensors
    source: {source}
    dtype: float32
    context_length: 256
    memory_estimate_mb: 100
"""
ID_A = "1d8a0c56-6a7b-4a4b-9a35-3f0f0f0f0f0f"
ID_B = "2d8a0c56-6a7b-4a4b-9a35-3f0f0f0f0f0f"


def write(tmp_path, text):
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return path


def test_the_shipped_store_serves_three_real_models_and_two_on_onnx_runtime():
    store = load_store(REPO_ROOT / "models.yaml")
    tasks = {e.name: (e.task, e.format) for e in store.entries}
    assert tasks == {"SmolLM2-135M-Instruct": ("text-generation", "gguf"),
                     "all-MiniLM-L6-v2": ("embedding", "safetensors"),
                     "spam-detector": ("text-classification", "safetensors"),
                     "all-MiniLM-L6-v2-onnx": ("embedding", "onnx"),
                     "spam-detector-onnx": ("text-classification", "onnx")}
    assert store.get("spam-detector-onnx").train_data == store.get("spam-detector").train_data
    assert store.get("").name == "SmolLM2-135M-Instruct"
    spam = store.get("spam-detector")
    assert store.get(spam.id) is spam and spam.train_data == str(REPO_ROOT / "data" / "spam_ham.tsv")
    with pytest.raises(NotFound, match="spam-detector.*ListModels"):
        store.get("no-such-model")


def test_relative_sources_resolve_against_the_store_file(tmp_path):
    store = load_store(write(tmp_path, "models:\n" + ENTRY.format(id=ID_A, name="a", task="embedding", source="m/a")))
    assert store.get("a").source == str(tmp_path / "m" / "a")
    assert store.get(ID_A).memory_estimate_bytes == 100 * 2**20


def test_single_model_store_keeps_the_old_id():
    store = single_model_store("SmolLM2-135M-Instruct", "smollm2", "gguf", "float32")
    assert store.get("").id == "e13d5280-156b-5d7d-a113-50451d287dfe" == load_store(
        REPO_ROOT / "models.yaml").get("SmolLM2-135M-Instruct").id


@pytest.mark.parametrize("text,line,words", [
    ("models: []\n", 1, "non-empty 'models:' list"),
    ("models:\n" + ENTRY.format(id=ID_A, name="a", task="chat", source="x"), 2, "task must be one of"),
    ("models:\n" + ENTRY.format(id=ID_A, name="a", task="embedding", source="x")
     + ENTRY.format(id=ID_B, name="a", task="embedding", source="x"), 10, "'a' is already used on line 2"),
    ("models:\n" + ENTRY.format(id=ID_A, name="a", task="text-classification", source="x"), 2, "train_data"),
    ("models:\n" + ENTRY.format(id=ID_A, name="a", task="embedding", source="x") + "    colour: blue\n", 2,
     "unknown field(s) colour"),
    ("default_model: b\nmodels:\n" + ENTRY.format(id=ID_A, name="a", task="embedding", source="x"), 1,
     "default_model 'b'"),
    ("models:\n  - id: [\n", 3, "not valid YAML"),
])
def test_malformed_stores_name_the_line(tmp_path, text, line, words):
    path = write(tmp_path, text)
    with pytest.raises(StoreError) as err:
        load_store(path)
    assert f"{path} line {line}" in str(err.value) and words in str(err.value), str(err.value)


def test_with_dtype_runs_every_model_in_that_dtype():
    store = load_store(REPO_ROOT / "models.yaml")
    bf16 = store.with_dtype("bfloat16")
    assert {e.dtype for e in bf16.entries} == {"bfloat16"} and bf16.default.name == store.default.name
    # narrower: the estimate is kept (safe); wider: it grows with the bytes per weight
    assert [e.memory_estimate_bytes for e in bf16.entries] == [e.memory_estimate_bytes for e in store.entries]
    back = bf16.with_dtype("float32")
    assert [e.memory_estimate_bytes for e in back.entries] == [2 * e.memory_estimate_bytes for e in store.entries]


SEED_SPAM_ID = "6ba7b810-9dad-11d1-80b4-00c04fd430c8"


def test_the_seed_spam_id_is_an_alias_of_the_spam_detector():
    store = load_store(REPO_ROOT / "models.yaml")
    spam = store.get("spam-detector")
    assert spam.aliases == (SEED_SPAM_ID,) and store.get(SEED_SPAM_ID) is spam


def test_aliases_are_canonical_uuids_or_names_and_must_be_unique(tmp_path):
    entry = ENTRY.format(id=ID_A, name="a", task="embedding", source="x")
    store = load_store(write(tmp_path, "models:\n" + entry + f"    aliases: [{SEED_SPAM_ID.upper()}, old-a]\n"))
    assert store.get(SEED_SPAM_ID).name == "a" and store.get("old-a").name == "a"
    with pytest.raises(StoreError, match="line 11.*'a' is already used on line 2"):
        load_store(write(tmp_path, "models:\n" + entry + "    aliases: [b]\n"
                         + ENTRY.format(id=ID_B, name="b2", task="embedding", source="x") + "    aliases: [a]\n"))
    with pytest.raises(StoreError, match="line 2.*aliases must be a list"):
        load_store(write(tmp_path, "models:\n" + entry + "    aliases: old-a\n"))


def test_format_onnx_serves_encoders_and_may_name_its_file(tmp_path):
    entry = ENTRY.format(id=ID_A, name="a", task="embedding", source="m").replace("safetensors", "onnx")
    store = load_store(write(tmp_path, "models:\n" + entry + "    onnx_file: graphs/a.onnx\n"))
    assert store.get("a").format == "onnx" and store.get("a").onnx_file == str(tmp_path / "graphs" / "a.onnx")
    with pytest.raises(StoreError, match="line 2.*format onnx serves embedding and text-classification"):
        load_store(write(tmp_path, "models:\n" + entry.replace("task: embedding", "task: text-generation")))
    plain = ENTRY.format(id=ID_A, name="a", task="embedding", source="m")
    with pytest.raises(StoreError, match="line 2.*onnx_file needs format onnx"):
        load_store(write(tmp_path, "models:\n" + plain + "    onnx_file: a.onnx\n"))


def test_native_is_for_gguf_models_and_the_default_store_serves_it(tmp_path):
    store = load_store(REPO_ROOT / "models.yaml")
    assert store.default.dtype == "native" and store.default.format == "gguf"
    native = store.with_dtype("float32").with_dtype("native")     # the engine's --dtype native: GGUF models only
    assert {(e.format, e.dtype) for e in native.entries} == {("gguf", "native"), ("safetensors", "float32"), ("onnx", "float32")}
    text = "models:\n" + ENTRY.format(id=ID_A, name="a", task="embedding", source="x").replace(
        "dtype: float32", "dtype: native")
    assert "dtype: native" in text
    with pytest.raises(StoreError, match="dtype native runs a GGUF file's own blocks"):
        load_store(write(tmp_path, text))
