"""Data: public data sets (SciFact, factual QA, verifier judgments) and a generated evidence task turned into
verl-layout rows (rows.py), read and written as JSONL or Parquet."""
