"""Metrics at bounded cost: the rollups, the raw window and the decimated series, against pandas on the raw rows."""

import sqlite3

import numpy as np
import pandas as pd
import pytest

from pscluster.metrics import rollup, store as store_module
from pscluster.metrics.store import MIGRATIONS, SERIES_SPAN, RunStore

RUN = dict(name=None, cluster="c1", mode="async", config={}, spec={})


def truth(n: int, workers: int = 3, seed: int = 0, spike: int | None = None) -> pd.DataFrame:
    """``n`` raw rows of ``workers`` interleaved at random: one global step each, accuracy and a step_fn's ``lr``
    missing now and then; a loss of 1e6 at row ``spike``."""
    rng = np.random.default_rng(seed)
    worker = rng.integers(0, workers, n)
    df = pd.DataFrame({"worker": worker, "time": 1000.0 + np.cumsum(rng.uniform(0.001, 0.03, n)),
                       "local_step": pd.Series(worker).groupby(worker).cumcount().to_numpy() + 1,
                       "global_step": np.arange(1, n + 1), "loss": rng.random(n),
                       "accuracy": np.where(rng.random(n) < 0.2, np.nan, rng.random(n)),
                       "lr": np.where(rng.random(n) < 0.3, np.nan, rng.random(n))})
    if spike is not None:
        df.loc[spike, "loss"] = 1e6
    return df


def events(df: pd.DataFrame) -> list[dict]:
    return [{"kind": "step", "task": f"worker:{r.worker}", "time": r.time, "local_step": r.local_step,
             "global_step": r.global_step, "loss": r.loss, "accuracy": None if np.isnan(r.accuracy) else r.accuracy,
             **({} if np.isnan(r.lr) else {"metrics": {"lr": r.lr}})} for r in df.itertuples()]


def write(store: RunStore, run: int, df: pd.DataFrame, seed: int = 1) -> None:
    """``df``'s rows through ``add_batch``, in batches of random sizes."""
    rng, evs, at = np.random.default_rng(seed), events(df), 0
    while at < len(evs):
        size = int(rng.integers(1, 400))
        store.add_batch(run, evs[at:at + size])
        at += size


def expected(df: pd.DataFrame, x: str, width: float) -> pd.DataFrame:
    """The buckets of ``df`` of ``width`` on ``x``, by pandas."""
    df = df.assign(bucket=np.floor(df[x] / width).astype(np.int64)).sort_values(["worker", x])
    g = df.groupby(["worker", "bucket"])
    out = g.agg(count=("loss", "size"), time_first=("time", "min"), time_last=("time", "max"),
                step_first=("global_step", "min"), step_last=("global_step", "max"),
                local_first=("local_step", "min"), local_last=("local_step", "max"))
    for m in ("loss", "accuracy", "lr"):
        out[f"{m}_n"], out[f"{m}_sum"] = g[m].count(), g[m].sum()
        out[f"{m}_min"], out[f"{m}_max"], out[f"{m}_last"] = g[m].min(), g[m].max(), g[m].last()
    return out.reset_index()


def stored(store: RunStore, run: int, axis: int, level: int) -> pd.DataFrame:
    """The rollup rows of a level as stored, the step_fn's ``lr`` joined."""
    main = pd.read_sql_query(
        "SELECT worker, bucket, count, time_first, time_last, step_first, step_last, local_first, local_last, "
        + ", ".join(f"{m}_{s}" for m in ("loss", "accuracy") for s in rollup.STATS)
        + " FROM rollups WHERE run_id = ? AND axis = ? AND level = ? ORDER BY worker, bucket",
        store._db, params=(run, axis, level))
    extra = pd.read_sql_query("SELECT worker, bucket, n AS lr_n, sum AS lr_sum, min AS lr_min, max AS lr_max, "
                              "last AS lr_last FROM rollup_extra WHERE run_id = ? AND axis = ? AND level = ? "
                              "AND name = 'lr'", store._db, params=(run, axis, level))
    out = main.merge(extra, on=["worker", "bucket"], how="left")
    out["lr_n"], out["lr_sum"] = out["lr_n"].fillna(0), out["lr_sum"].fillna(0.0)
    return out


@pytest.mark.parametrize("reopen", [False, True])
def test_every_level_of_both_axes_holds_the_bucket_stats_of_the_raw_rows(tmp_path, reopen):
    df = truth(6000)
    with RunStore(tmp_path / "runs.sqlite") as store:
        run = store.create_run(**RUN)
        write(store, run, df.iloc[:3001] if reopen else df)
    with RunStore(tmp_path / "runs.sqlite") as store:  # a new instance goes on, into the open buckets
        if reopen:
            write(store, run, df.iloc[3001:], seed=2)
        for ladder in rollup.LADDERS.values():
            for level in range(rollup.LEVELS):
                want = expected(df, ladder.x, ladder.width_of(level))
                got = stored(store, run, ladder.code, level)
                pd.testing.assert_frame_equal(got, want[got.columns], check_dtype=False, atol=1e-9)


