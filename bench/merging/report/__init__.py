"""Results: ``results.json``, ``results.md`` and the pictures beside them.

``results.json`` (the shape the full benchmark keeps): ``tasks``; ``indiv`` (each expert on its own
test split); ``rows``, one per (anchor, setting) with ``avg`` and ``per_task`` test accuracies,
``validation`` accuracies, the hyperparameters found and the search budget; plus data sizes,
head/expert records, timings and the evidence (:mod:`bench.merging.evidence`). One module per
part of the page: :mod:`.rows` (the results' shape), :mod:`.tables`, :mod:`.explain`,
:mod:`.plots`, :mod:`.language`, :mod:`.timings`, and :mod:`.page`, which puts them in order.
"""

from bench.merging.report.language import language_markdown
from bench.merging.report.page import write
from bench.merging.report.rows import add_row, base_results, find_row
from bench.merging.report.tables import markdown

__all__ = ["add_row", "base_results", "find_row", "language_markdown", "markdown", "write"]
