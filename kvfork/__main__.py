"""`python -m kvfork ...` is the `kvfork` command."""

import sys

from kvfork.server.cli import main

sys.exit(main())
