"""SciFact to rows: the official counts, the evidence choice rule, the prompt and target format, bad input."""
import json
from collections import Counter

import pytest

from data import scifact
from data.scifact import INSTRUCTIONS, evidence_row
from data.rows import read_rows

TARGET_FORMAT = "<answer>\n{label}\n</answer>\n\n<evidence>\n{lines}</evidence>"


@pytest.fixture(scope="module")
def converted(shared_data):
    return scifact.convert_directory(shared_data / "scifact")


def test_official_counts(converted):
    assert len(converted["train"]) == 809
    assert len(converted["dev"]) == 300
    dev_labels = Counter(row["extra_info"]["label"] for row in converted["dev"])
    assert dev_labels == {"SUPPORTS": 124, "REFUTES": 64, "NOT_ENOUGH_INFO": 112}
    train_labels = Counter(row["extra_info"]["label"] for row in converted["train"])
    assert train_labels == {"SUPPORTS": 332, "REFUTES": 173, "NOT_ENOUGH_INFO": 304}


def test_contradict_claim_takes_its_rationale_sentence(converted, shared_data):
    # claims_train.jsonl line 2: {"id": 2, "evidence": {"13734012": [{"sentences": [4], "label": "CONTRADICT"}]}}
    corpus = scifact.load_corpus(shared_data / "scifact" / "corpus.jsonl")
    abstract = corpus[13734012]["abstract"]
    row = next(row for row in converted["train"] if row["extra_info"]["claim_id"] == 2)
    assert json.loads(row["reward_model"]["ground_truth"]) == {"answer": "REFUTES", "evidence": [" ".join(abstract[4].split())]}
    assert row["extra_info"]["target"] == TARGET_FORMAT.format(label="REFUTES", lines=f"[1] {' '.join(abstract[4].split())}\n")
    prompt = row["prompt"][0]["content"]
    assert prompt.startswith("Claim: 1 in 5 million in UK have abnormal PrP positivity.\n\nTitle: ")
    for i, sentence in enumerate(abstract):  # every sentence, numbered from 0
        assert f"\n[{i}] {' '.join(sentence.split())}\n" in prompt
    assert f"\n[{len(abstract)}] " not in prompt
    assert prompt.endswith(INSTRUCTIONS)
    assert row["data_source"] == "scifact_evidence" and row["extra_info"]["split"] == "train"


def test_no_evidence_claim_takes_first_cited_document(converted):
    row = converted["train"][0]  # {"id": 0, "evidence": {}, "cited_doc_ids": [31715818]}
    assert row["extra_info"]["claim_id"] == 0 and row["extra_info"]["doc_id"] == 31715818
    assert json.loads(row["reward_model"]["ground_truth"]) == {"answer": "NOT_ENOUGH_INFO", "evidence": []}
    assert row["extra_info"]["target"] == "<answer>\nNOT_ENOUGH_INFO\n</answer>\n\n<evidence>\n</evidence>"


def test_first_evidence_document_and_rationale_set(tmp_path):
    (tmp_path / "corpus.jsonl").write_text(
        json.dumps({"doc_id": 1, "title": "T1", "abstract": ["a0.", "a1.", "a2."]}) + "\n"
        + json.dumps({"doc_id": 2, "title": "T2", "abstract": ["b0.", "b1."]}) + "\n"
    )
    claim = {"id": 5, "claim": "C.", "cited_doc_ids": [1, 2],
             "evidence": {"2": [{"sentences": [1, 0], "label": "SUPPORT"}, {"sentences": [1], "label": "SUPPORT"}],
                          "1": [{"sentences": [2], "label": "SUPPORT"}]}}
    (tmp_path / "claims_train.jsonl").write_text(json.dumps(claim) + "\n")
    (row,) = scifact.convert_directory(tmp_path, ("train",))["train"]
    # Document 2 (first in the evidence object), its first rationale set, listed in reading order.
    assert json.loads(row["reward_model"]["ground_truth"]) == {"answer": "SUPPORTS", "evidence": ["b0.", "b1."]}
    assert row["extra_info"]["target"].endswith("<evidence>\n[1] b0.\n[2] b1.\n</evidence>")
    assert "Title: T2\n[0] b0.\n[1] b1.\n\n" in row["prompt"][0]["content"]


def test_test_split_is_refused(shared_data):
    with pytest.raises(ValueError, match="claims_test.jsonl: these claims have no 'evidence' labels"):
        scifact.convert_directory(shared_data / "scifact", ("test",))


