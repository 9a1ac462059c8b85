"""Loading the target model: a Hugging Face causal LM, NF4 4-bit (bitsandbytes) or unquantized.

`load_target` turns what the user typed (nothing, a Hub id or a folder) into a `Target`: the model,
its tokenizer and the facts the engine needs. Every way this can fail ends in one `AerieError`
with a sentence the user can act on. This module knows nothing about decoding or speculation.
"""

import importlib.util
import json

from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from models.cpu_quant import quantize_cpu
from models.download import MODEL_PATTERNS, hub_cache
from models.embedded import EMBEDDED_NAME, embedded_model_dir
from models.errors import ModelLoadError, UnsupportedModelError
from models.quants import CPU_QUANTS, QUANTS

# Decoder-only architectures whose HF implementation takes a 4D attention mask, explicit
# position ids and a `Cache` object, and whose every layer is full attention.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True)
class LoadSpec:
    model: str | None = None      # Hub id, local folder, or None for the embedded default
    quant: str | None = None      # "nf4", "int4", "int8" or "none"; None = nf4 on CUDA, int4 on CPU
    device: str | None = None     # "cuda", "cuda:1", "cpu"; None = CUDA when available
    cache_dir: Path = Path.home() / ".cache" / "aerie"
    batched: bool = False         # many rows per forward (training, answer generation): None = none on CPU


@dataclass(frozen=True)
class Target:
    model: torch.nn.Module
    tokenizer: object
    name: str
    device: torch.device
    quant: str
    dtype: torch.dtype            # activation / compute dtype
    context_len: int              # max_position_embeddings
    eos_ids: tuple[int, ...]

    @property
    def label(self) -> str:
        return f"{self.name} · {self.device.type} · {self.quant if self.quant != 'none' else str(self.dtype).removeprefix('torch.')}"


def model_name(model: str | None) -> str:
    """What a model is called (the embedded one, or the last part of its Hub id or folder)."""
    return EMBEDDED_NAME if model is None else model.rstrip("/").split("/")[-1]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_quant(quant: str | None, device: torch.device, batched: bool = False) -> str:
    # int4's CPU kernel re-reads the weights every 4 rows: it wins for a chat's few rows, not for batches.
    quant = quant or ("nf4" if device.type == "cuda" else "none" if batched else "int4")
    if quant not in QUANTS:
        raise UnsupportedModelError(f"Unknown quantization '{quant}': choose one of {', '.join(QUANTS)}.")
    if quant in CPU_QUANTS and device.type != "cpu":
        raise UnsupportedModelError(f"--quant {quant} runs on torch's CPU kernels; on a GPU use nf4 or none.")
    if quant == "nf4" and importlib.util.find_spec("bitsandbytes") is None:
        raise UnsupportedModelError("--quant nf4 needs the bitsandbytes package: install it, or use --quant none.")
    return quant


def compute_dtype(device: torch.device) -> torch.dtype:
    # bf16 where the GPU has it (Ampere+), fp16 on older GPUs, fp32 on CPU (bf16 matmuls are slow on AVX2).
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def resolve_model_dir(model: str | None, cache_dir: Path) -> Path:
    if model is None:
        return embedded_model_dir(cache_dir)
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"'{model}' is a folder but not a model: it has no config.json.")
        return path
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        raise ModelLoadError(f"'{model}' is neither a local folder nor a Hugging Face id like 'org/name'.")
    return download(model, cache_dir)


def download(repo_id: str, cache_dir: Path) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=MODEL_PATTERNS, cache_dir=hub_cache(cache_dir)))
    except RepositoryNotFoundError as e:
        raise ModelLoadError(f"Hugging Face has no model '{repo_id}' (or it is gated): check the id.") from e
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise ModelLoadError(
            f"Could not download '{repo_id}' from Hugging Face ({type(e).__name__}): check your connection, "
            "or pass a local folder."
        ) from e