def test_a_decimated_series_keeps_counts_means_and_spikes(tmp_path):
    df = truth(20_000, spike=12_345)
    with RunStore(tmp_path / "runs.sqlite") as store:
        run = store.create_run(**RUN)
        write(store, run, df)
        for x in ("step", "time"):
            s = store.series(run, ["loss", "lr"], x=x, max_points=100)
            assert s.attrs["resolution"] > 0 and list(s.columns[:len(SERIES_SPAN)]) == list(SERIES_SPAN)
            assert s.groupby("worker").size().max() <= 100
            assert s.sort_values(["worker", "x"]).index.tolist() == s.index.tolist()
            assert (s.groupby("worker")["count"].sum() == df.groupby("worker").size()).all()
            assert s["loss_max"].max() == 1e6 and (s["loss_max"] == 1e6).sum() == 1
            assert s["lr_min"].min() == df["lr"].min() and s["loss_min"].min() == df["loss"].min()
            total = (s["loss_mean"] * s["count"]).sum()  # every row has a loss: mean weighted by count
            assert total == pytest.approx(df["loss"].sum())
            assert ((s["x_end"] - s["x"]) == s.attrs["resolution"]).all()
            last = s.groupby("worker").tail(1).set_index("worker")
            assert (last["loss_last"] == df.groupby("worker")["loss"].last()).all()


def test_a_small_range_reads_the_raw_rows_and_a_mid_sized_one_merges_them(tmp_path):
    df = truth(3000)
    with RunStore(tmp_path / "runs.sqlite") as store:
        run = store.create_run(**RUN)
        write(store, run, df)
        s = store.series(run, ["loss", "accuracy", "lr"], start=1000, stop=1300, workers=[0, 2])
        want = df[(df.global_step >= 1000) & (df.global_step < 1300) & df.worker.isin([0, 2])]
        want = want.sort_values(["worker", "global_step"])
        assert s.attrs["resolution"] == 0 and (s["count"] == 1).all() and (s["x"] == s["x_end"]).all()
        assert s["x"].tolist() == want["global_step"].tolist() and s["worker"].tolist() == want["worker"].tolist()
        for m in ("loss", "accuracy", "lr"):
            for stat in ("mean", "min", "max", "last"):
                np.testing.assert_array_equal(s[f"{m}_{stat}"].to_numpy(), want[m].to_numpy())
        merged = store.series(run, ["loss"], max_points=500)  # 3000 rows, in the raw window: merged from them
        assert 0 < merged.attrs["resolution"] < rollup.LADDERS["step"].width
        assert merged.groupby("worker").size().max() <= 500 and merged["count"].sum() == len(df)


def test_ranges_on_either_axis_hold_the_rows_in_them(tmp_path):
    df = truth(20_000)
    with RunStore(tmp_path / "runs.sqlite") as store:
        run = store.create_run(**RUN)
        write(store, run, df)
        for x, column, start, stop in (("step", "global_step", 5000, 15_000), ("time", "time", 1050.0, 1200.0),
                                       ("step", "global_step", None, 900), ("time", "time", 1200.0, None)):
            s = store.series(run, ["loss"], x=x, start=start, stop=stop, max_points=80)
            inside = df[(df[column] >= (start or -np.inf)) & (df[column] < (stop or np.inf))]
            assert s.groupby("worker").size().max() <= 80
            assert (s["x_end"] > (start or -np.inf)).all() and (s["x"] < (stop or np.inf)).all()
            # every row in the range is counted, and no bucket reaches further than one of its width
            assert s["count"].sum() >= len(inside)
            r = s.attrs["resolution"]
            outside = df[(df[column] >= s["x"].min()) & (df[column] < s["x_end"].max())]
            assert s["count"].sum() == len(outside) and s["x"].min() > (start or -np.inf) - r


def test_names_unknown_metrics_and_unknown_runs(tmp_path):
    with RunStore(tmp_path / "runs.sqlite") as store:
        run = store.create_run(**RUN)
        write(store, run, truth(500))
        assert store.series_names(run) == ["loss", "accuracy", "lr"]
        s = store.series(run, ["nope", "lr"])
        assert s["nope_mean"].isna().all() and s["lr_max"].notna().any()
        empty = store.series(run + 1, ["loss", "lr"], x="time")
        assert empty.empty and list(empty.columns) == [*SERIES_SPAN, *(f"{m}_{s}" for m in ("loss", "lr")
                                                                       for s in ("mean", "min", "max", "last"))]
        assert store.series_names(run + 1) == [] and store.latest(run + 1)["workers"] == {}
        with pytest.raises(ValueError, match="step"):
            store.series(run, x="epoch")


