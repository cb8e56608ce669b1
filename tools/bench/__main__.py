import sys

from kvfork.tools.bench.cli import main

raise SystemExit(main(sys.argv[1:]))
