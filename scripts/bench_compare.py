"""What one answer comparison costs (server/compare/, shared by the shadow and replay): time per
pair for answer shapes a model server sees, beside what ``json.loads`` of both bodies costs
(the floor for any comparison of parsed JSON). Medians of --rounds rounds.

    python scripts/bench_compare.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import timeit

from server.compare import Answer, CompareOptions, compare


def shapes() -> list[tuple[str, Answer, Answer, int]]:
    rng = random.Random(0)

    def js(value: object) -> Answer:
        return Answer(200, json.dumps(value).encode(), "application/json")

    small = {"predictions": [{"label": "cat", "score": 0.91}, {"label": "dog", "score": 0.09}]}
    moved = {"predictions": [{"label": "cat", "score": 0.9100001}, {"label": "dog", "score": 0.09}]}
    labels = {f"class_{i}": rng.random() for i in range(1000)}
    vector = [rng.random() for _ in range(10_000)]
    return [
        ("identical bytes (small JSON)", js(small), js(small), 20_000),
        ("small JSON, one score moved", js(small), js(moved), 5_000),
        ("1000-label dict, top_k=5", js(labels),
         js({k: v * 1.0001 for k, v in labels.items()}), 50),
        ("10000-float list", js({"embedding": vector}),
         js({"embedding": [x + 1e-7 for x in vector]}), 20),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    options = CompareOptions(abs_tol=1e-4, top_k=5)
    print(f"{'answer pair':<30} {'compare us':>11} {'json.loads x2 us':>17}")
    for name, a, b, n in shapes():
        runs = [_per_call(functools.partial(compare, a, b, options), n) for _ in range(args.rounds)]
        loads = functools.partial(_parse_both, a, b)
        parse = [_per_call(loads, n) for _ in range(args.rounds)]
        print(f"{name:<30} {statistics.median(runs) * 1e6:11.1f}"
              f" {statistics.median(parse) * 1e6:17.1f}")  # fmt: skip


def _per_call(call: object, n: int) -> float:
    return timeit.timeit(call, number=n) / n  # type: ignore[arg-type]


def _parse_both(a: Answer, b: Answer) -> None:
    json.loads(a.body)
    json.loads(b.body)


if __name__ == "__main__":
    main()
