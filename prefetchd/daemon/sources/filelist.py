"""File lists: a CSV or TSV of ``path,label`` rows, as many labelling tools write.

    path,label                      <- optional header (e.g. image_path,class_id: see PATH_WORDS)
    cat/001.jpg,cat                 <- relative to the list's folder ("./cat/001.jpg" the same)
    /data/extra/dog_17.jpg,dog      <- or absolute
    "with, comma.jpg",cat           <- quoted as csv does (" lead.jpg" keeps its space)
    cat/002.jpg, cat                <- spaces after the delimiter skipped

The delimiter is a tab when the first row has one, else a comma, whatever the
suffix (a ``.txt`` list too); there are no comment lines.  Labels are
either all integers (used as they are; classes are "0".."max") or all class
names (classes sorted as ImageFolder sorts folder names, labels their
positions).  Columns after the second are ignored.  The list is read through
the dataset's ``Storage``, so a list in object storage works the same way.
"""

from __future__ import annotations

import csv
import hashlib
import io
import logging
import os
import posixpath
import re

import numpy as np

from prefetchd.daemon.dataset import EXPECTED_DATA, IMG_EXTENSIONS, SampleIndex, pack_paths, sized
from prefetchd.daemon.errors import DatasetError
from prefetchd.daemon.sources.storage import ImageRefused, Storage, is_url, storage_for
from prefetchd.words import counted

log = logging.getLogger(__name__)

LIST_SUFFIXES = (".csv", ".tsv", ".txt")
# A first row is a header when its path column holds one of these words and no "." or "/" (a file's
# path nearly always has one), and its label column one of the label words: image_path, file_path,
# filepath, label_name, class_id, labels all read as headers.  One mistaken for a sample would add a
# class and shift every label after it, with nothing but an unreadable file to show for it.
PATH_WORDS = frozenset({"path", "paths", "file", "files", "filename", "filepath", "fname", "image", "images", "img",
                        "name", "location", "key", "url", "uri"})
# Integer labels make classes "0".."max", each a string in the index and the manifest.  More
# classes than this are taken only when there are as many samples (a dense label space, whose
# names cost no more than its samples): a stray 3000000000 would otherwise be a MemoryError.
MAX_INT_CLASSES = 1_000_000
LABEL_WORDS = frozenset({"label", "labels", "class", "classes", "target", "targets", "category", "categories", "cls"})


def is_file_list(location: str) -> bool:
    return location.lower().endswith(LIST_SUFFIXES)


def split_location(location: str) -> tuple[str, str]:
    """(folder the list's relative paths start from, the list's name in it)."""
    if is_url(location):
        folder, _, name = location.rstrip("/").rpartition("/")
        return folder, name
    path = os.path.abspath(location)
    return os.path.dirname(path), os.path.basename(path)


# Plain ASCII decimal digits, as a label column of class numbers holds them (a leading "-" too, to be
# refused as a negative class number).  int() also takes "1_0" (10), " 7", "٣" (Arabic-Indic 3) and
# "+5": a typo or another script becomes a class number; here they are class names.
# A whole number, also as pandas writes one in a float column (a label column with a missing value): "10.0".
_INTEGER = re.compile(r"(-?[0-9]+)(?:\.0+)?")
_DECIMAL = re.compile(r"-?[0-9]+\.[0-9]+")


def _int_label(text: str) -> int | None:
    whole = _INTEGER.fullmatch(text)
    return int(whole[1]) if whole else None


def _delimiter(first: str, name: str) -> str:
    """A tab where the first row has one outside its quoted fields, a comma otherwise; a row holding both (a tab in
    a CSV's path, as csv.writer leaves it unquoted, or a comma in a TSV's) goes by the suffix, ".csv" a comma.  A
    tab anywhere in the row made it a TSV: a CSV whose first path held one was misread (a walk)."""
    bare = re.sub(r'"[^"]*"?', "", first)  # a quoted field's delimiters are not the row's
    if "\t" not in bare:
        return ","
    return "," if "," in bare and name.lower().endswith(".csv") else "\t"


