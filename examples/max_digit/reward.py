"""Verifiable reward for "the larger of two digits": 1 when the answer is right, else 0."""


def reward(prompt: str, completion: str, row: dict) -> float:
    return 1.0 if completion.strip().split()[:1] == [str(row["answer"])] else 0.0
