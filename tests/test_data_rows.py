"""Row format: JSONL/Parquet round trips, verl Parquet files loading unchanged, and clear errors on bad input."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.jsonio import atomic_write_text, read_json_array
from data.rows import make_row, read_rows, write_rows


def sample_rows():
    return [
        make_row([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
                 data_source="math", ability="arithmetic", ground_truth=json.dumps({"answer": "4"}),
                 index=0, split="train", target="4", tags=["easy"]),
        make_row([{"role": "user", "content": "Capital of France? \u00e9"}], data_source="qa", ability="facts",
                 ground_truth="Paris;paris", index=1, split="train", target="Paris", tags=[]),
    ]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_round_trip_is_exact(tmp_path, suffix):
    rows = sample_rows()
    path = tmp_path / f"rows{suffix}"
    write_rows(rows, path)
    assert read_rows(path) == rows


def test_jsonl_and_parquet_have_the_same_columns(tmp_path):
    write_rows(sample_rows(), tmp_path / "a.jsonl")
    write_rows(sample_rows(), tmp_path / "a.parquet")
    assert pq.read_schema(tmp_path / "a.parquet").names == ["prompt", "data_source", "ability", "reward_model", "extra_info"]
    assert read_rows(tmp_path / "a.jsonl") == read_rows(tmp_path / "a.parquet")


def test_verl_parquet_loads_unchanged(tmp_path):
    # Written the way verl's example preprocessors do: plain-string ground truth, a "style" key, extra columns.
    verl_rows = [
        {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "Natalia sold 48 clips... Let's think."}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": "72"},
         "extra_info": {"split": "train", "index": 0, "answer": "She sold 48/2 = 24 ... #### 72", "question": "Natalia..."}},
        {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "Weng earns $12 an hour..."}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": "10"},
         "extra_info": {"split": "train", "index": 1, "answer": "... #### 10", "question": "Weng..."}},
    ]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows), path)
    assert read_rows(path) == verl_rows


def test_parquet_fills_keys_missing_in_some_rows_with_none(tmp_path):
    rows = sample_rows()
    rows[1]["extra_info"].pop("tags")
    write_rows(rows, tmp_path / "rows.parquet")
    assert read_rows(tmp_path / "rows.parquet")[1]["extra_info"]["tags"] is None


def test_any_json_ground_truth_loads_as_in_verl(tmp_path):
    """verl's rows carry numbers, lists or objects as ground truth (on 5cd6fe9 an integer was refused)."""
    good = sample_rows()[0]
    truths = [20, 2.5, ["Paris", "City of Light"], {"answer": "A"}, "plain"]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({**good, "reward_model": {"ground_truth": t}}) + "\n" for t in truths))
    assert [row["reward_model"]["ground_truth"] for row in read_rows(path)] == truths


@pytest.mark.parametrize(
    "row, message",
    [
        ({"data_source": "x", "reward_model": {"ground_truth": "1"}}, "missing field 'prompt'"),
        ({"prompt": [], "data_source": "x", "reward_model": {"ground_truth": "1"}}, "field 'prompt' must be a non-empty list"),
        ({"prompt": [{"role": "user"}], "data_source": "x", "reward_model": {"ground_truth": "1"}}, "prompt[0] must be an object with 'role'"),
        ({"prompt": [{"role": "robot", "content": "hi"}], "data_source": "x", "reward_model": {"ground_truth": "1"}}, "(one of ('system', 'user', 'assistant', 'tool')) and 'content' (a string), got dict {'role': 'robot'"),
        ({"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "1"}}, "field 'data_source'"),
        ({"prompt": [{"role": "user", "content": "hi"}], "data_source": "x"}, "field 'reward_model'"),
        ({"prompt": [{"role": "user", "content": "hi"}], "data_source": "x", "reward_model": {"answer": 4}}, "non-null 'ground_truth', got dict {'answer': 4}"),
        ({"prompt": [{"role": "user", "content": "hi"}], "data_source": "x", "reward_model": {"ground_truth": "4"},
          "extra_info": {"index": "7"}}, "extra_info.index' must be an integer"),
    ],
)
def test_malformed_row_names_file_line_and_field(tmp_path, row, message):
    good = sample_rows()[0]
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError) as error:
        read_rows(path)
    assert f"{path}:3:" in str(error.value) and message in str(error.value)


def test_parquet_errors_name_the_row(tmp_path):
    rows = sample_rows()
    rows[1]["reward_model"] = {"ground_truth": None}
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(ValueError, match=r"bad.parquet row 2: field 'reward_model' must be an object with a non-null 'ground_truth'"):
        read_rows(path)


GOOD_LINE = (json.dumps(sample_rows()[0]) + "\n").encode()


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "the file is empty"),
        (b"\n \n", "no records"),
        (b"\x00\x01\x02binary\xff\xfe", ":1: binary data"),
        (GOOD_LINE + b"\xff\xfe\xfd junk\n", ":2: not UTF-8 text"),
        (GOOD_LINE + b'{"a": \n', ":2: invalid JSON"),
        (b"[1, 2]\n", ":1: expected a JSON object, got list"),
    ],
)
def test_bad_jsonl_files(tmp_path, content, message):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        read_rows(path)


