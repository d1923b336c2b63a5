"""LoRA adapters for llama.cpp: GGUF LoRA files, and PEFT adapters converted into one.

llama.cpp reads adapters in its own GGUF LoRA format (what llama.cpp's
`convert_lora_to_gguf.py` writes). So that the adapter an AI engineer trained with PEFT last
night deploys on a GGUF base as it is, a PEFT directory is converted here, once, into the cache:
each `lora_A`/`lora_B` pair becomes `<gguf tensor>.lora_a` / `.lora_b`, and PEFT's scaling
(alpha / r, or alpha / sqrt(r) with rsLoRA, per module) is folded into `lora_b`, so llama.cpp
applies the adapter at scale 1.

Only architectures whose Hugging Face weights are laid out as in GGUF are converted: for
llama-family models the GGUF converter permutes the query and key rows, and an adapter on
those needs the same permutation (use llama.cpp's converter for them).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np

from shoal.runtimes.model_files import cache_dir, write_once

GGUF_MAGIC = b"GGUF"

# GGUF architectures whose converter copies the linear layers' weights unchanged.
_UNPERMUTED_ARCHITECTURES = {"gemma", "gemma2", "gemma3", "qwen2", "qwen3", "phi3", "starcoder2"}
_PEFT_PREFIX = "base_model.model."


def is_gguf_file(path: Path) -> bool:
    """True for a file that starts like a GGUF file (model or adapter)."""
    try:
        with path.open("rb") as file:
            return file.read(4) == GGUF_MAGIC
    except OSError:
        return False


def gguf_adapter_path(adapter: str, architecture: str, layers: int) -> Path:
    """A GGUF LoRA file llama.cpp can load for `adapter` (a GGUF file or a PEFT directory).

    A PEFT directory is converted on first use into the cache (keyed by the adapter's
    content and the base's architecture) and reused afterwards. Raises ValueError for what
    cannot be served.
    """
    path = Path(adapter).expanduser()
    if path.is_file():
        if not is_gguf_file(path):
            raise ValueError(f"{adapter} is neither a GGUF LoRA file nor a PEFT directory")
        return path
    check_convertible(path)
    weights = path / "adapter_model.safetensors"
    digest = hashlib.sha256(architecture.encode())  # the tensor names depend on it
    for part in (path / "adapter_config.json", weights):
        digest.update(part.read_bytes())
    target = cache_dir() / "adapters" / f"{path.name}-{digest.hexdigest()[:16]}.gguf"
    if not target.exists():
        tensors = peft_to_gguf_tensors(path, architecture, layers)
        write_once(target, lambda partial: write_gguf_lora(partial, architecture, tensors))
    return target


def check_convertible(path: Path) -> None:
    """Raise ValueError unless `path` is a PEFT LoRA directory this module can convert.

    What needs the base model (its architecture, its tensor names) is checked on conversion.
    """
    config_path = path / "adapter_config.json"
    if not config_path.is_file():
        raise ValueError(f"{path} is not a PEFT adapter (no adapter_config.json)")
    if not (path / "adapter_model.safetensors").is_file():
        raise ValueError(f"{path} has no adapter_model.safetensors (save it with safetensors)")
    config = json.loads(config_path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path} is a {config['peft_type']} adapter; llama.cpp serves LoRA")
    if config.get("use_dora"):
        raise ValueError(f"{path} is a DoRA adapter; llama.cpp serves plain LoRA")


def peft_to_gguf_tensors(path: Path, architecture: str, layers: int) -> dict[str, np.ndarray]:
    """The GGUF LoRA tensors of a PEFT adapter directory, scaling folded into `lora_b`."""
    import gguf
    from safetensors.numpy import load_file

    if architecture not in _UNPERMUTED_ARCHITECTURES:
        raise ValueError(
            f"converting a PEFT adapter for a {architecture!r} model is not supported; "
            "convert it with llama.cpp's convert_lora_to_gguf.py and deploy the .gguf file"
        )
    config = json.loads((path / "adapter_config.json").read_text())
    arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[architecture]
    names = gguf.get_tensor_name_map(arch, layers)
    weights = load_file(str(path / "adapter_model.safetensors"))
    tensors: dict[str, np.ndarray] = {}
    for key, lora_a in weights.items():
        if not key.endswith(".lora_A.weight"):
            if not key.endswith(".lora_B.weight"):
                raise ValueError(f"{key}: only LoRA matrices on linear layers can be converted")
            continue
        module = key.removesuffix(".lora_A.weight").removeprefix(_PEFT_PREFIX)
        lora_b = weights[key.replace(".lora_A.", ".lora_B.")]
        target = names.get_name(module + ".weight", try_suffixes=(".weight",))
        if target is None:
            raise ValueError(f"{module}: no matching tensor in a {architecture} GGUF model")
        scale = _peft_scaling(config, module, rank=lora_a.shape[0])
        tensors[f"{target}.lora_a"] = lora_a.astype(np.float32)
        tensors[f"{target}.lora_b"] = (lora_b.astype(np.float32) * scale).astype(np.float32)
    if not tensors:
        raise ValueError(f"{path} holds no LoRA matrices")
    return tensors


def _peft_scaling(config: dict, module: str, rank: int) -> float:
    """PEFT's multiplier for one module: lora_alpha / r (or / sqrt(r) with rsLoRA)."""
    alpha = float(config.get("lora_alpha", 8))
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if module.endswith(pattern):
            alpha = float(value)
    divisor = math.sqrt(rank) if config.get("use_rslora") else rank
    return alpha / divisor


def write_gguf_lora(target: Path, architecture: str, tensors: dict[str, np.ndarray]) -> None:
    """Write tensors as a GGUF LoRA adapter that llama.cpp applies at scale 1 (alpha 0)."""
    import gguf

    writer = gguf.GGUFWriter(str(target), architecture)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 0.0)  # 0: no alpha / rank rescaling
    for name, tensor in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(tensor))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
