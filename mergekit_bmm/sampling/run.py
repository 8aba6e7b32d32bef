"""Draw S merged models around a ``bmm`` recipe's MAP merge (``mergekit-bmm-sample``).

One ``run_merge`` of the recipe, exactly as ``mergekit-yaml`` would run it, writes the
MAP merge to ``OUT/map``. While it runs, a listener receives every tensor the ``bmm``
kernel solves — with the λ', s, Gram and layout mergekit resolved for it — and, for the
tensors chosen by ``--filter``, writes S draws into ``OUT/sample-000`` … Then the MAP's
shards are split so that the samples can share every unsampled tensor (see ``layout``).

Two kinds of draws, on the merged task vector ``U`` (``W = W_pre + s·U``):

* ``posterior`` (paper App. B): each row of ``U`` ~ ``N(u_MAP_row, β⁻¹ (G + λ'I)⁻¹)``;
* ``iid`` (the paper's baseline): ``U = U_MAP + σ·Z`` with i.i.d. standard normal ``Z``.

Sample k of tensor ``name`` uses the same ``Z`` in both modes (per-(seed, name, k)
generators), so the two differ only by the covariance.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from mergekit_bmm.errors import ConfigError
from mergekit_bmm.io.model_folder import local_model_dir
from mergekit_bmm.merge_methods.finite import checked_output
from mergekit_bmm.merge_methods.observer import SolvedTensor, listening
from mergekit_bmm.merge_methods.pieces import Piece, assemble
from mergekit_bmm.sampling import layout
from mergekit_bmm.sampling.posterior import RowPosterior, check_beta, check_sigma, standard_normal

SUMMARY_NAME = "samples.json"
MEMBER_INFO = "bmm_sample.json"
INCOMPLETE_MARKER = ".bmm-sample-incomplete"
MAP_DIR = "map"
# Samples are buffered in memory until a shard is full; all S buffers together stay
# under this many bytes.
BUFFER_BYTES = 2 * 1024**3
MIN_SHARD_BYTES = 64 * 1024**2


def member_name(index: int) -> str:
    return f"sample-{index:03d}"


@dataclass(frozen=True)
class SamplingRequest:
    """What to draw: ``samples`` models from the posterior (``beta``) or i.i.d. (``iid_sigma``)."""

    samples: int
    beta: float | None = None
    iid_sigma: float | None = None
    name_filter: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise ConfigError(f"--samples must be an integer >= 1; got {self.samples}")
        if (self.beta is None) == (self.iid_sigma is None):
            raise ConfigError(
                "give exactly one of --beta (posterior samples) and --iid-sigma (i.i.d. baseline)"
            )
        if self.beta is not None:
            check_beta(self.beta)
        else:
            check_sigma(self.iid_sigma)
        if self.name_filter is not None and not self.name_filter.strip():
            raise ConfigError("--filter is empty; give a substring of the tensor names to sample, or omit it")
        if self.seed < 0:
            raise ConfigError(f"--random-seed must be >= 0; got {self.seed}")

    @property
    def mode(self) -> str:
        return "posterior" if self.beta is not None else "iid"

    def selects(self, name: str) -> bool:
        return self.name_filter is None or self.name_filter in name


@dataclass
class TensorRecord:
    """What users need to judge a sampled tensor's noise level (all on ``U``, not ``W``)."""

    name: str
    shape: list[int]
    ridge: float
    scale: float
    map_rms: float
    noise_std: float
    posterior_std_at_beta_1: float | None = None


@dataclass
class Summary:
    recipe: str
    mode: str
    beta: float | None
    iid_sigma: float | None
    samples: int
    seed: int
    filter: str | None
    members: list[str]
    tensors: list[TensorRecord]
    link_mode: str = "hardlink"
    disk: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("beta", "iid_sigma"):
            if data[key] is not None and math.isinf(data[key]):
                data[key] = "inf"
        return data


