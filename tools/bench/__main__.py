import sys

from tools.bench.cli import main

raise SystemExit(main(sys.argv[1:]))