def write_case(folder, claims, corpus=None):
    corpus = corpus or [{"doc_id": 1, "title": "T", "abstract": ["s0.", "s1."]}]
    (folder / "corpus.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in corpus))
    (folder / "claims_train.jsonl").write_text("".join(json.dumps(claim) + "\n" for claim in claims))


GOOD = {"id": 1, "claim": "C.", "evidence": {"1": [{"sentences": [0], "label": "SUPPORT"}]}, "cited_doc_ids": [1]}


@pytest.mark.parametrize(
    "claims, corpus, message",
    [
        ([GOOD, {**GOOD, "id": 7, "evidence": {"1": [{"sentences": [2], "label": "SUPPORT"}]}}], None,
         r"claims_train.jsonl:2: claim id 7, doc_id 1: evidence index 2 is out of range for 2 sentences"),
        ([{**GOOD, "id": 9, "evidence": {}, "cited_doc_ids": [44]}], None,
         r"claims_train.jsonl:1: claim id 9 cites doc_id 44, which is not in the corpus"),
        ([GOOD, GOOD], None, r"claims_train.jsonl:2: duplicate claim id 1 \(first seen at .*claims_train.jsonl:1\)"),
        ([GOOD], [{"doc_id": 1, "title": "T", "abstract": ["s."]}, {"doc_id": 1, "title": "U", "abstract": ["t."]}],
         r"corpus.jsonl:2: duplicate doc_id 1"),
        ([{**GOOD, "claim": 3}], None, r"claims_train.jsonl:1: field 'claim' must be str"),
        ([{k: v for k, v in GOOD.items() if k != "id"}], None, r"claims_train.jsonl:1: missing field 'id'"),
        ([{**GOOD, "evidence": {"1": [{"sentences": [0], "label": "MAYBE"}]}}], None,
         r"claims_train.jsonl:1: claim id 1: field 'evidence.1' must be .*, got list .*'label': 'MAYBE'"),
        ([{**GOOD, "evidence": {"x": [{"sentences": [0], "label": "SUPPORT"}]}}], None, r"field 'evidence.x' must be"),
        ([{**GOOD, "evidence": {"1": [{"sentences": ["0"], "label": "SUPPORT"}]}}], None,
         r"claims_train.jsonl:1: claim id 1, doc_id 1: evidence index '0' is out of range"),
        ([GOOD], [{"doc_id": 1, "title": "T"}], r"corpus.jsonl:1: missing field 'abstract'"),
    ],
)
def test_bad_input_is_reported_with_the_id(tmp_path, claims, corpus, message):
    write_case(tmp_path, claims, corpus)
    with pytest.raises(ValueError, match=message):
        scifact.convert_directory(tmp_path, ("train",))


def test_cli_writes_every_split_or_nothing(tmp_path, shared_data, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="claims_test.jsonl"):
        scifact.main(["--input", str(shared_data / "scifact"), "--out", str(out), "--splits", "dev", "test"])
    assert not out.exists()  # dev was fine, but nothing is written until every split has been read
    scifact.main(["--input", str(shared_data / "scifact"), "--out", str(out), "--splits", "dev", "--format", "parquet"])
    assert len(read_rows(out / "dev.parquet")) == 300
    assert "dev.parquet: 300 rows" in capsys.readouterr().out


def test_evidence_row_rejects_inconsistent_evidence():
    def row(sentences, label, indices):
        return evidence_row("c", "t", sentences, label, indices, index=0, split="test")

    with pytest.raises(ValueError, match="out of range for 2 sentences"):
        row(["a.", "b."], "SUPPORTS", [2])
    with pytest.raises(ValueError, match="NOT_ENOUGH_INFO takes no evidence"):
        row(["a.", "b."], "NOT_ENOUGH_INFO", [0])
    with pytest.raises(ValueError, match="REFUTES needs at least one evidence sentence"):
        row(["a."], "REFUTES", [])
    with pytest.raises(ValueError, match="label 'SUPPORT' is not one of"):
        row(["a."], "SUPPORT", [0])


def test_targets_get_the_full_scifact_evidence_reward(converted):
    from rewards import compute_score

    for row in converted["dev"]:
        result = compute_score(row["data_source"], row["extra_info"]["target"], row["reward_model"]["ground_truth"])
        assert result["score"] == 1.0, row["extra_info"]["claim_id"]