class Sampler:
    """The listener: draws and stores S samples of each selected solved tensor."""

    def __init__(
        self,
        request: SamplingRequest,
        member_dirs: list[Path],
        max_shard_bytes: int,
        out_dtype: torch.dtype | None = None,
    ) -> None:
        self.request = request
        self.out_dtype = out_dtype  # mergekit casts what it saves to the recipe's `out_dtype`
        self.writers = [layout.sample_writer(path, max_shard_bytes) for path in member_dirs]
        self.records: dict[str, TensorRecord] = {}
        self._stacks: dict[tuple[str, int], dict[str, tuple[Piece, torch.Tensor]]] = {}  # (tensor, member)
        self._lock = threading.Lock()

    def __call__(self, solved: SolvedTensor) -> None:
        if not self.request.selects(solved.name):
            return
        merged = solved.merged
        shape = tuple(merged.shape)
        factor, record = self._noise_model(solved)
        for index, writer in enumerate(self.writers):
            if factor is None:
                task_vector = merged
            else:
                draw = standard_normal(shape, self.request.seed, solved.name, index).to(merged.device)
                noise = draw @ factor if factor.ndim == 2 else draw * factor
                task_vector = merged + noise.to(merged.dtype)
            weight = solved.weight(task_vector)
            if self.out_dtype is not None:
                weight = weight.to(self.out_dtype)
            remedy = "a smaller --iid-sigma" if self.request.iid_sigma is not None else "a larger --beta"
            hint = f"sample {index}: the noise overflows the output dtype; use {remedy}"
            checked_output(weight, solved.name, "mergekit-bmm-sample", hint)
            self._save(writer, index, solved, layout.as_cpu(weight))
        with self._lock:
            self.records[solved.name] = record

    def written(self) -> set[str]:
        """The tensor names the members hold: a mixture-of-experts stack once for its experts."""
        return {name.rsplit("[", 1)[0] if name.endswith("]") else name for name in self.records}

    def _save(self, writer: Any, member: int, solved: SolvedTensor, weight: torch.Tensor) -> None:
        """Write a member's tensor; a piece (an expert of a stack, a part of a fused weight) waits for
        its siblings, each drawn from its own posterior, and the tensor is written whole."""
        piece = solved.piece
        if piece is None:
            writer.save_tensor(solved.name, weight)
            return
        tensor = solved.name.rsplit("[", 1)[0]
        with self._lock:
            parts = self._stacks.setdefault((tensor, member), {})
            parts[piece.label] = (piece, weight)
            whole = len(parts) == piece.count
            if whole:
                del self._stacks[(tensor, member)]
        if whole:
            writer.save_tensor(tensor, assemble(list(parts.values())))

    def _noise_model(self, solved: SolvedTensor) -> tuple[torch.Tensor | None, TensorRecord]:
        """``M`` (posterior) or σ (i.i.d.), or None when the draw is the MAP itself."""
        merged = solved.merged
        record = TensorRecord(
            name=solved.name,
            shape=list(merged.shape),
            ridge=solved.ridge,
            scale=solved.scale,
            map_rms=float(merged.double().pow(2).mean().sqrt()),
            noise_std=0.0,
        )
        if self.request.mode == "iid":
            sigma = float(self.request.iid_sigma)
            record.noise_std = sigma
            factor = None if sigma == 0 else torch.tensor(sigma, dtype=torch.float64, device=merged.device)
            return factor, record
        if math.isinf(self.request.beta):
            return None, record  # the MAP itself: no factorisation needed
        if solved.eigen is not None:
            eigenvalues, basis = solved.eigen
            posterior = RowPosterior.from_eigen(
                eigenvalues, basis, solved.ridge, self.request.beta, solved.compute_dtype, solved.name
            )
        else:
            posterior = RowPosterior.from_gram(
                solved.gram, solved.ridge, self.request.beta, solved.compute_dtype, solved.name
            )
        record.noise_std = posterior.rms_std()
        record.posterior_std_at_beta_1 = posterior.rms_std(1.0)
        return posterior.noise_factor().to(merged.device), record

    def finalize(self) -> list[dict[str, str]]:
        return [layout.finalize_writer(writer) for writer in self.writers]


