"""The default corpus: deterministic, prose-only, disjoint calibration / held-out splits."""
import pytest

from research import data


def test_splits_are_disjoint_and_cover_all():
    cal, held = set(data.topic_names("calibration")), set(data.topic_names("heldout"))
    assert not cal & held
    assert cal | held == set(data.topic_names("all"))
    assert 0.15 < len(data.corpus_text("heldout")) / len(data.corpus_text("all")) < 0.35


def test_deterministic_prose():
    text = data.corpus_text("heldout")
    assert text == data.corpus_text("heldout")
    assert ">>>" not in text and "\n    " not in text
    assert "****" not in text


def test_load_text(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("hello world")
    assert data.load_text(str(p)) == "hello world"
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        data.load_text(str(tmp_path / "missing.txt"))
    (tmp_path / "e.txt").write_text("  ")
    with pytest.raises(ValueError, match="empty"):
        data.load_text(str(tmp_path / "e.txt"))
    with pytest.raises(ValueError, match="split"):
        data.corpus_text("validation")


def test_load_text_names_a_non_utf8_file(tmp_path):
    p = tmp_path / "latin1.txt"
    p.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt is not UTF-8: byte 0xe9 at offset 3"):
        data.load_text(str(p))


def test_fresh_stdlib_text_is_registered_and_disjoint_from_pydoc():
    """The fresh test text: the registered sha256 on the registered Python (elsewhere a
    clear error instead of silently different text), and no 10-word run shared with any
    pydoc prose (calibration, dev, test)."""
    import sys
    from research import data
    text = data.stdlib_text(check=False)
    if sys.version.split()[0] == data.STDLIB_TEXT_PYTHON:
        assert data.stdlib_text() == text
    else:
        with pytest.raises(ValueError, match="not the registered"):
            data.stdlib_text()
    assert len(text) > 300_000  # ~100k tokens
    pydoc = data._shingles(data.corpus_text("all"))
    paras = text.split("\n\n")
    assert len(paras) == len(set(paras))
    assert not any(data._shingles(p) & pydoc for p in paras)


def test_docstring_paragraphs_keep_prose_only():
    from research import data
    src = '''"""Module prose that is long enough to count as one paragraph here.

    >>> print("doctest")

        indented code block that must be dropped entirely from it
    """
def f():
    """Short.

    A function docstring paragraph that is prose and ends a sentence.
    """
'''
    assert data.docstring_paragraphs(src) == [
        "Module prose that is long enough to count as one paragraph here.",
        "A function docstring paragraph that is prose and ends a sentence."]


def test_split_text_refuses_fresh_text_for_dev():
    from research import data
    with pytest.raises(ValueError, match="test text only"):
        data.split_text("dev", "stdlib")
    with pytest.raises(ValueError, match="text must be"):
        data.split_text("test", "wiki")
