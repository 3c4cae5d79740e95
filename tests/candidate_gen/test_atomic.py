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
    p = write(tmp_path, "a.inter", "user_id:token\titem_id:token\nu\ti\n")
    with pytest.raises(AtomicFormatError, match=r"a.inter: line 1: missing required column 'timestamp'"):
        load_interactions(p)


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
