"""Folders of sampled models that share every unsampled tensor on disk.

A sampled model differs from the MAP merge only in the sampled tensors, so S full copies
would waste S−1 models of disk. The layout::

    OUT/map/         the MAP merge, its weights split into
                       shared-0000i-of-0000K.safetensors  every tensor that is not sampled
                       sampled[-0000j-of-0000M].safetensors  the MAP value of the sampled ones
                       model.safetensors.index.json
    OUT/sample-000/  shared-*.safetensors  hard links to OUT/map's (symlinks or copies where
                                           the file system has no hard links)
                     sampled[-…].safetensors  this sample's tensors
                     model.safetensors.index.json, config.json, tokenizer files (linked)

No folder holds ``model.safetensors`` (transformers would read it and ignore the index),
and no tensor is stored twice in one folder, so transformers, mergekit and any tool that
reads the index or iterates over the shards load the same weights.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from mergekit.io.tensor_writer import TensorWriter

from mergekit_bmm.io.atomic import atomic_write_json

INDEX_NAME = "model.safetensors.index.json"
SAMPLED_BASENAME = "sampled"
SHARED_BASENAME = "shared"
_NOT_LINKED = {INDEX_NAME, "README.md"}


def weight_map_of(model_dir: Path) -> dict[str, str]:
    """Tensor name → file, through mergekit's own index reader."""
    from mergekit.io.lazy_tensor_loader import ShardedTensorIndex

    return dict(ShardedTensorIndex.from_disk(str(model_dir)).tensor_paths)


def tensor_bytes(path: Path) -> int:
    """Bytes of tensor data in a safetensors file (from its header; no data read)."""
    with open(path, "rb") as handle:
        (header_length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_length))
    return sum(
        end - start
        for key, entry in header.items()
        if key != "__metadata__"
        for start, end in [entry["data_offsets"]]
    )


def write_index(model_dir: Path, weight_map: Mapping[str, str]) -> None:
    files = sorted(set(weight_map.values()))
    total = sum(tensor_bytes(model_dir / name) for name in files)
    content = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write_json(model_dir / INDEX_NAME, content)


def sample_writer(model_dir: Path, max_shard_bytes: int) -> TensorWriter:
    return TensorWriter(str(model_dir), max_shard_size=max_shard_bytes, override_basename=SAMPLED_BASENAME)


def finalize_writer(writer: TensorWriter) -> dict[str, str]:
    """Finish a sample writer; its tensor → file map with the final shard names.

    mergekit's writer renames a lone shard to ``sampled.safetensors`` without updating its
    map, and writes its own index for several shards; ours replaces that index.
    """
    writer.finalize()
    if writer.shards_written == 1:
        only = f"{SAMPLED_BASENAME}.safetensors"
        return {name: only for name in writer.weight_map}
    Path(writer.out_path, f"{SAMPLED_BASENAME}.safetensors.index.json").unlink(missing_ok=True)
    return dict(writer.weight_map)


def split_map(map_dir: Path, sampled: Iterable[str], max_shard_bytes: int) -> tuple[dict, dict]:
    """Move the sampled tensors of the MAP merge out of its shards.

    Shards without sampled tensors are only renamed; the others are rewritten (one shard
    in memory at a time). Returns (shared map, MAP's sampled map), names → files.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    sampled = set(sampled)
    current = weight_map_of(map_dir)
    files = sorted(set(current.values()))
    if any(not name.endswith(".safetensors") for name in files):
        raise RuntimeError(f"{map_dir} was not written as safetensors")
    shared: dict[str, str] = {}
    writer = sample_writer(map_dir, max_shard_bytes)
    for number, file_name in enumerate(files, start=1):
        path = map_dir / file_name
        names = [name for name, owner in current.items() if owner == file_name]
        target = f"{SHARED_BASENAME}-{number:05d}-of-{len(files):05d}.safetensors"
        keep = [name for name in names if name not in sampled]
        if len(keep) == len(names):
            os.replace(path, map_dir / target)
        else:
            with safe_open(str(path), framework="pt") as handle:
                rest = {name: handle.get_tensor(name) for name in keep}
                for name in names:
                    if name in sampled:
                        writer.save_tensor(name, handle.get_tensor(name))
            if rest:
                temporary = map_dir / (target + ".tmp")
                save_file(rest, str(temporary), metadata={"format": "pt"})
                temporary.replace(map_dir / target)
            del rest
            path.unlink()
        shared.update({name: target for name in keep})
    sampled_map = finalize_writer(writer)
    write_index(map_dir, {**shared, **sampled_map})
    return shared, sampled_map


def link(source: Path, target: Path) -> str:
    """Hard link ``source`` at ``target``; fall back to a relative symlink, then a copy."""
    try:
        os.link(source, target)
        return "hardlink"
    except OSError:
        pass
    try:
        os.symlink(os.path.relpath(source, target.parent), target)
        return "symlink"
    except OSError:
        shutil.copy2(source, target)
        return "copy"


def assemble_sample(
    map_dir: Path, sample_dir: Path, shared: Mapping[str, str], sampled: Mapping[str, str]
) -> str:
    """Complete a sample folder whose sampled shards are already written; the link mode used."""
    modes = set()
    own = set(sampled.values())
    for entry in sorted(map_dir.iterdir()):
        if not entry.is_file() or entry.name in _NOT_LINKED or entry.name.startswith(SAMPLED_BASENAME):
            continue
        if entry.name in own or (sample_dir / entry.name).exists():
            continue
        modes.add(link(entry, sample_dir / entry.name))
    write_index(sample_dir, {**shared, **sampled})
    return "copy" if "copy" in modes else "symlink" if "symlink" in modes else "hardlink"


def own_bytes(model_dir: Path) -> int:
    """Disk bytes a folder adds on top of the files it shares (hard links count once, at the MAP)."""
    total = 0
    for entry in model_dir.iterdir():
        if entry.is_symlink():
            continue
        info = entry.stat()
        if entry.is_file() and info.st_nlink == 1:
            total += info.st_size
    return total


def folder_bytes(model_dir: Path) -> int:
    return sum(entry.stat().st_size for entry in model_dir.iterdir() if entry.is_file())


def as_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous()
