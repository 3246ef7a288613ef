"""Tests for the training data pipeline: byte tokenizer, corpora, windows, rank split."""
import itertools

import pytest
import torch

from offload_zero.data import ByteTokenizer, TokenWindows, find_text_files, stdlib_files


def _take(iterator, n):
    return list(itertools.islice(iterator, n))


# --- byte tokenizer ---------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["", "a", "hello, world\n", "naïve café ✓ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "\x00\x7f"])
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_byte_tokenizer_specials():
    tok = ByteTokenizer()
    assert tok.vocab_size == 259
    assert len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3
    assert all(256 <= i < tok.vocab_size for i in (tok.pad_id, tok.bos_id, tok.eos_id))
    ids = tok.encode("hi", add_bos=True, add_eos=True)
    assert ids == [tok.bos_id, ord("h"), ord("i"), tok.eos_id]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special=False) == "<bos>hi<eos>"
    # a multi-byte character split by a special token decodes to replacement characters
    euro = list("€".encode("utf-8"))
    assert tok.decode(euro[:1] + [tok.eos_id] + euro[1:]) == "\ufffd" * 3
    with pytest.raises(ValueError, match="259"):
        tok.decode([259])


def test_byte_tokenizer_without_specials():
    tok = ByteTokenizer(with_specials=False)
    assert tok.vocab_size == 256 and tok.eos_id is None
    assert tok.decode(tok.encode("abc")) == "abc"
    with pytest.raises(ValueError, match="no special tokens"):
        tok.encode("abc", add_eos=True)
    with pytest.raises(ValueError, match="256"):
        tok.decode([256])


# --- corpora ----------------------------------------------------------------------------------

def test_stdlib_corpus_found_and_nonempty():
    files = stdlib_files()
    assert len(files) > 100
    assert files == sorted(files)
    assert all(f.suffix == ".py" for f in files)
    assert not any(part in ("site-packages", "test", "tests", "__pycache__")
                   for f in files for part in f.parts)
    assert any(f.name == "argparse.py" for f in files)
    assert sum(f.stat().st_size for f in files[:50]) > 0


