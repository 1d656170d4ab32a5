"""A rollbacks.jsonl cut short after its first byte: record_rollback read tell() after seeking to size - 1 (0 for
a one-byte file) as 'the file is empty', so the next record joined the cut byte and was lost (a resume then
replayed the window the rollback skipped)."""

from longctx.train.metrics import read_jsonl
from longctx.train.rollback import RECORD, record_rollback, rollback_from


def test_a_record_after_a_one_byte_cut_line_is_found(tmp_path):
    (tmp_path / RECORD).write_bytes(b"{")
    record_rollback(tmp_path, 9, 8, "nan", {"cursor": 9}, "def")
    assert len(read_jsonl(tmp_path / RECORD)) == 1
    assert rollback_from(tmp_path, 8, "def")["bad_step"] == 9


def test_a_one_byte_newline_file_takes_no_blank_line(tmp_path):
    (tmp_path / RECORD).write_bytes(b"\n")
    record_rollback(tmp_path, 9, 8, "nan", {"cursor": 9}, "def")
    assert (tmp_path / RECORD).read_text().count("\n") == 2