def load_recipe(recipe: str | Path | Mapping[str, Any]) -> tuple[Any, str, str]:
    """(MergeConfiguration, YAML text, recipe path or '') for a path or a dict."""
    from mergekit_bmm.recipes import parse

    parsed = parse.load_recipe(recipe)
    source = "" if isinstance(recipe, Mapping) else str(Path(recipe).resolve())
    found = parsed.raw.get("merge_method")
    if found != "bmm":
        raise ConfigError(
            f"mergekit-bmm-sample needs a `merge_method: bmm` recipe; {source or 'the recipe'} has {found!r}"
        )
    return parsed.config, parsed.text, source


def solvable_tensors(base_dir: Path) -> list[str] | None:
    """Names of the base checkpoint's tensors that bmm solves (None if not a local folder)."""
    from safetensors import safe_open

    from mergekit_bmm.core.module_map import classify
    from mergekit_bmm.io.model_folder import model_type_of

    files = sorted(base_dir.glob("*.safetensors")) if base_dir.is_dir() else []
    if not files:
        return None
    from mergekit_bmm.stats.expert_hooks import stacked_names

    model_type = model_type_of(str(base_dir))
    names = []
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                ndim = len(handle.get_slice(name).get_shape())
                if ndim in (2, 3) and classify(name, model_type, ndim):  # 3: mixture-of-experts stacks
                    names.append(name)
    return sorted(set(names) | stacked_names(names, model_type))  # stacks as mergekit presents them


def check_filter(request: SamplingRequest, base_dir: Path) -> None:
    """Refuse a filter that matches none of the tensors bmm solves, before merging."""
    names = solvable_tensors(base_dir)
    if names is None or not request.name_filter:
        return
    if not any(request.selects(name) for name in names):
        examples = ", ".join(names[-3:])
        raise ConfigError(
            f"--filter {request.name_filter!r} matches none of the {len(names)} tensors bmm solves in "
            f"{base_dir} (e.g. {examples}); give a substring of one of them"
        )


