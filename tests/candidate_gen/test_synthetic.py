import hashlib

from candidate_gen.atomic import find_atomic_file, load_interactions, load_items
from candidate_gen.split import filter_sequences
from candidate_gen.synthetic import SyntheticConfig, generate, write_synthetic


def digest(d):
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(d.iterdir()))).hexdigest()


def test_deterministic_under_seed(tmp_path):
    a = write_synthetic(tmp_path / "a", SyntheticConfig(n_users=150, seed=7))
    b = write_synthetic(tmp_path / "b", SyntheticConfig(n_users=150, seed=7))
    c = write_synthetic(tmp_path / "c", SyntheticConfig(n_users=150, seed=8))
    assert digest(a) == digest(b) != digest(c)


def test_loadable_and_has_structure(tiny_catalog):
    inter = load_interactions(find_atomic_file(tiny_catalog, "inter"))
    items = load_items(find_atomic_file(tiny_catalog, "item"))
    seqs = filter_sequences(inter).by_user
    assert len(seqs) > 200
    assert all(len(s) == len(set(s)) for s in seqs.values())  # no repeat purchases
    # Co-purchase structure: consecutive pairs repeat across users far more than chance.
    pairs = [(s[k], s[k + 1]) for s in seqs.values() for k in range(len(s) - 1)]
    assert len(set(pairs)) < 0.8 * len(pairs)
    # Brand affinity: consecutive items share a brand more often than two random items do.
    same = sum(items.brands[a] == items.brands[b] for a, b in pairs) / len(pairs)
    assert same > 0.2
    assert all(items.categories[i][0] == "Beauty" for i in items.titles)


def test_scales_up():
    users, items, times, table = generate(SyntheticConfig(n_users=3000, seed=1))
    assert len(set(users)) == 3000 and len(table) >= 1500


def test_variants_lack_brand_titles_or_timestamps_and_keep_the_sequences(tmp_path, tiny_catalog):
    """The variants change only what they remove: with every timestamp tied, or no timestamp
    column, file order gives each user the same sequence the real timestamps give."""
    full = filter_sequences(load_interactions(find_atomic_file(tiny_catalog, "inter"))).by_user
    for stamps in ("tied", "none"):
        d = write_synthetic(tmp_path / stamps, SyntheticConfig(n_users=300, seed=3, brand_column=False, titles=False,
                                                               timestamps=stamps), name="tiny")
        header = (d / "tiny.inter").read_text().splitlines()[0]
        assert ("timestamp" in header) == (stamps == "tied")
        inter = load_interactions(d / "tiny.inter")
        assert set(inter.timestamps) == {0.0}
        assert filter_sequences(inter).by_user == full
    items = load_items(d / "tiny.item")
    assert (d / "tiny.item").read_text().splitlines()[0] == "item_id:token\ttitle:token_seq\tcategories:token_seq"
    assert set(items.titles.values()) == {""} and set(items.brands.values()) == {""}
    assert items.categories == load_items(find_atomic_file(tiny_catalog, "item")).categories
