"""`python -m kvfork.server [options]` is `kvfork serve [options]`."""

import sys

from kvfork.server.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