def read_file_list(location: str) -> SampleIndex:
    """Index the samples a file list names, in the list's order."""
    root, name = split_location(location)
    storage = storage_for(root)
    try:
        raw = bytes(storage.read(name))
    except FileNotFoundError:
        raise DatasetError(f"file list {location} does not exist; {EXPECTED_DATA}") from None
    except (IsADirectoryError, ImageRefused):
        raise DatasetError(f"{location} is not a regular file, but its name ends like a file list "
                           f"({'/'.join(LIST_SUFFIXES)}); rename it or name a list file") from None
    except OSError as exc:
        raise DatasetError(f"cannot read file list {location}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DatasetError(f"{location}:{line}: not valid UTF-8 (byte {exc.start}); save the list as UTF-8") from None
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    delimiter = _delimiter(first, name)
    # skipinitialspace: "cat/001.jpg, cat" as a list aligned by hand has it; a quoted path keeps its spaces.
    rows = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True, skipinitialspace=True)
    paths: list[bytes] = []
    label_texts: list[str] = []
    lines: list[int] = []
    seen_row = header = False
    spaced: list[tuple[int, str]] = []  # (line, path) of paths that begin or end with whitespace
    root_prefix = root.rstrip("/") + "/"
    try:
        ended = 0  # the line the previous row ended on: a row whose quoted path holds a newline spans several
        for row in rows:
            lineno, ended = ended + 1, rows.line_num  # its first line, as an editor shows it
            if not row or all(not f.strip() for f in row):
                continue
            if not seen_row and _is_header(row):
                seen_row = header = True
                continue
            seen_row = True
            if len(row) < 2:
                raise DatasetError(f"{location}:{lineno}: expected 'path{_shown(delimiter)}label', got {row!r}; "
                                   f"{_why_one_column(row[0])}")
            # The path as CSV gives it: a name may begin or end with a space (quoted, as CSV quotes).
            path, label = row[0], row[1].strip()
            if not path.strip():
                raise DatasetError(f"{location}:{lineno}: the path is empty; every row needs a file path")
            if not label:
                raise DatasetError(f"{location}:{lineno}: the label of {path} is empty; every row needs a label")
            paths.append(_rel(path, root, root_prefix, location, lineno))
            if path != path.strip():
                spaced.append((lineno, path))
            label_texts.append(label)
            lines.append(lineno)
    except csv.Error as exc:
        raise DatasetError(f"{location}:{rows.line_num}: cannot parse the row ({exc}); quote paths that hold "
                           "the delimiter or quotes as CSV does") from None
    if not paths:
        raise DatasetError(f"file list {location} names no samples; expected rows of 'path{_shown(delimiter)}label'")
    if not header:
        _refuse_unknown_header(storage, location, paths, lines, label_texts[0])
    if spaced:
        log.warning("%s: %s with whitespace at an end, e.g. line %d: %r, taken as written (a file's name may "
                    "have it); if the spaces are not in the files' names, remove them from the list",
                    location, counted(len(spaced), "path"), *spaced[0])
    classes, labels = _labels(label_texts, lines, location)
    _refuse_paths_from_elsewhere(storage, location, root, paths, lines, label_texts)  # after the rows' own errors
    _say_repeated(location, paths, label_texts, labels, lines)
    blob, offsets = pack_paths(paths)
    # The list's bytes and the folder its relative paths start from decide every sample and
    # label (a copy of the list beside other images is another dataset); what is in the listed
    # files is not stat-ed here (a list may name a million objects in a bucket).
    digest = hashlib.sha256(b"file-list\0" + os.fsencode(root) + b"\0" + raw).hexdigest()[:32]
    index = SampleIndex(
        root=root, classes=classes, path_blob=blob,
        path_offsets=offsets, labels=labels, fingerprint=digest,
    )
    log.info("indexed file list %s: %s (%.0f bytes of index per sample)", location, sized(len(index), len(classes)),
             index.nbytes / len(index))
    return index


def _say_repeated(location: str, paths: list[bytes], texts: list[str], labels: np.ndarray, lines: list[int]) -> None:
    """Say files the list names on more than one row: each row is a sample (a list may oversample a file so, on
    purpose), said once; rows of one file with different labels train the same image as both, a warning.  Found by
    sorting the paths' hashes with the labels, in arrays: a dict of the paths would cost ~100 bytes a row.  Measured
    on the 2-core EPYC (slow hour), a list of a million rows: 0.12-0.17 s of its 6.5 s index without a repeat, 0.8-1.1
    s for one written twice over (a dict of the paths took 5 s there)."""
    hashes = np.fromiter(map(hash, paths), dtype=np.int64, count=len(paths))
    alone = np.sort(hashes)
    if not (alone[1:] == alone[:-1]).any():  # the usual list, at the cost of one sort
        return
    order = np.lexsort((labels, hashes))  # by file, then label
    by_file, by_label = hashes[order], labels[order]
    again = by_file[1:] == by_file[:-1]  # a row of the file of the row before it
    relabelled = again & (by_label[1:] != by_label[:-1])
    shown = relabelled if relabelled.any() else again
    at = np.flatnonzero(shown)
    first = int(at[np.argmin(np.maximum(order[at], order[at + 1]))])  # the earliest row listed again: the example
    j, k = sorted((int(order[first]), int(order[first + 1])))
    if paths[j] != paths[k]:  # two paths of one hash: not worth a word
        return
    files = counted(len(np.unique(by_file[1:][shown])), "file")
    if relabelled.any():
        log.warning("%s: %s listed again with another label, e.g. %s at line %d (%s) and line %d (%s): each row is "
                    "a sample with its label, so the same image trains as both; remove the wrong rows", location,
                    files, os.fsdecode(paths[j]), lines[j], texts[j], lines[k], texts[k])
        return
    log.info("%s: %s listed more than once, e.g. %s at lines %d and %d: each row is a sample, so such a file comes "
             "as often an epoch as it is listed", location, files, os.fsdecode(paths[j]), lines[j], lines[k])


