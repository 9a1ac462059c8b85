"""Loading targets: the GGUF conversion, NF4 on CPU, and every bad input ending in one clear error."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.config import SamplingConfig
from core.engine import Engine
from models import target as target_module
from models.embedded import EMBEDDED_GGUF, embedded_gguf
from models.errors import ModelLoadError, UnsupportedModelError
from models.target import LoadSpec, load_target

ROOT = Path(__file__).resolve().parent.parent


def test_gguf_conversion_is_plain_and_exact(embedded_dir, embedded_target):
    from transformers import AutoModelForCausalLM

    config = json.loads((embedded_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert (embedded_dir / "model.safetensors").is_file() and (embedded_dir / "tokenizer.json").is_file()
    gguf = embedded_gguf()
    assert gguf.name == EMBEDDED_GGUF
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    ids = torch.tensor([[1, 504, 3575, 282, 4649, 314, 2]])
    with torch.no_grad():
        assert torch.equal(reference(ids).logits, embedded_target.model(ids).logits)


def test_conversion_happens_once(embedded_dir, cache_dir):
    stamp = (embedded_dir / "model.safetensors").stat().st_mtime_ns
    load_target(LoadSpec(quant="none", device="cpu", cache_dir=cache_dir))
    assert (embedded_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_nf4_load_of_a_tiny_model_on_cpu(tiny_dir, cache_dir):
    import bitsandbytes as bnb

    t = load_target(LoadSpec(model=str(tiny_dir), quant="nf4", device="cpu", cache_dir=cache_dir))
    linears = [m for m in t.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linears) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert linears[0].weight.quant_type == "nf4"
    assert t.quant == "nf4" and "nf4" in t.label
    steps = list(Engine(t).generate([1, 2, 3], SamplingConfig(max_new_tokens=5)))
    assert sum(len(s.new_ids) for s in steps) == 5


def test_full_precision_folder_load(tiny_dir, cache_dir):
    t = load_target(LoadSpec(model=str(tiny_dir), quant="none", device="cpu", cache_dir=cache_dir))
    assert t.name == tiny_dir.name and t.context_len == 1024 and t.quant == "none"


def test_a_folder_that_is_not_a_model(tmp_path, cache_dir):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelLoadError, match="not a model"):
        load_target(LoadSpec(model=str(tmp_path), device="cpu", cache_dir=cache_dir))


def test_an_unsupported_architecture(tmp_path, cache_dir):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel is not supported"):
        load_target(LoadSpec(model=str(tmp_path), device="cpu", cache_dir=cache_dir))


def test_a_model_id_that_cannot_be_downloaded(cache_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="Could not download 'nobody/no-such-model'"):
        load_target(LoadSpec(model="nobody/no-such-model", device="cpu", cache_dir=cache_dir))
    with pytest.raises(ModelLoadError, match="neither a local folder nor a Hugging Face id"):
        load_target(LoadSpec(model="not a model id", device="cpu", cache_dir=cache_dir))


def test_nf4_without_bitsandbytes(monkeypatch, cache_dir):
    real = target_module.importlib.util.find_spec
    monkeypatch.setattr(target_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(UnsupportedModelError, match="needs the bitsandbytes package"):
        load_target(LoadSpec(quant="nf4", device="cpu", cache_dir=cache_dir))


def test_cuda_asked_for_without_a_gpu(cache_dir):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(UnsupportedModelError, match="no CUDA GPU"):
        load_target(LoadSpec(device="cuda", cache_dir=cache_dir))


@pytest.mark.parametrize("args, message", [
    (["--model", "/no/such/folder"], "neither a local folder nor a Hugging Face id"),
    (["--model", "nobody/no-such-model"], "Could not download"),
])
def test_cli_bad_model_is_one_line_and_exit_code_2(args, message, tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, str(ROOT / "launch.py"), *args, "--no-browser"], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len([line for line in r.stderr.splitlines() if line.startswith("Aerie:")]) == 1


def test_tiny_model_greedy_matches_generate_when_loaded_from_a_folder(tiny_dir, cache_dir):
    t = load_target(LoadSpec(model=str(tiny_dir), quant="none", device="cpu", cache_dir=cache_dir))
    ids = torch.tensor([[1, 2, 3, 4]])
    ref = t.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, 4:].tolist()
    ours = [x for s in Engine(t).generate([1, 2, 3, 4], SamplingConfig(max_new_tokens=8)) for x in s.new_ids]
    assert ours[: len(ref)] == ref


def test_sliding_window_models_are_refused(tmp_path, cache_dir):
    config = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 4096}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="sliding-window attention"):
        load_target(LoadSpec(model=str(tmp_path), device="cpu", cache_dir=cache_dir))


def test_unknown_device(cache_dir):
    with pytest.raises(UnsupportedModelError, match="Unknown device 'bogus'"):
        load_target(LoadSpec(device="bogus", cache_dir=cache_dir))
