"""The tiny random-weight models the tests build (bench/tiny.py), under the name the tests import."""
from bench.tiny import BOS_ID, EOS_ID, PAD_ID, tiny_model  # noqa: F401
