"""Reward for "count on from the larger of two digits" (`3 8 =` -> `9 0 1`): a three-token answer, so
every rollout decodes several tokens. Partial credit per position (the right digit in the right place),
over the longer of the answer and the completion, so rambling on past the last digit scores less.
"""


def reward(prompt: str, completion: str, row: dict) -> float:
    want, got = row["answer"].split(), completion.split()
    return sum(a == b for a, b in zip(want, got)) / max(len(want), len(got))
