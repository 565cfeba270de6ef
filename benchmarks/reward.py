"""What a reward that waits on a service adds to a step: a verifier behind HTTP taking 50 ms a sample, called for
a default-size step's 64 samples one after another and as relaunch calls it (reward.concurrency at once).

    .venv/bin/python benchmarks/reward.py [--samples 64] [--latency 0.05] [--concurrency 1,4,16,64] [--quick]

Scoring is on the step's path (the update needs every reward), so the time to score a step's samples is what the
reward adds to the step. The service is on this machine (supervisor/testing/reward_service.py); a user's reward
function makes one request a sample, as `score` does here.
"""
from __future__ import annotations

import statistics
import time

from report import arguments, report

from supervisor.testing.reward_service import RewardService
from workers.rewards import Rewards


def timed(rewards: Rewards, rows: list[dict], completions: list[str], repeats: int) -> float:
    """The median seconds to score the samples, and a check that every reward came back in order."""
    secs = []
    for _ in range(repeats):
        started = time.monotonic()
        got = rewards(rows, completions)
        secs.append(time.monotonic() - started)
        assert got == [float(c == r["answer"]) for r, c in zip(rows, completions)]
    return statistics.median(secs)


def main() -> None:
    parser = arguments(__doc__, "64 samples, concurrency 1 and 16, one repeat", cluster=False)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--latency", type=float, default=0.05, help="seconds the service takes a request")
    parser.add_argument("--concurrency", default="1,4,16,64", help="reward.concurrency of each column")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    levels = [1, 16] if args.quick else [int(n) for n in args.concurrency.split(",")]
    repeats = 1 if args.quick else args.repeats
    rows = [{"prompt": f"{i % 10} {(i * 7) % 10} =", "answer": str(max(i % 10, (i * 7) % 10))}
            for i in range(args.samples)]
    completions = [r["answer"] if i % 3 else "0" for i, r in enumerate(rows)]
    service = RewardService(args.latency)
    runs = {}
    try:
        for n in levels:
            rewards = Rewards(lambda prompt, completion, row: service.score(row["answer"], completion), concurrency=n)
            try:
                service.most = 0
                runs[n] = {"secs": timed(rewards, rows, completions, repeats), "most_in_flight": service.most}
            finally:
                rewards.close()
    finally:
        service.close()
    serial = runs[levels[0]]["secs"]
    rows_out = [("reward.concurrency", *(str(n) for n in runs)),
                ("seconds to score the step's samples", *(f"{r['secs']:.2f} s" for r in runs.values())),
                ("requests in flight at once (most)", *(str(r["most_in_flight"]) for r in runs.values())),
                (f"speed-up over concurrency {levels[0]}", *(f"{serial / r['secs']:.1f}x" for r in runs.values()))]
    print(f"{args.samples} samples, the service taking {args.latency * 1000:.0f} ms a request")
    report(rows_out, {"benchmark": "reward", "samples": args.samples, "latency": args.latency,
                      "runs": {str(n): r for n, r in runs.items()}}, args.json)


if __name__ == "__main__":
    main()
