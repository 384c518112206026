"""Tool sandbox: the per-call cost of the namespace boundary against the in-process guard alone.

One call is what the Python tool does for one code block: start an interpreter, run
``print(4821 * 937)``, collect the output, kill everything. Cases (medians of ``--calls`` calls
per repeat, ``--repeats`` repeats):

- ``guard``: ``run_python(..., sandbox="guard")``, a fresh interpreter behind the prelude only
  (the sandbox before namespaces; the baseline);
- ``bwrap``: ``run_python(...)``, the default: the same interpreter inside bubblewrap's
  namespaces;
- ``bwrap persistent``: one block in an already running ``PythonSession`` (``tools.python.persistent``);
- ``function pool``: one call of a user tool function in a warm worker process.

The figure the tool issue asks for is ``bwrap - guard`` per call, in milliseconds.

    python -m bench bench_sandbox [--quick]
"""

from __future__ import annotations

import argparse
import time

from bench.common import Result, median, summary, wait_for_quiet

CODE = "print(4821 * 937)\n"


def _time_calls(fn, calls: int) -> float:
    """Median seconds of ``calls`` calls of ``fn``."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--calls", type=int, default=None, help="calls per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    calls = args.calls or (5 if args.quick else 50)
    from rlpost.envs.function_pool import FunctionPool
    from rlpost.envs.tools import PythonSession, run_python

    result = Result("sandbox", args.quick, {"calls_per_repeat": calls, "repeats": args.repeats, "code": CODE})
    wait_for_quiet(args.quick)
    session = PythonSession()
    pool = FunctionPool()
    cases = {
        "guard (s/call)": lambda: run_python(CODE, sandbox="guard"),
        "bwrap (s/call)": lambda: run_python(CODE, sandbox="bwrap"),
        "bwrap persistent (s/block)": lambda: session.run(CODE),
        "function pool (s/call)": lambda: pool.call("operator:mul", (4821, 937), timeout_s=10),
    }
    for fn in cases.values():  # warm-up: caches, the session's and the worker's start
        assert fn() is not None
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():  # interleaved, so drift on the machine hits every case alike
            samples[name].append(_time_calls(fn, calls))
    session.close()
    pool.close()
    for name, values in samples.items():
        result.cases[name] = summary(values)
        print(f"  {name}: {median(values) * 1e3:.1f} ms", flush=True)
    guard, bwrap = median(samples["guard (s/call)"]), median(samples["bwrap (s/call)"])
    result.ratios["bwrap overhead over guard (ms/call)"] = round((bwrap - guard) * 1e3, 1)
    result.ratios["bwrap / guard"] = round(bwrap / guard, 2)
    result.write()


if __name__ == "__main__":
    main()
