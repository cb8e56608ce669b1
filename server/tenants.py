"""Tenants: who a request is, by the API key that authenticated it.

A daemon without keys has one tenant, "" (api.Scope's default): every request
shares that one scope. With keys, each key belongs to a tenant:
a `--api-key` key is a tenant of its own, named by the key; an `--api-keys-file`
line `KEY TENANT` names it, and several keys may share a tenant (a rotation).
The engine scopes every reuse by the tenant (server/engine/api.py, Scope); the
name never reaches /metrics, and logs carry only Scope.tenant_hash.
"""

from __future__ import annotations

import hmac
from pathlib import Path

def read_keys_file(path: str) -> dict[str, str]:
    """`KEY TENANT` per line (blank lines and `#` comments skipped); ValueError names the bad line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ValueError(f"{path} line {number}: expected 'KEY TENANT', got {len(fields)} fields")
        key, tenant = fields
        if keys.get(key, tenant) != tenant:
            raise ValueError(f"{path} line {number}: the key is given twice, to two tenants")
        keys[key] = tenant
    if not keys:
        raise ValueError(f"{path} holds no keys")
    return keys


def key_tenants(api_keys: list[str], keys_file: str | None) -> dict[str, str]:
    """Every accepted key and its tenant; empty: no authentication, one tenant."""
    keys = {key: key for key in api_keys}
    for key, tenant in (read_keys_file(keys_file) if keys_file else {}).items():
        if keys.get(key, tenant) != tenant:
            raise ValueError("a key given by --api-key is also in --api-keys-file, under a tenant name")
        keys[key] = tenant
    return keys


def key_tenant(keys: dict[str, str], given: str) -> str | None:
    """The tenant `given` authenticates, or None. Compares against every key in constant time."""
    found = None
    for key, tenant in keys.items():
        if hmac.compare_digest(given.encode(), key.encode()):
            found = tenant
    return found
