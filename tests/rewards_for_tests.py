"""A reward for end-to-end tests on random-weight models: it varies within every group (so advantages are
non-zero and parameters move) and is deterministic. Registered through reward.functions by dotted path."""


def vowel_fraction(data_source, solution_str, ground_truth, extra_info=None):
    letters = [c for c in solution_str.lower() if c.isalpha()]
    score = sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0
    return {"score": score, "acc": float(score > 0.3), "format": 1.0}


def vowel_sentences(data_source, solution_str, ground_truth, extra_info=None):
    """vowel_fraction plus one 'sentence' per half of the text: +0.1 for the first half, -0.1 for the second."""
    result = vowel_fraction(data_source, solution_str, ground_truth, extra_info)
    half = len(solution_str) // 2
    result["sentences"] = [(0, half, 0.1), (half, len(solution_str), -0.1)] if half else []
    return result


def constant(data_source, solution_str, ground_truth, extra_info=None):
    """Every completion scores 0.7: every group is flat, so there is no learning signal at all."""
    return 0.7



def vowels_slowly(data_source, solution_str, ground_truth, extra_info=None):
    """vowel_fraction after 0.5 s, as a remote judge answers."""
    import time
    time.sleep(0.5)
    return vowel_fraction(data_source, solution_str, ground_truth, extra_info)


def hangs_on_row_5(data_source, solution_str, ground_truth, extra_info=None):
    """vowel_fraction, except that on row index 5 it never returns (a reward service that stopped answering)."""
    import time
    while (extra_info or {}).get("index") == 5:
        time.sleep(60)
    return vowel_fraction(data_source, solution_str, ground_truth, extra_info)


def dies_on_row_6(data_source, solution_str, ground_truth, extra_info=None):
    """vowel_fraction, except that on row index 6 it kills its own process (a reward that crashes its worker)."""
    import os
    import signal
    if (extra_info or {}).get("index") == 6:
        os.kill(os.getpid(), signal.SIGKILL)
    return vowel_fraction(data_source, solution_str, ground_truth, extra_info)
