"""Data pipeline for ``offload-zero train``: text files -> token stream -> fixed-length windows.

Glossary (used the same way everywhere in this file):

- *corpus*: an ordered list of text files. The default corpus is the Python standard library's
  own ``*.py`` sources, which every machine running this package has.
- *token stream*: the files' tokens concatenated in a seed-shuffled file order, each file
  followed by the tokenizer's end-of-sequence id (when it has one).
- *window*: ``seq_len`` consecutive tokens cut from the stream, without overlap. Windows are
  numbered globally (across ranks) in the order they are produced after a seeded shuffle;
  window ``i`` belongs to rank ``i % world_size``, so ranks never share a window.
- *batch*: ``batch_size`` windows of one rank stacked into an int64 tensor ``(B, T)``.

Files are read lazily: only as many as the requested number of steps needs (plus one shuffle
buffer), so starting a short run on the whole standard library is fast. When the corpus runs
out the stream starts a new *epoch* with a freshly shuffled file order.
"""
from __future__ import annotations

import codecs
import os
import random
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "stdlib_files",
    "find_text_files",
    "read_text_file",
    "TokenWindows",
]

# Directory names never descended into when walking for text files.
_SKIP_DIRS = frozenset({
    "__pycache__", "site-packages", "dist-packages", "test", "tests", "idle_test",
    "node_modules",
})
# How many bytes of a file are sniffed to decide whether it is text.
_SNIFF_BYTES = 8192


class ByteTokenizer:
    """Byte-level tokenizer: every UTF-8 byte is one token, plus a few special tokens.

    Ids 0..255 are the bytes themselves. With ``with_specials=True`` (the default) three
    special ids follow: ``pad_id = 256``, ``bos_id = 257``, ``eos_id = 258`` and
    ``vocab_size == 259``. With ``with_specials=False`` there are no special ids (they are
    ``None``) and ``vocab_size == 256``; this fits models whose vocabulary has 256..258 rows.

    Needs no download and never fails to encode: any text round-trips through
    ``decode(encode(text)) == text``.
    """

    NUM_BYTES = 256

    def __init__(self, with_specials: bool = True) -> None:
        self.with_specials = with_specials
        if with_specials:
            self.pad_id: Optional[int] = 256
            self.bos_id: Optional[int] = 257
            self.eos_id: Optional[int] = 258
            self.vocab_size = 259
        else:
            self.pad_id = self.bos_id = self.eos_id = None
            self.vocab_size = self.NUM_BYTES

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> List[int]:
        """Encode ``text`` to a list of ids in ``[0, vocab_size)``.

        ``add_bos``/``add_eos`` prepend/append the special ids; they raise ``ValueError`` on a
        tokenizer built with ``with_specials=False``.
        """
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self._special("bos_id"))
        if add_eos:
            ids.append(self._special("eos_id"))
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Decode ids back to text.

        Byte ids are decoded as UTF-8 (invalid sequences become U+FFFD). Special ids are dropped
        when ``skip_special`` is true, else written as ``<pad>``, ``<bos>``, ``<eos>``. An id
        outside ``[0, vocab_size)`` raises ``ValueError``.
        """
        names = {self.pad_id: "<pad>", self.bos_id: "<bos>", self.eos_id: "<eos>"}
        out: List[str] = []
        pending = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < self.NUM_BYTES:
                pending.append(i)
                continue
            if i >= self.vocab_size or i < 0:
                raise ValueError(f"token id {i} is outside the byte tokenizer's vocabulary "
                                 f"[0, {self.vocab_size})")
            out.append(pending.decode("utf-8", errors="replace"))
            pending = bytearray()
            if not skip_special:
                out.append(names[i])
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def _special(self, name: str) -> int:
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"this ByteTokenizer has no special tokens (with_specials=False), "
                             f"so it has no {name}")
        return value


class HFTokenizer:
    """Adapter giving a Hugging Face tokenizer the small interface the pipeline needs.

    Exposes ``encode(text) -> list[int]`` (no special tokens added), ``eos_id`` (the
    tokenizer's EOS id, else its BOS id, else ``None``) and ``vocab_size`` (``len(tokenizer)``,
    which counts added tokens).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        # Whole source files are longer than any model context; we cut windows ourselves, so
        # silence the "sequence longer than model_max_length" warning.
        tokenizer.model_max_length = 1 << 62
        eos = tokenizer.eos_token_id
        self.eos_id: Optional[int] = eos if eos is not None else tokenizer.bos_token_id
        self.vocab_size = len(tokenizer)

    def encode(self, text: str) -> List[int]:
        """Encode ``text`` to ids without adding special tokens."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def _decode_text(data: bytes, final: bool = True) -> str:
    """Decode ``data`` as UTF-8 text, strictly.

    With ``final=False`` a multi-byte character cut at the end of ``data`` (a file's head read
    so far) is not an error and is left out of the result. Raises ``ValueError`` saying
    ``"a NUL byte at byte offset N"`` or ``"invalid UTF-8 at byte offset N"`` for the first
    offending byte: text files hold neither.
    """
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(data, final=final)
    except UnicodeDecodeError as exc:
        nul = data.find(b"\0", 0, exc.start)
        if nul >= 0:
            raise ValueError(f"a NUL byte at byte offset {nul}") from None
        raise ValueError(f"invalid UTF-8 at byte offset {exc.start}") from None
    nul = data.find(b"\0")
    if nul >= 0:
        raise ValueError(f"a NUL byte at byte offset {nul}")
    return text


def _sniff_text(path: Path) -> None:
    """Check that the first ``_SNIFF_BYTES`` of ``path`` are text (see :func:`_decode_text`).

    Raises ``ValueError`` with the reason (no path) if they are not, ``OSError`` if the file
    cannot be read.
    """
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    _decode_text(head, final=len(head) < _SNIFF_BYTES)


def _is_text_file(path: Path) -> bool:
    """True if the first few KiB of ``path`` contain no NUL byte and are valid UTF-8."""
    try:
        _sniff_text(path)
    except (OSError, ValueError):
        return False
    return True


def read_text_file(path: os.PathLike) -> str:
    """The whole of ``path`` decoded as UTF-8, strictly (never replacement characters).

    Raises ``ValueError`` naming the file and the byte offset of its first NUL byte or invalid
    UTF-8 byte if it is not a UTF-8 text file, and ``OSError`` if it cannot be read.
    """
    try:
        return _decode_text(Path(path).read_bytes())
    except ValueError as exc:
        raise ValueError(f"corpus file {str(path)!r} is not a UTF-8 text file: {exc}; "
                         f"only UTF-8 text can be trained on") from None


def _walk(root: Path, suffixes: Optional[Tuple[str, ...]]) -> Iterator[Path]:
    """Yield files under ``root`` (ending in ``suffixes`` if given), skipping hidden entries
    and ``_SKIP_DIRS`` folders."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            if suffixes is not None and not name.endswith(suffixes):
                continue
            yield Path(dirpath) / name


