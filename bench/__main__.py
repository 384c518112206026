"""`make bench` / `python -m bench`: run the benchmarks that exist so far, one after another.

Each benchmark is a standalone script under bench/ that reports ratios against a baseline run in
the same process (medians of repeats). Issue 8 adds the end-to-end, weight-sync, buffer and
scaling benchmarks and the results files.
"""

import runpy
import sys
from pathlib import Path

BENCHMARKS = ["bench_rollout_wrapper.py"]

if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    for name in BENCHMARKS:
        print(f"== {name}", flush=True)
        sys.argv = [name]
        runpy.run_path(str(here / name), run_name="__main__")