def prepare_out(out: Path, force: bool = False) -> None:
    """Refuse to write over anything that is not our own run (an unfinished one, or with
    ``force`` a finished one); other files are never touched."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"OUT_PATH {out} is a file; give a new folder")
    if out.is_dir() and any(out.iterdir()):
        foreign = sorted(entry.name for entry in out.iterdir() if not _is_ours(entry))
        if foreign:
            raise ConfigError(
                f"OUT_PATH {out} holds files mergekit-bmm-sample did not write ({', '.join(foreign[:3])}); "
                "give a new folder (samples are never written over other files, even with --force)"
            )
        if not (out / INCOMPLETE_MARKER).exists() and not force:
            raise ConfigError(
                f"OUT_PATH {out} holds an earlier sample run; give a new folder, or pass --force to "
                "replace it"
            )
        clear_ours(out)  # an interrupted run of ours, or a finished one with --force: start again
    out.mkdir(parents=True, exist_ok=True)
    (out / INCOMPLETE_MARKER).write_text("mergekit-bmm-sample is writing this folder\n", encoding="utf-8")


def _is_ours(entry: Path) -> bool:
    return entry.name in (MAP_DIR, SUMMARY_NAME, INCOMPLETE_MARKER) or entry.name.startswith("sample-")


def clear_ours(out: Path) -> None:
    for entry in out.iterdir():
        if _is_ours(entry):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def sample_models(
    recipe: str | Path | Mapping[str, Any],
    out_dir: str | Path,
    request: SamplingRequest,
    options: Any = None,
    force: bool = False,
) -> Summary:
    """Write ``OUT/map`` and ``OUT/sample-000`` …; return (and write) the summary. ``force``
    replaces an earlier finished run of this command in ``out_dir``."""
    import mergekit.merge
    from mergekit.options import MergeOptions

    options = options or MergeOptions()
    if not options.safe_serialization:
        raise ConfigError("mergekit-bmm-sample writes safetensors only; drop --no-safe-serialization")
    config, text, source = load_recipe(recipe)
    if config.base_model is None:
        raise ConfigError("a bmm recipe needs `base_model:`")
    check_filter(request, local_model_dir(config.base_model.model.path))  # a Hub id: its snapshot

    out = Path(out_dir).resolve()
    created = not out.exists()
    prepare_out(out, force)
    try:
        # looked up now, not at import: the plugin's wrapper once it is activated
        summary = _sample(config, text, source, out, request, options, mergekit.merge.run_merge)
    except BaseException:
        clear_ours(out)
        if created and not any(out.iterdir()):
            out.rmdir()
        raise
    (out / INCOMPLETE_MARKER).unlink()
    return summary


def _sample(config, text, source, out: Path, request: SamplingRequest, options, run_merge) -> Summary:
    map_dir = out / MAP_DIR
    members = [member_name(index) for index in range(request.samples)]
    member_dirs = [out / name for name in members]
    shard_bytes = max(MIN_SHARD_BYTES, min(options.out_shard_size, BUFFER_BYTES // request.samples))
    from mergekit.common import dtype_from_name

    sampler = Sampler(request, member_dirs, shard_bytes, dtype_from_name(config.out_dtype))
    with listening(on_solved=sampler):
        run_merge(config, str(map_dir), options=options, config_source=text)
    sampled_maps = sampler.finalize()
    if not sampler.records:
        which = f"--filter {request.name_filter!r} matched" if request.name_filter else "the recipe has"
        raise ConfigError(f"{which} no tensor that bmm solved, so there is nothing to sample")

    shared, map_sampled = layout.split_map(map_dir, sampler.written(), options.out_shard_size)
    modes = set()
    for name, directory, sampled in tqdm(
        list(zip(members, member_dirs, sampled_maps)), desc="Assembling samples", disable=options.quiet
    ):
        if set(sampled) != set(map_sampled):
            raise RuntimeError(f"{name} holds other tensors than the MAP's sampled ones")
        modes.add(layout.assemble_sample(map_dir, directory, shared, sampled))
        info = {"member": name, "index": members.index(name), "of": members, **_request_json(request)}
        (directory / MEMBER_INFO).write_text(json.dumps(info, indent=2), encoding="utf-8")
        (directory / "README.md").write_text(_member_card(name, request, source), encoding="utf-8")

    summary = Summary(
        recipe=source,
        mode=request.mode,
        beta=request.beta,
        iid_sigma=request.iid_sigma,
        samples=request.samples,
        seed=request.seed,
        filter=request.name_filter,
        members=members,
        tensors=[sampler.records[name] for name in sorted(sampler.records)],
        link_mode="copy" if "copy" in modes else "symlink" if "symlink" in modes else "hardlink",
        disk={
            "map_bytes": layout.folder_bytes(map_dir),
            "shared_bytes": sum(layout.tensor_bytes(map_dir / f) for f in set(shared.values())),
            "bytes_per_sample": max(layout.own_bytes(directory) for directory in member_dirs),
        },
    )
    temporary = out / (SUMMARY_NAME + ".tmp")
    temporary.write_text(json.dumps(summary.to_json(), indent=2), encoding="utf-8")
    temporary.replace(out / SUMMARY_NAME)
    return summary


def _request_json(request: SamplingRequest) -> dict[str, Any]:
    beta = request.beta
    return {
        "mode": request.mode,
        "beta": "inf" if beta is not None and math.isinf(beta) else beta,
        "iid_sigma": request.iid_sigma,
        "seed": request.seed,
        "filter": request.name_filter,
    }


def _member_card(name: str, request: SamplingRequest, source: str) -> str:
    if request.mode == "posterior":
        what = f"a draw from the BMM posterior (paper App. B) with β = {request.beta}"
    else:
        what = f"the MAP merge perturbed with i.i.d. Gaussian noise σ = {request.iid_sigma}"
    return (
        f"# {name}\n\nOne of {request.samples} merged models written by `mergekit-bmm-sample`"
        f"{' from ' + source if source else ''}: {what}, seed {request.seed}, on the tensors whose "
        f"name contains {request.name_filter!r} (all tensors bmm solves if None). Every other tensor is "
        "the MAP merge in `../map`, shared through the `shared-*.safetensors` files. Average the "
        "softmax outputs of all members for the ensemble prediction.\n"
    )
