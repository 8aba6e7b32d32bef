"""What several benchmarks share: locally generated model families and memory readings."""

from __future__ import annotations

import copy
import json
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch


def ensure_llama_family(
    root: Path,
    hidden: int,
    intermediate: int,
    layers: int,
    experts: int,
    heads: int = 16,
    kv_heads: int = 4,
    device: str = "cpu",
) -> dict:
    """Base + experts as bfloat16 safetensors under ``root`` (generated once, then reused), made on
    ``device``: the CPU by default, bit for bit as before; a GPU makes an 8B-shaped family in seconds."""
    spec = {"hidden": hidden, "intermediate": intermediate, "layers": layers, "experts": experts, "v": 1}
    if (heads, kv_heads) != (16, 4):
        spec.update(heads=heads, kv_heads=kv_heads)
    if device != "cpu":
        spec.update(device=device)
    folder = root / (
        "family-{hidden}-{intermediate}-{layers}-{experts}".format(**spec)
        + ("" if (heads, kv_heads) == (16, 4) else f"-{heads}h{kv_heads}")
    )
    marker = folder / "family.json"
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return {"base": folder / "base", "experts": [folder / f"expert-{i}" for i in range(experts)]}
    import transformers
    from transformers.utils import logging as hf_logging

    from mergekit_bmm.examples.tiny_models import build_tokenizer, perturb_as_expert

    hf_logging.disable_progress_bar()
    print(f"generating the benchmark model family in {folder} (once) ...", flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    tokenizer = build_tokenizer()
    config = llama_config(len(tokenizer), hidden, intermediate, layers, heads, kv_heads)
    torch.manual_seed(0)
    # The base as stored: rounded to bfloat16, so experts differ from it only by their update.
    with torch.device(device):
        base = transformers.LlamaForCausalLM(config).eval().to(torch.bfloat16).float()
    paths = {"base": folder / "base", "experts": [folder / f"expert-{i}" for i in range(experts)]}
    for index, path in enumerate([paths["base"], *paths["experts"]]):
        model = copy.deepcopy(base)
        if index > 0:
            perturb_as_expert(model, seed=1000 + index)
        model.to(torch.bfloat16).to("cpu").save_pretrained(path)
        tokenizer.save_pretrained(path)
        del model
    del base
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the merges measured next get the whole GPU
    marker.write_text(json.dumps(spec))
    return paths


def ensure_encoder_family(
    folder: Path, hidden: int = 384, layers: int = 6, experts: int = 6, tasks: int = 3
) -> tuple[dict, dict]:
    """A BERT family (MiniLM's shape by default) with ``tasks`` random two-class heads on one text set:
    (``{"base", "experts"}``, a classification evaluator block). Made once per folder; a search on it
    measures trial mechanics, not accuracy (the labels are arbitrary)."""
    from mergekit_bmm.evaluation.classification import save_head
    from mergekit_bmm.examples.tiny_models import _CORPUS, make_tiny_family

    family_dir = folder / "family"
    if not (family_dir / "base" / "config.json").is_file():
        make_tiny_family(family_dir, "bert", n_experts=experts, hidden=hidden, layers=layers)
    base = family_dir / "base"
    found = sorted(p for p in family_dir.iterdir() if p.name.startswith("expert"))
    data = folder / "texts.jsonl"
    data.write_text(
        "".join(json.dumps({"text": t, "label": i % 2}) + "\n" for i, t in enumerate(_CORPUS * 20))
    )
    blocks = []
    for index in range(tasks):
        generator = torch.Generator().manual_seed(index)
        weight = torch.randn(2, hidden, generator=generator)
        head = save_head(folder / f"head{index}.safetensors", weight, torch.zeros(2), ["a", "b"])
        blocks.append({"name": f"task{index}", "head": str(head), "data": str(data)})
    evaluator = {"type": "classification", "max_length": 32, "batch_size": 32, "tasks": blocks}
    return {"base": base, "experts": found}, evaluator


def write_corpus_texts(
    path: Path, count: int, words: int | Callable[[int], int], stride: int = 1, offset: int = 0
) -> Path:
    """JSONL (``{"text": ...}``) of ``count`` made-up texts for statistics: text ``i`` is ``words``
    (or ``words(i)``) consecutive words of the tiny corpus from word ``stride·i + offset``."""
    from mergekit_bmm.examples.tiny_models import _CORPUS

    size = len(_CORPUS)
    with open(path, "w", encoding="utf-8") as handle:
        for index in range(count):
            length = words(index) if callable(words) else words
            start = stride * index + offset
            text = " ".join(_CORPUS[(start + k) % size] for k in range(length))
            handle.write(json.dumps({"text": text}) + "\n")
    return path


def llama_config(
    vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, positions: int = 512
):
    """A Llama configuration of the given shape for the tiny tokenizer (untied embeddings)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def move_body_low_rank(model, strength: float, seed: int, rank: int = 8, noise: float = 2e-4) -> None:
    """Move every 2D weight of the decoder layers by a rank-``rank`` update of ``strength``·mean|W|
    per entry plus a little noise: an expert whose task vectors have a known shape and size."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.ndim == 2 and ".layers." in name:
                rows, columns = parameter.shape
                left = torch.randn(rows, rank, generator=generator) * parameter.abs().mean() * strength
                right = torch.randn(rank, columns, generator=generator) / rank**0.5
                parameter += left @ right + noise * torch.randn(rows, columns, generator=generator)


def status_fields(pid: int | str = "self") -> dict[str, float]:
    """Every ``kB`` field of ``/proc/<pid>/status`` (VmRSS, VmHWM, RssAnon, ...) in MiB, read once;
    empty when the process has ended."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            fields[key] = int(parts[0]) / 1024
    return fields


def status_mib(field: str, pid: int | str = "self") -> float:
    """One field of ``/proc/<pid>/status`` in MiB; NaN if absent."""
    return status_fields(pid).get(field, float("nan"))


def reset_peak_rss() -> None:
    """Reset this process's VmHWM to its current RSS (Linux ``clear_refs``), where allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


class PeakSampler:
    """The peaks of ``/proc/<pid>/status`` fields, sampled on a thread (the one memory sampler).

    The kernel keeps a peak only for the whole RSS (VmHWM), which also counts the pages of the
    memory-mapped input checkpoints: those are file-backed and grow with the inputs read, so
    private (anonymous) memory, ``RssAnon``, is what says whether a merge holds more as the
    model deepens. ``pid`` may be a child process (a stock command run by the benchmark).
    """

    def __init__(self, *fields: str, pid: int | str = "self", interval: float = 0.01) -> None:
        self.fields, self.pid, self.interval = fields or ("RssAnon",), pid, interval
        self.peaks = {field: 0.0 for field in self.fields}
        self._done = threading.Event()
        self._sample_once()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample_once(self) -> None:
        found = status_fields(self.pid)  # one read of the status file per sample, whatever the fields
        for field in self.fields:
            if field in found:
                self.peaks[field] = max(self.peaks[field], found[field])

    def _sample(self) -> None:
        while not self._done.wait(self.interval):
            self._sample_once()

    def stop(self) -> dict[str, float]:
        """Stop sampling; the peak of every field in MiB."""
        self._done.set()
        self._thread.join()
        self._sample_once()
        return dict(self.peaks)


def solved_shapes(base_dir: Path) -> list[tuple[str, int, int]]:
    """(name, out, in) of every weight bmm solves."""
    from mergekit_bmm.core.module_map import classify
    from mergekit_bmm.io.checkpoint import iter_tensors
    from mergekit_bmm.io.model_folder import model_type_of

    model_type = model_type_of(base_dir)
    shapes = []
    for name, tensor in iter_tensors(base_dir):
        if tensor.ndim == 2 and classify(name, model_type) is not None:
            shapes.append((name, *tensor.shape))
    return shapes


def gemm_floor(shapes, repeats: int, device: str = "cpu") -> float:
    """Minimum over ``repeats`` of the summed ``(out × in) @ (in × in)`` float32 products:
    what one cached trial (or resident trial) cannot go below."""
    totals = []
    for _ in range(repeats):
        total = 0.0
        for _, out_features, in_features in shapes:
            coefficients = torch.randn(out_features, in_features, device=device)
            basis = torch.randn(in_features, in_features, device=device)
            _synchronize(device)
            start = time.perf_counter()
            coefficients @ basis.T
            _synchronize(device)
            total += time.perf_counter() - start
        totals.append(total)
    return min(totals)


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
