"""Data: public data sets and a generated evidence task as verl-layout rows (rows.py), in JSONL or Parquet."""
