"""The one timing protocol of the performance workloads (``python -m bench.perf NAME``).

A workload declares what is timed (jobs, each optionally paired with a baseline job) on which
generated models; the protocol is this module's, the same for every workload:

- OpenMP's wait policy is left as the user's process has it, and printed (sleeping waits cost
  many-small-product paths up to 0.13 s a merge, docs/performance.md);
- every run writes into a fresh output folder; the previous one is deleted and every write flushed
  first, untimed (a write into freshly freed blocks of a disk mounted with ``discard`` stalls); a
  job that resumes itself (a search of hours) keeps its folder while the parameters stay the same;
- the jobs of a group run in turn, round by round, the order reversed every other round, so a job
  and its baseline alternate who goes first and a slow spell falls on both;
- warm-up rounds run first and are dropped;
- each job: the median of its rounds with min and max, its ratio to its baseline as the median of
  the rounds' own ratios (min, max), and its peak private memory (``RssAnon``) and RSS (and its peak
  GPU memory, where it used the GPU);
- a header with the machine and the library versions; the table is also written as JSON.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import PeakSampler, cpu_model, reset_peak_rss
from mergekit_bmm.merge_methods.merge_findings import summaries_silenced

# a forked run that writes nothing into its folder for this long is taken for hung (a search of
# hours writes a line per trial, so only silence counts, not the run's length)
FORKED_LIMIT = 3600.0
PROGRESS_POLL = 30.0  # seconds between looks at a forked run's folder


@dataclass
class Job:
    """One timed thing: ``run(out)`` writes into ``out`` (a fresh folder) or ignores it."""

    label: str
    run: Callable[[Path], object]
    baseline: str | None = None  # the job of the same group it is paired with


@dataclass
class Group:
    """Jobs that alternate round by round; ``rounds`` None: the run's rounds (1 for a one-off).

    ``fork``: each run in a process forked after the workload's imports and set-up, on ``threads``
    torch threads (the parent keeps one: GNU OpenMP is not fork-safe once its pool started), so no
    run inherits the allocator's state of the one before and its memory is its own.
    """

    jobs: list[Job]
    rounds: int | None = None
    warmup: int | None = None
    fork: bool = False
    threads: int | None = None
    # each run's folder deleted once the run is measured (untimed): outputs nobody reads again that
    # would not all fit on the disk (a full-depth 8B merge writes 15 GB a run)
    discard: bool = False
    # a one-off job that resumes from what it left in its folder (a search of hours): the folder is
    # kept between runs of the same workload and parameters, so a stopped run loses only the job's
    # own last step; its time is then the job's own clock, not this harness's
    resumes: bool = False


@dataclass
class Workload:
    """A performance workload: its sizes, and how a size becomes groups of jobs (and untimed figures)."""

    name: str
    summary: str
    # "full" (the reported figures) and "quick" (the test suite's: only what differs from "full")
    sizes: dict[str, dict[str, Any]]
    # groups in the order they run; a callable makes its group only when its turn comes (a resident
    # model loaded for the last group must not count in the memory of the merges before it)
    build: Callable[[dict[str, Any], Path], list[Group | Callable[[], Group]]]
    # after the timing, from the parameters, the folder and the rows: accuracy, sizes, ratios of peaks
    figures: Callable[[dict[str, Any], Path, list[dict[str, Any]]], dict[str, Any]] | None = None
    notes: Callable[[dict[str, Any]], str] | None = None  # one line: the shape measured
    picture: Callable[[list[dict[str, Any]], Path], Path | None] | None = None  # a PNG of the rows


@dataclass
class Row:
    label: str
    runs: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # CPU seconds of the run (this process and its children)
    ratios: list[float] = field(default_factory=list)
    baseline: str | None = None
    private_mib: float = 0.0
    rss_mib: float = 0.0
    private_growth_mib: float = 0.0  # over the level at the run's start
    gpu_mib: float | None = None  # peak GPU memory allocated by torch, where the run used the GPU
    pending_cpu: float | None = None  # the last run's CPU seconds, kept once the round counts

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "label": self.label,
            "seconds": round(statistics.median(self.runs), 4),
            "min": round(min(self.runs), 4),
            "max": round(max(self.runs), 4),
            "runs": [round(r, 4) for r in self.runs],
            "cpu_seconds": round(statistics.median(self.cpu), 4) if self.cpu else None,
            "private_mib": round(self.private_mib),
            "private_growth_mib": round(self.private_growth_mib),
            "rss_mib": round(self.rss_mib),
        }
        if self.gpu_mib is not None:
            out["gpu_mib"] = round(self.gpu_mib)
        if self.ratios:
            out.update(
                baseline=self.baseline,
                ratio=round(statistics.median(self.ratios), 3),
                ratio_min=round(min(self.ratios), 3),
                ratio_max=round(max(self.ratios), 3),
            )
        return out


def fresh(folder: Path) -> Path:
    """``folder`` deleted and every pending write flushed (untimed), ready to be written anew."""
    shutil.rmtree(folder, ignore_errors=True)
    os.sync()
    return folder


def _measured(job: Job, out: Path) -> tuple[float, dict[str, float], float]:
    """(seconds, peaks, private MiB at the start) of one run of ``job`` in this process; a job that
    runs a command returns that process's peaks (:func:`command`), which replace this one's."""
    import torch

    from bench.common import status_mib

    reset_peak_rss()
    if torch.cuda.is_initialized():  # a flag: asking never starts CUDA (a process that forks must not)
        torch.cuda.reset_peak_memory_stats()
    start = status_mib("RssAnon")
    sampler = PeakSampler("RssAnon", "VmHWM")
    cpu, started = _cpu_seconds(), time.perf_counter()
    with summaries_silenced():  # a merge's notes on what it kept at the anchor, once per run, are noise here
        returned = job.run(out)
        if torch.cuda.is_initialized():  # the run used the GPU (perhaps first now): its work done
            torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peaks = {**sampler.stop(), "cpu": _cpu_seconds() - cpu}
    if torch.cuda.is_initialized():
        peaks["gpu"] = torch.cuda.max_memory_allocated() / 2**20
    if isinstance(returned, dict) and "VmHWM" in returned:
        return seconds, {**returned, "cpu": peaks["cpu"]}, 0.0
    return seconds, peaks, start


def _cpu_seconds() -> float:
    """CPU time of this process and of the subprocesses it waited for."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def _end_with_the_harness() -> None:
    """In a command's child (Linux): a SIGTERM when the harness process ends, however it ends. A
    merge left running by a killed harness went on writing into the folder of the next run's job."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the harness's own exceptions still stop it
        pass


def command(argv: list[str], env: dict[str, str] | None = None) -> dict[str, float]:
    """Run a command (a stock ``mergekit-yaml``, start-up included) to its end; its peak RSS and peak
    private memory in MiB (sampled every 50 ms) replace this process's as the job's memory. A failure
    stops the workload with the command's last output; a harness that stops first stops it too."""
    import subprocess

    process = subprocess.Popen(
        argv,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_end_with_the_harness,
    )
    sampler = PeakSampler("VmRSS", "RssAnon", pid=process.pid, interval=0.05)
    try:
        output, _ = process.communicate()
    except BaseException:  # Ctrl-C, a timeout: the command goes with the harness
        process.kill()
        raise
    finally:
        peaks = sampler.stop()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:2])} ... failed:\n{output[-3000:]}")
    return {"VmHWM": peaks["VmRSS"], "RssAnon": peaks["RssAnon"]}


