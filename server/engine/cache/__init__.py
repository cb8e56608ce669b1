"""The cache tiers: one index over memory, disk and named sessions, the disk tier's files and the named sessions'
table.

- index.py: One index of the KV states a new request may start from, in one trie over token blocks
- disk.py: The prefix cache's disk tier: snapshots evicted from memory, kept in files that outlive the process
- sessions.py: Named sessions: a client's conversation kept warm between its requests
"""
