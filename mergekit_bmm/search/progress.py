"""What a running search shows: one progress bar with the best and the last score, and per
worker the trial it runs and its device."""

from __future__ import annotations

import sys

from mergekit_bmm.search.log import TrialRecord


class SearchProgress:
    """A tqdm bar over the budget; ``write`` prints above it without breaking it."""

    def __init__(self, total: int, done: int, strategy: str, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(
            total=max(total, done),
            initial=done,
            desc=f"search [{strategy}]",
            unit="trial",
            disable=not enabled,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        self.status: dict[str, str] = {}
        self.full = 0  # trials of this run scored on every example (cheap-then-full evaluation)

    def show(self, best: TrialRecord | None, last: TrialRecord | None = None, workers: str = "") -> None:
        if best is not None:
            self.status["best"] = f"{best.score:.4f} (#{best.trial})"
        if last is not None:
            level = (last.fidelity or {}).get("level", "full")
            shown = f"{last.score:.4f}" + ("" if level == "full" else f" ({level})") if last.ok else "failed"
            self.status["last"] = shown
            if last.fidelity:
                self.full += level == "full"
                self.status["full"] = str(self.full)
        if workers:
            self.status["workers"] = workers
        self.bar.set_postfix(self.status, refresh=True)

    def advance(self, best: TrialRecord | None, last: TrialRecord, workers: str = "") -> None:
        self.bar.update(1)
        self.show(best, last, workers)

    def write(self, message: str) -> None:
        """A line above the bar (nothing when progress is off: ``--quiet``)."""
        if not self.bar.disable:
            self.bar.write(message, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
