"""`kvfork cache ls` / `kvfork cache clear`: show and empty the prefix cache's disk tier
($KVFORK_HOME/kv). A folder a running daemon holds (its lock) is shown as in use and never cleared."""

from __future__ import annotations

import argparse

from kvfork.server.engine.cache.disk import clear, describe, kv_root


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvfork cache", description=__doc__)
    parser.add_argument("action", choices=("ls", "clear"), help="ls: show each model's entries; clear: remove them")
    args = parser.parse_args(argv)
    root = kv_root()
    if args.action == "ls":
        folders = describe(root)
        print(f"{root}: {len(folders)} model fingerprint(s)")
        for f in folders:
            use = "  (in use by a running daemon)" if f["in_use"] else ""
            print(f"  {f['fingerprint']}  {f['entries']} entries  {f['bytes'] / 2**20:.1f} MiB{use}")
        return 0
    try:
        removed, skipped = clear(root)
    except OSError as exc:
        print(f"kvfork cache clear: {exc}")
        return 1
    print(f"removed {removed} entries from {root}")
    for name in skipped:
        print(f"  kept {name}: a running daemon holds it (stop it first)")
    return 0
