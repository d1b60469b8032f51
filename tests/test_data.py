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
