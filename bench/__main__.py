"""`make bench`: every suite in one run, systems alternating (A B C A B C ...), medians.

    python -m bench [--quick]
                    [--only consume,enqueue,host,planner,simulator,simreal,memory,latency,async,
                           shards,fleet,retention]
                    [--repeat N] [--jobs N] [--peer-jobs N] [--no-peers] [--render]

The peers (Celery, Dramatiq, RQ, arq) are installed on first use into bench/.peers/<name>.

Writes bench/results/latest.json and bench/results/latest.md. The arguments are read
before anything starts: ``--help`` and a mistyped suite answer at once, not after the
private brokers (bench/run_all.py) are up.
"""

from __future__ import annotations

import argparse

SUITES = ("consume", "enqueue", "host", "planner", "simulator", "simreal", "memory", "latency",
          "async", "shards", "fleet", "retention")

def main() -> None:
    args = parse_args()
    from bench import run_all  # starts the private brokers

    run_all.main(args)

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--quick", action="store_true", help="small counts, one round")
    parser.add_argument("--only", default=",".join(SUITES), type=_suite_list,
                        help="comma-separated suites, run in the order given")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--jobs", type=int, default=None,
                        help="jobs pre-enqueued for qcluster and kombu (50,000)")
    parser.add_argument("--peer-jobs", type=int, default=None,
                        help="jobs pre-enqueued for each peer (20,000)")
    parser.add_argument("--no-peers", action="store_true",
                        help="skip Celery, Dramatiq, RQ and arq")
    parser.add_argument("--render", action="store_true",
                        help="only rewrite latest.md (and the targets) from latest.json")
    return parser.parse_args(argv)

def _suite_list(text: str) -> str:
    unknown = [name for name in text.split(",") if name not in SUITES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown suite {', '.join(unknown)}; choose from {', '.join(SUITES)}")
    return text

if __name__ == "__main__":
    main()
