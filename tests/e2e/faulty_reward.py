"""A reward function with a bug, to check that user-code errors fail fast instead of burning retries."""


def reward(prompt: str, completion: str, row: dict) -> float:
    return {"a": 1}[completion]  # KeyError: the bug