def test_data_file_and_directory(tmp_path):
    single = tmp_path / "single.txt"
    single.write_text("just one file\n")
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.md").write_text("# b\n")
    (folder / "a.txt").write_text("a text\n")
    (folder / "sub" / "c.py").write_text("print('c')\n")
    (folder / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (folder / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
    (folder / ".hidden").write_text("hidden\n")
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "x.txt").write_text("cache\n")

    files = find_text_files([single, folder])
    names = [f.relative_to(tmp_path).as_posix() for f in files]
    assert names == ["single.txt", "corpus/a.txt", "corpus/b.md", "corpus/sub/c.py"]

    # 40 tokens (text + one EOS per file) = 10 windows of 4 in the first epoch; no shuffling
    windows = TokenWindows(files, ByteTokenizer(), seq_len=4, seed=0, shuffle_windows=1)
    first_epoch = itertools.chain.from_iterable(_take(windows.windows(), 10))
    text = ByteTokenizer().decode(first_epoch, skip_special=False)
    assert text.count("<eos>") == 4 and text.endswith("<eos>")
    assert sorted(text.split("<eos>")[:-1]) == ["# b\n", "a text\n", "just one file\n",
                                                 "print('c')\n"]


def test_data_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        find_text_files([tmp_path / "missing"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no text files"):
        find_text_files([empty])
    short = tmp_path / "short.txt"
    short.write_text("abc")
    windows = TokenWindows([short], ByteTokenizer(), seq_len=64)
    with pytest.raises(ValueError, match="fewer than seq_len=64"):
        next(windows.batches(2))
    with pytest.raises(ValueError, match="batch_size"):
        windows.batches(0)
    with pytest.raises(ValueError, match="rank"):
        TokenWindows([short], ByteTokenizer(), seq_len=4, world_size=2, rank=2)


def test_data_file_that_is_not_utf8_text_names_the_file_and_offset(tmp_path):
    import gzip

    blob = tmp_path / "model.bin"
    blob.write_bytes(b"PK" + bytes(range(256)))
    with pytest.raises(ValueError, match=r"'.*model\.bin' is not a UTF-8 text file: "
                                         r"a NUL byte at byte offset 2"):
        find_text_files([blob])
    zipped = tmp_path / "notes.txt.gz"
    zipped.write_bytes(gzip.compress(b"hello\n"))  # starts 1f 8b: 0x8b is no UTF-8 lead byte
    with pytest.raises(ValueError, match=r"notes\.txt\.gz' is not a UTF-8 text file: "
                                         r"invalid UTF-8 at byte offset 1"):
        find_text_files([zipped])
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.txt' is not a UTF-8 text file: invalid UTF-8 "
                                         "at byte offset 3"):
        find_text_files([latin1])


def test_invalid_utf8_past_the_sniffed_head_fails_when_read(tmp_path):
    """find_text_files looks at the first 8 KiB only; the full read is strict too, rather
    than training on replacement characters."""
    late = tmp_path / "late.txt"
    late.write_bytes(b"a" * 10_000 + b"\xff tail\n")
    assert find_text_files([late]) == [late]
    windows = TokenWindows([late], ByteTokenizer(), seq_len=16)
    with pytest.raises(ValueError, match=r"'.*late\.txt' is not a UTF-8 text file: invalid "
                                         r"UTF-8 at byte offset 10000"):
        next(windows.batches(2))


def test_non_ascii_utf8_is_text(tmp_path):
    text = "naïve café 東京 ✓ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢\n"
    path = tmp_path / "unicode.txt"
    path.write_text(text, encoding="utf-8")
    # a character of 3 bytes cut by the 8 KiB sniff boundary is not an error
    cut = tmp_path / "cut.txt"
    cut.write_text("a" * 8191 + "東京\n", encoding="utf-8")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "u.txt").write_text(text, encoding="utf-8")
    assert find_text_files([path, cut, folder]) == [path, cut, folder / "u.txt"]
    tok = ByteTokenizer()
    windows = TokenWindows([path], tok, seq_len=len(tok.encode(text)) + 1, shuffle_windows=1)
    assert tok.decode(next(windows.windows()), skip_special=False) == text + "<eos>"


# --- windows and batches ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus():
    return stdlib_files()


def test_batches_shape_labels_and_determinism(corpus):
    def first_batches(seed, n=6):
        stream = TokenWindows(corpus, ByteTokenizer(), seq_len=32, seed=seed).batches(4)
        return _take(stream, n)

    a, b, c = first_batches(1), first_batches(1), first_batches(2)
    for x, y in a:
        assert x.shape == (4, 32) and x.dtype == torch.int64
        assert torch.equal(x, y)
        assert int(x.min()) >= 0 and int(x.max()) < 259
    assert all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(a, b))
    assert not all(torch.equal(x1, x3) for (x1, _), (x3, _) in zip(a, c))


def test_reads_lazily(corpus):
    windows = TokenWindows(corpus, ByteTokenizer(), seq_len=64, seed=0)
    _take(windows.batches(4), 10)
    assert 0 < windows.files_read < len(corpus) // 4


def test_ranks_are_disjoint_and_cover_the_stream(corpus):
    def windows(world_size, rank, n):
        tw = TokenWindows(corpus, ByteTokenizer(), seq_len=48, seed=3, world_size=world_size,
                          rank=rank, shuffle_windows=16)
        return [tuple(w) for w in _take(tw.windows(), n)]

    whole = windows(1, 0, 200)
    rank0, rank1 = windows(2, 0, 100), windows(2, 1, 100)
    assert not set(rank0) & set(rank1)
    assert rank0 == whole[0::2] and rank1 == whole[1::2]


def test_epochs_wrap_small_corpus(tmp_path):
    path = tmp_path / "small.txt"
    path.write_text("0123456789" * 5)  # 50 bytes + EOS = 51 tokens: 5 windows of 10 per epoch
    tw = TokenWindows([path], ByteTokenizer(), seq_len=10, seed=0, world_size=2, rank=1,
                      shuffle_windows=4)
    batches = _take(tw.batches(3), 4)  # 12 windows for rank 1 = 24 global, several epochs
    assert all(x.shape == (3, 10) for x, _ in batches)
    assert tw.files_read >= 4
