"""``python -m grserve_bench BENCH [FLAGS]`` = ``grserve bench BENCH [FLAGS]``, also where no install registered the
entry point (a source tree on ``PYTHONPATH``, as scripts/gpu-check.sh runs it)."""

import sys

from grserve.cli import main
from grserve_bench.cli import register

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]], commands={"bench": register}))
