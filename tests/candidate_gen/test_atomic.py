import logging

import pytest

from candidate_gen.atomic import AtomicFormatError, find_atomic_file, load_interactions, load_items

HEADER = "user_id:token\titem_id:token\ttimestamp:float\n"


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_missing_file_names_path(tmp_path):
    with pytest.raises(AtomicFormatError, match="nope.inter: file not found"):
        load_interactions(tmp_path / "nope.inter")


def test_no_inter_file_in_dir(tmp_path):
    with pytest.raises(AtomicFormatError, match=r"no \*\.inter file"):
        find_atomic_file(tmp_path, "inter")


def test_empty_file(tmp_path):
    with pytest.raises(AtomicFormatError, match="line 1: empty file"):
        load_interactions(write(tmp_path, "a.inter", ""))
    with pytest.raises(AtomicFormatError, match="empty file"):
        load_interactions(write(tmp_path, "b.inter", HEADER))


def test_missing_required_column(tmp_path):
    p = write(tmp_path, "a.inter", "user_id:token\ttimestamp:float\nu\t1\n")
    with pytest.raises(AtomicFormatError, match=r"a.inter: line 1: missing required column 'item_id'"):
        load_interactions(p)


def test_without_timestamps_sequences_follow_file_order_with_one_note(tmp_path, caplog):
    from candidate_gen.split import build_sequences

    rows = "u1\ti3\nu2\ti1\nu1\ti1\nu1\ti2\n"
    bare = write(tmp_path, "bare.inter", "user_id:token\titem_id:token\n" + rows)
    tied = write(tmp_path, "tied.inter", HEADER + rows.replace("\n", "\t7\n"))
    for p in (bare, tied):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="candidate_gen.atomic"):
            inter = load_interactions(p)
        assert build_sequences(inter) == {"u1": ["i3", "i1", "i2"], "u2": ["i1"]}
        notes = [r.getMessage() for r in caplog.records]
        assert len(notes) == 1 and "sequence follows the order of the rows" in notes[0], notes
    with caplog.at_level(logging.INFO, logger="candidate_gen.atomic"):
        caplog.clear()
        load_interactions(write(tmp_path, "real.inter", HEADER + "u1\ti1\t1\nu1\ti2\t1\nu1\ti3\t2\n"))
    assert not caplog.records  # ties among real timestamps are normal: no note


def test_byte_order_mark_is_dropped(tmp_path):
    """Spreadsheet exports start with a UTF-8 BOM; it used to glue itself to the first column's name
    and report a missing 'user_id' that is plainly in the header."""
    p = tmp_path / "a.inter"
    p.write_bytes(b"\xef\xbb\xbf" + (HEADER + "u1\ti1\t10\n").encode())
    assert load_interactions(p).users == ["u1"]
    q = tmp_path / "a.item"
    q.write_bytes(b"\xef\xbb\xbfitem_id:token\ttitle:token_seq\r\ni1\tRed\r\n")
    assert load_items(q).titles == {"i1": "Red"}


def test_invalid_utf8_names_file_line_and_column(tmp_path):
    p = tmp_path / "a.item"
    p.write_bytes(b"item_id:token\ttitle:token_seq\ni1\tRed\ni2\tCr\xe8me\n")
    with pytest.raises(AtomicFormatError, match=r"a.item: line 3: column 6: byte 0xe8 is not valid UTF-8"):
        load_items(p)
    p.write_bytes(b"\xff" + HEADER.encode())
    with pytest.raises(AtomicFormatError, match=r"a.item: line 1: column 1: byte 0xff"):
        load_items(p)


def test_repeated_header_row_is_an_error_naming_the_line(tmp_path):
    """Concatenated files repeat the header; read as data it became an item called 'item_id:token'."""
    item_header = "item_id:token\ttitle:token_seq\n"
    p = write(tmp_path, "a.item", item_header + "i1\tRed\n" + item_header + "i2\tBlue\n")
    with pytest.raises(AtomicFormatError, match=r"a.item: line 3: repeats the header row"):
        load_items(p)
    q = write(tmp_path, "a.inter", HEADER + "u1\ti1\t10\n\n" + HEADER)
    with pytest.raises(AtomicFormatError, match=r"a.inter: line 4: repeats the header row"):
        load_interactions(q)
    # A value that merely contains a colon is data.
    assert load_items(write(tmp_path, "b.item", item_header + "i1\tRatio 1:2\n")).titles == {"i1": "Ratio 1:2"}


def test_unparsable_number_names_line_and_field(tmp_path):
    p = write(tmp_path, "a.inter", HEADER + "u1\ti1\t10\nu1\ti2\tyesterday\n")
    with pytest.raises(AtomicFormatError, match=r"a.inter: line 3: field 'timestamp': cannot parse 'yesterday'"):
        load_interactions(p)


def test_wrong_column_count(tmp_path):
    p = write(tmp_path, "a.inter", HEADER + "u1\ti1\t10\nu1\ti2\n")
    with pytest.raises(AtomicFormatError, match=r"line 3: expected 3 tab-separated columns, found 2"):
        load_interactions(p)


def test_duplicates_reported_then_dropped(tmp_path, caplog):
    p = write(tmp_path, "a.inter", HEADER + "u1\ti1\t10\nu1\ti1\t10\nu1\ti1\t11\n")
    with caplog.at_level(logging.WARNING):
        inter = load_interactions(p)
    assert len(inter) == 2 and inter.dropped_duplicates == 1
    assert "line 3 duplicates line 2" in caplog.text


def test_columns_in_any_order_and_extra_columns(tmp_path):
    p = write(tmp_path, "a.inter", "timestamp:float\trating:float\titem_id:token\tuser_id:token\n5\t1\ti9\tu3\n")
    inter = load_interactions(p)
    assert (inter.users, inter.items, inter.timestamps) == (["u3"], ["i9"], [5.0])


def test_items_file(tmp_path):
    p = write(tmp_path, "a.item", "item_id:token\ttitle:token_seq\tbrand:token\tcategories:token_seq\n"
              "i1\tRed Lipstick\tAcme\tBeauty Makeup Lips\ni2\t\t\t\n")
    t = load_items(p)
    assert t.titles["i1"] == "Red Lipstick" and t.brands["i1"] == "Acme"
    assert t.categories["i1"] == ["Beauty", "Makeup", "Lips"] and t.categories["i2"] == []
    dup = write(tmp_path, "b.item", "item_id:token\ni1\ni1\n")
    with pytest.raises(AtomicFormatError, match=r"b.item: line 3: field 'item_id': 'i1' listed twice"):
        load_items(dup)