def test_jsonl_byte_order_mark_is_dropped(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD_LINE)
    assert read_rows(path) == sample_rows()[:1]


def test_ten_megabyte_line_fails_with_a_short_message(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "' + "x" * (10 * 1024 * 1024) + '"}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:1: line is 10,485,77\d bytes, over the limit") as error:
        read_rows(path)
    assert len(str(error.value)) < 300


def test_junk_parquet_and_unknown_suffix(tmp_path):
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match="junk.parquet: not a readable Parquet file"):
        read_rows(tmp_path / "junk.parquet")
    with pytest.raises(ValueError, match="unknown row file type '.csv'"):
        read_rows(tmp_path / "rows.csv")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_rows(tmp_path / "missing.jsonl")


def test_bad_row_writes_nothing_and_keeps_the_old_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_rows(sample_rows(), path)
    before = path.read_bytes()
    bad = sample_rows() + [{"prompt": "not a list"}]
    with pytest.raises(ValueError, match="row 3 to be written"):
        write_rows(bad, path)
    assert path.read_bytes() == before
    with pytest.raises(ValueError, match="rows cannot be stored as Parquet"):
        mixed = sample_rows()
        mixed[1]["extra_info"]["tags"] = "not a list"
        write_rows(mixed, tmp_path / "mixed.parquet")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl"]


def test_atomic_write_leaves_no_temporary_file(tmp_path):
    atomic_write_text(tmp_path / "sub" / "out.txt", "hello")
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["out.txt"]


def test_json_array_reports_the_element_of_each_record(tmp_path):
    path = tmp_path / "qa.json"
    path.write_text('[\n  {"q": 1},\n  {"q": 2,\n   "r": 3},\n  {"q": 4}\n]\n')
    assert read_json_array(path) == [(f"{path} element 1", {"q": 1}), (f"{path} element 2", {"q": 2, "r": 3}),
                                     (f"{path} element 3", {"q": 4})]
    for text, message in [
        ('[\n {"q": 1},\n 7\n]', "qa.json element 2: expected a JSON object, got int"),
        ('[\n {"q": 1}\n {"q": 2}\n]', "qa.json:3: invalid JSON \\(Expecting ','"),
        ('[\n {"q": 1},\n {"q": }\n]', "qa.json:3: invalid JSON"),
        ('{"q": 1}', "qa.json: expected a non-empty JSON array of objects, got dict"),
        ("[ ]", "qa.json: expected a non-empty JSON array of objects, got list"),
        ('[{"q": 1}] extra', "qa.json:1: invalid JSON \\(Extra data"),
        (b"\xef\xbb\xbf\xff\xfe junk", "qa.json: not UTF-8 text"),
    ]:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(ValueError, match=message):
            read_json_array(path)
    path.write_bytes(b'\xef\xbb\xbf[{"q": 1}]')  # a byte-order mark, as some Windows editors write
    assert read_json_array(path) == [(f"{path} element 1", {"q": 1})]