def _why_one_column(cell: str) -> str:
    """The fix for a row without a label, from what a list written for another reader looks like."""
    if cell.lstrip().startswith("#"):
        return "a file list has no comments; remove the line"
    if len(cell.split()) > 1:  # `path label`, as some .txt lists are written
        return "separate the path and the label with a comma or a tab (as CSV and TSV do), not spaces"
    if ";" in cell:  # a spreadsheet's CSV where the comma is the decimal mark (a user's walk)
        return "separate the path and the label with a comma or a tab (as CSV and TSV do), not ';'"
    return "every row needs a path and a label"


def _shown(delimiter: str) -> str:
    return "<TAB>" if delimiter == "\t" else delimiter


def _is_header(row: list[str]) -> bool:
    if len(row) < 2 or "." in row[0] or "/" in row[0]:
        return False
    return bool(_words(row[0]) & PATH_WORDS) and bool(_words(row[1]) & LABEL_WORDS)


def _words(cell: str) -> set[str]:
    """A header cell's words, lower case: "Image_Path" -> {"image", "path"}."""
    return {w for w in re.split(r"[^a-z0-9]+", cell.strip().lower()) if w}


def _refuse_unknown_header(storage: Storage, location: str, paths: list[bytes], lines: list[int], label: str) -> None:
    """Refuse a first row that is a header of words we do not know (Kaggle's ``Image,Id``), read as a
    sample: it would add a class and shift every label after it, then be replaced as a missing file.

    Asked only of a first path without a "." or "/" (an image's path nearly always has one), with at
    most two checks: that it does not exist and the next row's file does."""
    first = os.fsdecode(paths[0])
    if len(paths) < 2 or "." in first or "/" in first:
        return
    try:
        if storage.exists(first) or not storage.exists(os.fsdecode(paths[1])):
            return
    except OSError:  # the store cannot say now: the workers will, for every file
        return
    raise DatasetError(f"{location}:{lines[0]}: {first!r},{label!r} looks like a header, not a sample: no file "
                       f"{first} is there, and line {lines[1]}'s is; remove the line, or name the columns "
                       "path,label (a first row is skipped as a header when its words are such as path, file, "
                       "image or key, and label, class, target or category)")


def _refuse_paths_from_elsewhere(storage: Storage, location: str, root: str, paths: list[bytes],
                                 lines: list[int], labels: list[str]) -> None:
    """Refuse a list whose first and last rows both name files that are not there: its paths start from
    another folder (written relative to where it was made, not to the list's folder) or another machine.
    Every sample would be replaced, and the job stop at its first batch saying none could be decoded.

    One check where the first row's file is there, two where it is not; a list missing only some files
    starts, and those are replaced as missing files are."""
    rows = [(lines[0], os.fsdecode(paths[0]))] + ([(lines[-1], os.fsdecode(paths[-1]))] if len(paths) > 1 else [])
    try:
        if any(storage.exists(path) for _, path in rows):
            return
    except OSError:  # the store cannot say now: the workers will, for every file
        return
    (line, path), *last = rows
    relative = any(not p.startswith("/") for _, p in rows)
    where = f"in {root}" if relative else "there"
    said = (f"neither line {line}'s file, {path}, nor line {last[0][0]}'s, {last[0][1]}, is {where}" if last else
            f"line {line}'s file, {path}, is not {where}")
    # Two slips that give the same missing files, said with their fix (a walk met both as this message alone).
    if all("\\" in p and "/" not in p for _, p in rows):
        raise DatasetError(f"{location}: {said}: its paths are separated by '\\', as on Windows; write them with '/'")
    if all(label.lower().endswith(IMG_EXTENSIONS) for label in (labels[0], labels[-1])):
        raise DatasetError(f"{location}: {said}, and its labels look like image files ({labels[0]!r}): are the "
                           "columns the other way round? A row is path, then label")
    if relative:
        # In a bucket a list names objects under its folder (an absolute path, or a URL elsewhere, is refused).
        other = "or as URLs under it" if is_url(root) else "or absolute"
        raise DatasetError(f"{location}: {said}, the folder holding the list, from which its relative paths "
                           f"start: write them relative to it, {other}")
    raise DatasetError(f"{location}: {said}: was the list written on another machine, or the files moved? Fix "
                       "the paths in the list")