def check_latest(store: RunStore, run: int, df: pd.DataFrame) -> None:
    latest = store.latest(run)
    assert latest["first_time"] == df["time"].min() and latest["first_step"] == df["global_step"].min()
    newest = df.sort_values("global_step").groupby("worker").tail(1).set_index("worker")
    assert latest["workers"] == {w: {"time": r.time, "global_step": r.global_step, "local_step": r.local_step,
                                     "loss": r.loss} for w, r in newest.iterrows()}


def test_the_raw_window_is_trimmed_while_series_and_latest_cover_the_whole_run(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "RAW_WINDOW", 1000)
    monkeypatch.setattr(store_module, "RAW_SLACK", 100)
    df = truth(20_000)
    with RunStore(tmp_path / "runs.sqlite") as store:
        run, other = store.create_run(**RUN), store.create_run(**RUN)
        write(store, other, truth(50))  # a short run beside it keeps every row
        write(store, run, df)
        raw = store.metrics(run)
        assert 1000 <= len(raw) <= 1100 and raw["global_step"].tolist() == df["global_step"].tolist()[-len(raw):]
        assert len(store.metrics(other)) == 50
        s = store.series(run, ["loss"], max_points=300)
        assert s["count"].sum() == len(df) and s["step_first"].min() == 1
        old = store.series(run, ["loss"], start=100, stop=200)  # before the window: from the rollups
        assert old.attrs["resolution"] > 0 and old["count"].sum() >= 100
        check_latest(store, run, df)
    with RunStore(tmp_path / "runs.sqlite") as store:  # another instance counts the window from the store
        write(store, run, truth(20_600).iloc[20_000:])
        assert 1000 <= len(store.metrics(run)) <= 1100


def test_rollup_storage_grows_with_the_log_of_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(rollup, "KEEP", 8)
    monkeypatch.setattr(store_module, "RAW_WINDOW", 100)
    monkeypatch.setattr(store_module, "RAW_SLACK", 10)

    def rows(n: int) -> pd.DataFrame:
        with RunStore(tmp_path / f"{n}.sqlite") as store:
            run = store.create_run(**RUN)
            write(store, run, truth(n, workers=1))
            return pd.read_sql_query("SELECT axis, level, count(*) AS n FROM rollups GROUP BY axis, level",
                                     store._db).set_index(["axis", "level"])["n"]
    small, large = rows(2000), rows(20_000)
    below_top = large.index.get_level_values("level") < rollup.TOP
    assert (large[below_top] <= rollup.KEEP + 1).all()  # + the bucket begun since the last trim
    assert large.sum() - small.sum() <= 2 * 2 * (rollup.KEEP + 1)  # two axes


def make_v4_store(path, df: pd.DataFrame) -> None:
    """A run store as schema 4 wrote it: one run with ``df``'s rows."""
    db = sqlite3.connect(path)
    for script in MIGRATIONS[:4]:
        db.executescript(script)
    db.execute("PRAGMA user_version = 4")
    db.execute("INSERT INTO runs (name, cluster, mode, status, started, config, spec) "
               "VALUES ('old', 'c', 'async', 'finished', 1.0, '{}', '{}')")
    db.executemany("INSERT INTO metrics (run_id, worker, time, local_step, global_step, loss, accuracy, extra) "
                   "VALUES (1, ?, ?, ?, ?, ?, ?, ?)",
                   [(e["task"][-1:], e["time"], e["local_step"], e["global_step"], e["loss"], e["accuracy"],
                     None if "metrics" not in e else f'{{"lr": {e["metrics"]["lr"]!r}}}') for e in events(df)])
    db.commit()
    db.close()


def test_a_schema_4_store_is_read_as_is_and_upgraded_with_its_rows_rolled_up(tmp_path):
    path, df = tmp_path / "old.sqlite", truth(3000)
    make_v4_store(path, df)
    with RunStore(path, readonly=True) as reader:  # not migrated: from the raw rows
        assert reader.schema_version == 4 and reader.series_names(1) == ["loss", "accuracy", "lr"]
        # a store older than leases (6): its runs read as stored, held by no one
        [status] = reader.runs()["status"]
        assert reader.run(1)["status"] == status and reader.run(1)["owner_lost"] is None
        check_latest(reader, 1, df)
        before = reader.series(1, ["loss", "lr"], max_points=100)
        assert before["count"].sum() == len(df) and before.groupby("worker").size().max() <= 100
    with RunStore(path) as store:
        assert store.schema_version == len(MIGRATIONS) and len(store.metrics(1)) == len(df)
        check_latest(store, 1, df)
        ladder = rollup.LADDERS["step"]
        got = stored(store, 1, ladder.code, 0)
        pd.testing.assert_frame_equal(got, expected(df, ladder.x, ladder.width)[got.columns], check_dtype=False)
        after = store.series(1, ["loss", "lr"], max_points=100)
        assert after["count"].sum() == len(df) and after["loss_max"].max() == before["loss_max"].max()