def check_architecture(model_dir: Path) -> dict:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"Cannot read {model_dir / 'config.json'}: {e}.") from e
    archs = config.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise UnsupportedModelError(
            f"Architecture {', '.join(archs) or 'unknown'} is not supported; Aerie runs "
            f"{', '.join(a.removesuffix('ForCausalLM') for a in SUPPORTED_ARCHITECTURES)} models."
        )
    if uses_sliding_window(config):
        raise UnsupportedModelError(
            f"{model_dir.name} uses sliding-window attention, which Aerie's tree verification does not model yet; "
            "pick a model whose layers all use full attention.")
    return config


def uses_sliding_window(config: dict) -> bool:
    """Mistral-7B-v0.1 sets `sliding_window`; Qwen2/3 only use theirs when `use_sliding_window`;
    newer configs name it per layer in `layer_types`."""
    if "sliding_attention" in (config.get("layer_types") or []):
        return True
    return config.get("sliding_window") is not None and config.get("use_sliding_window", True) is not False


@dataclass(frozen=True)
class Resolved:
    """A model found and checked, not yet loaded: enough to plan where its weights go."""
    spec: LoadSpec
    model_dir: Path
    config: dict
    device: torch.device
    quant: str
    dtype: torch.dtype


def resolve(spec: LoadSpec) -> Resolved:
    try:
        device = torch.device(spec.device) if spec.device else default_device()
    except RuntimeError as e:
        raise UnsupportedModelError(f"Unknown device '{spec.device}': use cuda, cuda:N or cpu.") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedModelError("--device cuda was asked for but no CUDA GPU is visible to torch.")
    quant = resolve_quant(spec.quant, device, spec.batched)
    model_dir = resolve_model_dir(spec.model, spec.cache_dir)
    return Resolved(spec, model_dir, check_architecture(model_dir), device, quant, compute_dtype(device))


def load_target(spec: LoadSpec) -> Target:
    return load_resolved(resolve(spec))


def load_resolved(r: Resolved, gpu_weight_bytes: int | None = None) -> Target:
    """Load the weights; with `gpu_weight_bytes`, at most that much stays on the GPU and the rest is
    offloaded to RAM (accelerate moves each offloaded layer in for its forward)."""
    gpu = r.device.index or 0
    device_map = {"": gpu if r.device.type == "cuda" else r.device.type}
    kwargs = {"dtype": r.dtype, "device_map": device_map}
    if gpu_weight_bytes is not None:
        kwargs.update(device_map="auto", max_memory={gpu: gpu_weight_bytes, "cpu": psutil.virtual_memory().available})
    if r.quant == "nf4":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=r.dtype,
            bnb_4bit_use_double_quant=True, llm_int8_enable_fp32_cpu_offload=gpu_weight_bytes is not None)
    try:
        tokenizer = AutoTokenizer.from_pretrained(r.model_dir)
        model = AutoModelForCausalLM.from_pretrained(r.model_dir, **kwargs).eval()
        if r.quant in CPU_QUANTS:
            quantize_cpu(model, r.quant)
    except torch.cuda.OutOfMemoryError as e:
        raise ModelLoadError(f"Not enough GPU memory to load {r.model_dir.name}; try a smaller model.") from e
    except (OSError, ValueError, SafetensorError) as e:
        raise ModelLoadError(f"Could not load the model from {r.model_dir}: {(str(e).splitlines() or [type(e).__name__])[0]}") from e
    return Target(model=model, tokenizer=tokenizer, name=model_name(r.spec.model), device=r.device, quant=r.quant, dtype=r.dtype,
                  context_len=int(r.config.get("max_position_embeddings") or 2048), eos_ids=eos_ids(model, tokenizer))


def eos_ids(model, tokenizer) -> tuple[int, ...]:
    """Every id that ends an answer: the generation config's eos list plus the tokenizer's eos."""
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(sorted(set(ids)))