def _rel(path: str, root: str, root_prefix: str, location: str, lineno: int) -> bytes:
    """The path as the index stores it: relative to the list's folder where it can be, without "." parts.

    A local absolute path outside that folder stays absolute; ``root / rel`` is
    then the path itself, so the local storage reads it unchanged.  Under a URL a
    key is a name, not a path: ``prefix/./cat/0.jpg`` is another key than
    ``prefix/cat/0.jpg``, so relative paths are normalised there (``./`` as
    ``find .`` writes it, ``a/../b``), and one that climbs out of the list's
    folder is refused."""
    if is_url(root):
        if path.startswith(root_prefix):
            path = path[len(root_prefix):]
        elif is_url(path) or path.startswith("/"):
            raise DatasetError(f"{location}:{lineno}: {path} is not inside {root}; a list in object storage "
                               "names objects relative to its own folder (or by a URL under it)")
        rel = posixpath.normpath(path)
        if rel == ".." or rel.startswith("../"):
            raise DatasetError(f"{location}:{lineno}: {path} climbs out of {root} with '..'; a list in object "
                               "storage names objects under its own folder: put the list in a folder above "
                               "its objects and name them from there (or by a URL under it)")
        return os.fsencode(rel)
    if is_url(path):
        raise DatasetError(f"{location}:{lineno}: {path} is a URL but the list is local; "
                           "put the list next to the objects or use paths")
    if os.path.isabs(path):
        norm = os.path.normpath(path)
        return os.fsencode(norm[len(root_prefix):] if norm.startswith(root_prefix) else norm)
    # Locally "a/../b" is left to the kernel (a link "a" leads elsewhere than normpath's "b").
    return os.fsencode("/".join(part for part in path.split("/") if part not in ("", ".")) or path)


def _labels(texts: list[str], lines: list[int], location: str) -> tuple[tuple[str, ...], np.ndarray]:
    ints = [_int_label(t) for t in texts]
    numeric = [v is not None for v in ints]
    numbers = [v for v in ints if v is not None]
    if len(numbers) == len(ints):
        top = max(range(len(numbers)), key=numbers.__getitem__)
        count = numbers[top] + 1
        if count > MAX_INT_CLASSES and count > len(numbers):
            raise DatasetError(
                f"{location}:{lines[top]}: label {texts[top]} makes {count:,} classes (integer labels are class "
                f"numbers from 0 to the largest) for {counted(len(numbers), 'sample')} with "
                f"{counted(len(set(numbers)), 'distinct label')}; number the classes from 0 without gaps, or "
                "write class names instead of numbers")
        values = np.asarray(numbers, dtype=np.int64)
        negative = int(np.argmax(values < 0)) if (values < 0).any() else -1
        if negative >= 0:
            raise DatasetError(f"{location}:{lines[negative]}: label {texts[negative]} is negative; "
                               "integer labels are class numbers from 0")
        return tuple(str(c) for c in range(count)), values
    if any(numeric):
        odd = numeric.index(not numeric[0])
        kind = "an integer" if numeric[odd] else "a class name"
        first = "integers" if numeric[0] else "class names"
        raise DatasetError(f"{location}:{lines[odd]}: label {texts[odd]!r} is {kind} but the list's labels start "
                           f"as {first} (line {lines[0]}); use integers everywhere or names everywhere")
    classes = tuple(sorted(set(texts)))
    if all(_DECIMAL.fullmatch(c) for c in classes):
        # Sorted as names, "10.5" comes before "2.5": numbers that read as class numbers would be other labels.
        log.warning("%s: the labels are decimal numbers, not whole ones (e.g. %r at line %d): taken as class names, "
                    "sorted as text (%s); write whole class numbers (10, not 10.5) where they number the classes",
                    location, texts[0], lines[0], ", ".join(repr(c) for c in classes[:4]) + (", ..." if len(classes) > 4
                                                                                        else ""))
    position = {c: k for k, c in enumerate(classes)}
    return classes, np.fromiter((position[t] for t in texts), dtype=np.int64, count=len(texts))
