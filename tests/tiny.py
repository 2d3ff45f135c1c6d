"""The tiny random-weight models the tests build (models/tiny.py), under the name the tests import."""
from models.tiny import BOS_ID, EOS_ID, PAD_ID, tiny_model  # noqa: F401