def stdlib_files() -> List[Path]:
    """The default corpus: the standard library's ``*.py`` files, sorted by path.

    Found at ``sysconfig.get_paths()["stdlib"]``; ``site-packages``, ``test``/``tests`` and
    ``__pycache__`` folders are skipped. Raises ``ValueError`` if no file is found.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(_walk(root, (".py",)))
    if not files:
        raise ValueError(f"no *.py files found in the standard library folder {root}")
    return files


def find_text_files(paths: Sequence[os.PathLike]) -> List[Path]:
    """Expand ``--data`` arguments to a list of text files.

    A file argument is kept as given (in argument order) if its first 8 KiB are UTF-8 text
    (no NUL byte, valid UTF-8; the rest is checked when it is read, see
    :func:`read_text_file`). A directory is walked recursively and its files are sorted by
    path, keeping the ones that look like UTF-8 text by the same test and skipping the others;
    hidden entries and ``__pycache__``/``site-packages``/test folders are skipped.

    Raises ``ValueError`` if a path does not exist, nothing usable is found, or a file argument
    cannot be read or is not UTF-8 text (naming the file and the byte offset of its first NUL
    or invalid UTF-8 byte).
    """
    out: List[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = [f for f in sorted(_walk(p, None)) if _is_text_file(f)]
            if not found:
                raise ValueError(f"--data directory {str(p)!r} contains no text files")
            out.extend(found)
        elif p.is_file():
            try:
                _sniff_text(p)
            except OSError as exc:
                raise ValueError(f"--data file {str(p)!r} cannot be read: {exc}") from None
            except ValueError as exc:
                raise ValueError(f"--data file {str(p)!r} is not a UTF-8 text file: {exc}; "
                                 f"--data takes UTF-8 text files, or folders (whose other "
                                 f"files are skipped)") from None
            out.append(p)
        else:
            raise ValueError(f"--data path {str(p)!r} does not exist")
    if not out:
        raise ValueError("--data was given no paths")
    return out


class TokenWindows:
    """Deterministic, rank-disjoint stream of ``(input_ids, labels)`` batches.

    Args:
        files: the corpus, in a fixed order (e.g. from :func:`stdlib_files`).
        tokenizer: any object with ``encode(text) -> list[int]`` and an ``eos_id``
            attribute (``None`` for no separator), e.g. :class:`ByteTokenizer`.
        seq_len: tokens per window, ``T`` (>= 1).
        seed: seeds the file order of each epoch and the window shuffle; the same seed gives
            the same batches on every machine.
        world_size, rank: window ``i`` of the global (cross-rank) stream goes to rank
            ``i % world_size``. Every rank reads the same files, so the split is exact.
        shuffle_windows: global windows collected before each seeded shuffle (a shuffle
            buffer); larger mixes better and reads further ahead.

    The labels are the inputs themselves (a Hugging Face causal LM shifts them internally).
    Raises ``ValueError`` on bad arguments, or while iterating if the whole corpus holds
    fewer than ``seq_len`` tokens or a file read is not UTF-8 text (see
    :func:`read_text_file`).
    """

    def __init__(self, files: Sequence[os.PathLike], tokenizer, seq_len: int, seed: int = 0,
                 world_size: int = 1, rank: int = 0, shuffle_windows: int = 256) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need world_size >= 1 and 0 <= rank < world_size, got "
                             f"world_size={world_size}, rank={rank}")
        if shuffle_windows < 1:
            raise ValueError(f"shuffle_windows must be >= 1, got {shuffle_windows}")
        if not files:
            raise ValueError("the corpus has no files")
        self.files = [Path(f) for f in files]
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.seed = seed
        self.world_size = world_size
        self.rank = rank
        self.shuffle_windows = shuffle_windows
        self.files_read = 0  # files opened so far (counts re-reads in later epochs)

    def _tokens(self) -> Iterator[List[int]]:
        """Yield each file's token ids (+ EOS), epoch after epoch, forever."""
        epoch = 0
        eos = self.tokenizer.eos_id
        while True:
            order = list(range(len(self.files)))
            random.Random(f"{self.seed}/files/{epoch}").shuffle(order)
            for idx in order:
                text = read_text_file(self.files[idx])
                self.files_read += 1
                ids = self.tokenizer.encode(text)
                if eos is not None:
                    ids.append(eos)
                yield ids
            epoch += 1

    def _global_windows(self) -> Iterator[List[int]]:
        """Yield every rank's windows, ``seq_len`` tokens each, in global order (unshuffled)."""
        buf: List[int] = []
        tokens_per_pass = 0
        files_this_pass = 0
        for ids in self._tokens():
            buf.extend(ids)
            tokens_per_pass += len(ids)
            files_this_pass += 1
            while len(buf) >= self.seq_len:
                yield buf[:self.seq_len]
                del buf[:self.seq_len]
            if files_this_pass == len(self.files):
                if tokens_per_pass < self.seq_len:
                    raise ValueError(f"the corpus ({len(self.files)} file(s)) holds only "
                                     f"{tokens_per_pass} tokens, fewer than seq_len="
                                     f"{self.seq_len}; give more data or a smaller --seq-len")
                tokens_per_pass = files_this_pass = 0

    def windows(self) -> Iterator[List[int]]:
        """Yield this rank's windows (lists of ``seq_len`` ids) forever, in seeded order."""
        rng = random.Random(f"{self.seed}/windows")
        source = self._global_windows()
        index = 0
        while True:
            chunk = [next(source) for _ in range(self.shuffle_windows)]
            rng.shuffle(chunk)
            for window in chunk:
                if index % self.world_size == self.rank:
                    yield window
                index += 1

    def batches(self, batch_size: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """Yield ``(input_ids, labels)`` forever: both int64 ``(batch_size, seq_len)`` on CPU.

        ``labels`` is the same tensor as ``input_ids``. Raises ``ValueError`` if
        ``batch_size < 1``.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return self._batches(batch_size)

    def _batches(self, batch_size: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        source = self.windows()
        while True:
            rows = [next(source) for _ in range(batch_size)]
            x = torch.tensor(rows, dtype=torch.long)  # (B, T)
            yield x, x