def _in_child(connection, job: Job, out: Path, threads: int | None) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)
    try:
        connection.send(("ok", *_measured(job, out)))
    except BaseException as error:  # noqa: BLE001  (reported by the parent)
        connection.send(("error", f"{type(error).__name__}: {error}", {}, 0.0))
    finally:
        connection.close()


def _newest_write(folder: Path) -> float:
    """The latest modification time under ``folder`` (0 while it is empty or absent); a file the run
    renames or deletes while it is read is skipped."""
    newest = 0.0
    try:
        for path in folder.rglob("*"):
            try:
                newest = max(newest, path.stat().st_mtime)
            except OSError:
                continue
    except OSError:  # the folder itself went or came mid-walk
        pass
    return newest


def _await_result(receive, process, out: Path, label: str) -> None:
    """Wait for a forked run while it makes progress; kill it once it died or fell silent."""
    newest, quiet_since = _newest_write(out), time.monotonic()
    while not receive.poll(PROGRESS_POLL):
        if not process.is_alive() and not receive.poll(1.0):  # it may have sent just now
            raise RuntimeError(f"{label}: the forked run ended without a result (exit {process.exitcode})")
        latest = _newest_write(out)
        if latest != newest:
            newest, quiet_since = latest, time.monotonic()
        elif time.monotonic() - quiet_since > FORKED_LIMIT:  # hung (an OpenMP pool the parent started?)
            process.kill()
            raise RuntimeError(
                f"{label}: nothing written for {FORKED_LIMIT:.0f} s; keep the parent on one torch thread"
            )


