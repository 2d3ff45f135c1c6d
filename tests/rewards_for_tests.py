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


def sleeps_on_row(data_source, solution_str, ground_truth, extra_info=None):
    """vowel_fraction, except that row index 5 never returns (a hung reward service) and row index 6 kills its own
    process (a reward that crashes its worker); ground_truth "slow" sleeps 0.5 s first (a slow remote judge)."""
    import os
    import signal
    import time
    index = (extra_info or {}).get("index")
    if index == 5:
        while True:
            time.sleep(60)
    if index == 6:
        os.kill(os.getpid(), signal.SIGKILL)
    if ground_truth == "slow":
        time.sleep(0.5)
    return vowel_fraction(data_source, solution_str, ground_truth, extra_info)
