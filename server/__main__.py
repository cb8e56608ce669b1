"""`python -m server [options]` is `kvfork serve [options]`."""

import sys

from server.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