def _forked(job: Job, out: Path, threads: int | None) -> tuple[float, dict[str, float], float]:
    import multiprocessing

    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_in_child, args=(send, job, out, threads))
    process.start()
    send.close()
    _await_result(receive, process, out, job.label)
    status, seconds, peaks, start = receive.recv()
    process.join()
    if status != "ok":
        raise RuntimeError(f"{job.label}: {seconds}")
    return seconds, peaks, start


def _timed(job: Job, out: Path, row: Row, group: Group) -> float:
    if not group.resumes:
        fresh(out)
    seconds, peaks, start = _forked(job, out, group.threads) if group.fork else _measured(job, out)
    row.private_mib = max(row.private_mib, peaks.get("RssAnon", 0.0))
    row.private_growth_mib = max(row.private_growth_mib, peaks.get("RssAnon", 0.0) - start)
    row.rss_mib = max(row.rss_mib, peaks.get("VmHWM", 0.0))
    if peaks.get("gpu") is not None:
        row.gpu_mib = max(row.gpu_mib or 0.0, peaks["gpu"])
    row.pending_cpu = peaks.get("cpu")
    if group.discard:
        shutil.rmtree(out, ignore_errors=True)
    return seconds


def run_group(group: Group, rounds: int, warmup: int, out_root: Path, echo=print) -> list[Row]:
    """The group's jobs in turn for ``warmup`` + ``rounds`` rounds (warm-up dropped), order reversed
    every other round; rows with each job's times and per-round ratios to its baseline."""
    rounds = group.rounds or rounds
    warmup = group.warmup if group.warmup is not None else warmup
    rows = {job.label: Row(job.label, baseline=job.baseline) for job in group.jobs}
    slugs = {job.label: f"{index}" for index, job in enumerate(group.jobs)}
    for index in range(warmup + rounds):
        order = group.jobs if index % 2 == 0 else list(reversed(group.jobs))
        times = {job.label: _timed(job, out_root / slugs[job.label], rows[job.label], group) for job in order}
        if index < warmup:
            continue
        for job in group.jobs:
            rows[job.label].runs.append(times[job.label])
            if rows[job.label].pending_cpu is not None:
                rows[job.label].cpu.append(rows[job.label].pending_cpu)
            if job.baseline is not None:
                rows[job.label].ratios.append(times[job.label] / times[job.baseline])
        echo(
            f"round {index - warmup + 1}/{rounds}: "
            + ", ".join(f"{label} {times[label]:.3f} s" for label in rows)
        )
    return list(rows.values())


