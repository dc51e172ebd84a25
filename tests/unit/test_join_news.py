"""What a rank publishes as it joins (worker/join_news.py): its samplers' news since its last
commit, as bits or int64s behind a JSON header, read back exactly, and bytes it could not have
written refused with a ValueError (which a reader turns into a failed commit, never a guess)."""

from __future__ import annotations

import json
import random
import struct
import zlib
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticrun.worker import join_news
from elasticrun.worker.exceptions import HorovodInternalError

pytestmark = pytest.mark.timeout(120)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=8), st.tuples(st.integers(0, 50), st.sets(st.integers(0, 5000))),
                       max_size=3))
def test_news_round_trip(news: dict) -> None:
    sent = {k: (e, sorted(v)) for k, (e, v) in news.items()}
    assert join_news.decode(join_news.encode(sent)) == sent


def _form(blob: bytes) -> dict:
    raw = zlib.decompress(blob)
    (size,) = struct.unpack_from("<I", raw)
    return json.loads(raw[4:4 + size])


def test_dense_news_travel_as_bits_and_sparse_news_as_int64s() -> None:
    dense = list(range(0, 1_000_000, 2))
    sparse = [5, 999_999]
    blob = join_news.encode({"a": (3, dense), "b": (3, sparse), "c": (0, [])})
    assert _form(blob) == {"a": [3, "bits", 999_999, 125_000], "b": [3, "i64", 2, 16], "c": [0, "i64", 0, 0]}
    assert len(blob) < 20_000  # (the JSON of the dense list was 3.4 MB before compression)
    assert join_news.decode(blob) == {"a": (3, dense), "b": (3, sparse), "c": (0, [])}


@pytest.mark.parametrize("bad", [
    b"", b"\x01\x02", struct.pack("<I", 200) + b"{}",
    struct.pack("<I", 24) + b'{"a": [1, "i64", 2, 16]}' + b"\0" * 15,
    struct.pack("<I", 24) + b'{"a": [1, "i64", 3, 16]}' + b"\0" * 16,
    struct.pack("<I", 23) + b'{"a": [1, "bits", 9, 1]}' + b"\0",
    struct.pack("<I", 22) + b'{"a": [1, "zip", 1, 1]}' + b"\0",
    struct.pack("<I", 2) + b"{}" + b"extra",
])
def test_bytes_it_could_not_have_written_are_a_value_error(bad: bytes) -> None:
    with pytest.raises(ValueError):
        join_news.decode(zlib.compress(bad))


def test_a_negative_index_is_refused_before_anything_is_published() -> None:
    with pytest.raises(ValueError, match="negative index"):
        join_news.encode({"s": (0, [1, -2])})


class Store:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: object) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else bytes(value)  # type: ignore[arg-type]

    def get(self, key: str) -> bytes:
        return self.data[key]


def test_published_news_in_parts_are_read_back_and_a_bad_part_fails_the_commit(monkeypatch) -> None:
    monkeypatch.setattr(join_news, "PART", 100)
    news = {"s": (2, sorted(random.Random(1).sample(range(100_000), 3000)))}  # (random bits: 12 KB compressed)
    r = SimpleNamespace(store=Store(), rank=1, number=4, join_gen=2)
    join_news.pending_from(lambda: news)
    try:
        join_news.publish(r, 2)  # type: ignore[arg-type]
    finally:
        join_news.pending_from(None)
    assert int(r.store.get("elasticrun/join/2/news/1")) > 1
    assert join_news.published(r, 1) == news  # type: ignore[arg-type]
    r.store.data["elasticrun/join/2/news/1/0"] = b"not zlib"
    r.number = 5  # (a new round: read again)
    with pytest.raises(HorovodInternalError, match="what rank 1 recorded before it joined could not be read"):
        join_news.published(r, 1)  # type: ignore[arg-type]


def test_a_set_of_millions_travels_in_a_fraction_of_its_json() -> None:
    indices = torch.randperm(4_000_000)[:3_000_000].sort().values.tolist()
    blob = join_news.encode({"s": (1, indices)})
    assert len(blob) < 600_000  # bits: 500 KB at most (the JSON was 27 MB)
    assert join_news.decode(blob)["s"][1] == indices
