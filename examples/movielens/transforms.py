"""Read-time transforms for MovieLens-100k (docs/your-data.md, "Train straight from the table").

Each function takes a pyarrow.RecordBatch (or Table) of the ratings joined with the user table (age,
gender, occupation, zip_code) and the item table (title, dates, URL, one 0/1 column per genre)
and returns a pyarrow.Table; `python -m recxla.train --transform
examples/movielens/transforms.py:features` applies `features`.
"""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
          "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
          "Romance", "Sci-Fi", "Thriller", "War", "Western")
AGE_EDGES = (18, 25, 35, 45, 50, 56)  # the age groups of MovieLens-1M's users.dat


def label_from_rating(batch: pa.RecordBatch) -> pa.Table:
    """label = 1 for a rating of 4 or 5 (a liked movie), the rating itself dropped."""
    t = pa.table(batch)
    liked = pc.cast(pc.greater_equal(t.column("rating"), 4), pa.int8())
    return t.drop_columns(["rating"]).append_column("label", liked)


def age_bucket(batch: pa.RecordBatch) -> pa.Table:
    """age -> age_group, an id (the index of its bucket among AGE_EDGES), and age in decades
    as a dense feature (a float column)."""
    t = pa.table(batch)
    age = pc.fill_null(t.column("age"), 0).to_numpy(zero_copy_only=False)
    group = np.searchsorted(np.asarray(AGE_EDGES), age, side="right").astype(np.int64)
    return (t.drop_columns(["age"]).append_column("age_group", pa.array(group))
            .append_column("age_decades", pa.array(age / 10.0)))


def user_genre_cross(batch: pa.RecordBatch) -> pa.Table:
    """The movie's genres as one bag of ids (`genres`, from the 0/1 genre columns) and the
    cross of the user's gender and age group with each genre (`user_genre`, strings such as
    "F|25|Drama"): a bag per row, hashed or given a vocabulary like any string ids."""
    t = pa.table(batch)
    n = t.num_rows
    flags = np.stack([t.column(g).to_numpy(zero_copy_only=False) for g in GENRES], axis=1)
    flags = np.nan_to_num(flags.astype(np.float64)) > 0  # no item row (no join match): none
    rows, cols = np.nonzero(flags)
    lengths = np.bincount(rows, minlength=n)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    genre = np.asarray(GENRES, dtype=object)[cols]
    genres = pa.ListArray.from_arrays(offsets, pa.array(genre, pa.string()))
    gender = np.asarray(t.column("gender").to_pylist(), dtype=object)[rows]
    age = t.column("age_group").to_numpy(zero_copy_only=False)[rows]
    cross = [f"{s}|{a}|{g}" for s, a, g in zip(gender, age, genre)]
    user_genre = pa.ListArray.from_arrays(offsets, pa.array(cross, pa.string()))
    return (t.drop_columns(list(GENRES))
            .append_column("genres", genres).append_column("user_genre", user_genre))


def drop_text(batch: pa.RecordBatch) -> pa.Table:
    """Leave out the columns that are not features: title, dates, URL, zip code."""
    t = pa.table(batch)
    text = ["movie_title", "release_date", "video_release_date", "IMDb_URL", "zip_code"]
    return t.drop_columns([c for c in text if c in t.column_names])


def features(batch: pa.RecordBatch) -> pa.Table:
    """All of the above, in order: the one transform the worked example names."""
    t = batch
    for step in (label_from_rating, age_bucket, user_genre_cross, drop_text):
        t = step(t)
    return t