def machine() -> dict[str, Any]:
    """The machine and the library versions the figures were measured with."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    cpu = cpu_model()
    versions = {}
    for name in ("torch", "mergekit", "transformers", "safetensors", "scikit-optimize"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "-"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset (OpenMP's default)"),
        "python": platform.python_version(),
        "versions": versions,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def header(workload: Workload, size: str, parameters: dict[str, Any], rounds: int, warmup: int) -> str:
    info = machine()
    libraries = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    shape = (
        workload.notes(parameters) if workload.notes else ", ".join(f"{k} {v}" for k, v in parameters.items())
    )
    return (
        f"# {workload.name} ({size}): {shape}\n"
        f"# {info['cpu']}, {info['cores']} cores, {info['torch_threads']} torch threads, "
        f"OMP_WAIT_POLICY {info['omp_wait_policy']}, Python {info['python']}, {libraries}"
        + (f", GPU {info['gpu']}" if info["gpu"] else "")
        + f"\n# {rounds} rounds after {warmup} warm-up (a group of one-off jobs sets its own); "
        "median [min, max]; × baseline: the median of the rounds' own ratios"
    )


def table(rows: Sequence[dict[str, Any]]) -> str:
    gpu = any("gpu_mib" in row for row in rows)
    header = [
        "job",
        "seconds [min, max]",
        "CPU s",
        "× baseline [min, max]",
        "peak private MiB (growth)",
        "peak RSS MiB",
        *(["peak GPU MiB"] if gpu else []),
    ]
    lines = ["| " + " | ".join(header) + " |"]
    lines.append("|" + "---|" * len(header))
    for row in rows:
        ratio = "—"
        if "ratio" in row:
            ratio = f"{row['ratio']:.2f} [{row['ratio_min']:.2f}, {row['ratio_max']:.2f}] ({row['baseline']})"
        cpu = f"{row['cpu_seconds']:.3f}" if row.get("cpu_seconds") is not None else "—"
        private = f"{row['private_mib']} (+{row['private_growth_mib']})" if row["private_mib"] else "—"
        lines.append(
            f"| {row['label']} | {row['seconds']:.3f} [{row['min']:.3f}, {row['max']:.3f}] | {cpu} | "
            f"{ratio} | {private} | {row['rss_mib']} |" + (f" {row.get('gpu_mib', '—')} |" if gpu else "")
        )
    return "\n".join(lines)


def run_workload(
    workload: Workload,
    size: str = "full",
    rounds: int | None = None,
    warmup: int = 1,
    out_root: Path | None = None,
    overrides: dict[str, Any] | None = None,
    echo=print,
    redo: bool = False,
) -> dict[str, Any]:
    """Build the workload at ``size`` (with ``overrides``), time every group, print the table, and
    write ``<out_root>/<name>.json``; the result as a mapping. A long run resumes: each finished group
    is kept in ``<name>.partial.json`` and not measured again by the same run (``redo``: all again),
    and a ``resumes`` group's job goes on from its folder."""
    parameters = {**workload.sizes["full"], **workload.sizes[size], **(overrides or {})}
    rounds = rounds or int(parameters.pop("rounds", 5))
    parameters.pop("rounds", None)
    out_root = Path(out_root or f"/tmp/mergekit-bmm-perf/{workload.name}")
    out_root.mkdir(parents=True, exist_ok=True)
    top = header(workload, size, parameters, rounds, warmup)
    echo(top)
    groups = workload.build(parameters, out_root)
    partial = out_root / f"{workload.name}.partial.json"
    identity = json.loads(json.dumps({"size": size, "parameters": parameters, "rounds": rounds,
                                      "warmup": warmup}, default=str))  # fmt: skip
    stored = json.loads(partial.read_text()) if partial.is_file() else {}
    same = not redo and stored.get("identity") == identity
    done = stored.get("groups", {}) if same else {}
    if not same:  # what a resumable job left under other parameters is not this run's to resume
        fresh(out_root / "out")
        partial.write_text(json.dumps({"identity": identity, "groups": done}, indent=1))
    rows: list[dict[str, Any]] = []
    for number, group in enumerate(groups):
        if str(number) in done:  # measured by an earlier run of the same workload and size: kept
            labels = ", ".join(row["label"] for row in done[str(number)])
            echo(f"group {number}: kept from {partial.name} ({labels})")
            rows += done[str(number)]
            continue
        group = group if isinstance(group, Group) else group()
        found = [
            row.summary()
            for row in run_group(group, rounds, warmup, out_root / "out" / f"group-{number}", echo)
        ]
        rows += found
        done[str(number)] = found
        partial.write_text(json.dumps({"identity": identity, "groups": done}, indent=1, default=str))
    with summaries_silenced():
        figures = workload.figures(parameters, out_root, rows) if workload.figures else {}
    echo("\n" + table(rows))
    for key, value in figures.items():
        echo(f"{key}: {value}")
    result = {
        "workload": workload.name,
        "size": size,
        "parameters": parameters,
        "rounds": rounds,
        "warmup": warmup,
        "machine": machine(),
        "rows": rows,
        "figures": figures,
    }
    (out_root / f"{workload.name}.json").write_text(json.dumps(result, indent=2, default=str))
    if workload.picture is not None and workload.picture(rows, out_root / f"{workload.name}.png"):
        echo(f"picture: {out_root / f'{workload.name}.png'}")
    return result
