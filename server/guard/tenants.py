"""Tenants: who a request is, by the API key that authenticated it.

A daemon without keys has one tenant, "" (api.Scope's default): every request
shares that one scope. With keys, each key belongs to a tenant:
an `--api-keys-file` line `KEY TENANT` names it, and several keys may share a
tenant (a rotation); each `--api-key` is a tenant of its own, named `key-1`,
`key-2` ... in the order given, never by the key. The two kinds of names live in
namespaces of their own (`api_key_tenant`): a keys-file tenant called `key-1` is
another tenant. The engine scopes every reuse by the tenant (server/engine/api.py,
Scope); the name never reaches /metrics, and logs carry only Scope.tenant_hash.

A key is read from `Authorization: Bearer KEY` (the scheme in any case, RFC 7235)
or `x-api-key`; a header that is not UTF-8 text matches no key.
"""

from __future__ import annotations

import hashlib
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


def api_key_tenant(index: int) -> str:
    """The tenant of the `index`-th --api-key (from 1): `key-1` ..., in a namespace of its own. Keys-file
    tenant names hold no whitespace (the file's fields are split on it), so one never equals this."""
    return f"key-{index} (--api-key)"


def key_tenants(api_keys: list[str], keys_file: str | None) -> dict[str, str]:
    """Every accepted key and its tenant; empty: no authentication, one tenant."""
    keys: dict[str, str] = {}
    for key in api_keys:
        keys.setdefault(key, api_key_tenant(len(keys) + 1))
    for key, tenant in (read_keys_file(keys_file) if keys_file else {}).items():
        if key in keys and keys[key] != tenant:
            raise ValueError("a key given by --api-key is also in --api-keys-file, under a tenant name")
        keys[key] = tenant
    return keys


def request_key(authorization: str | None, x_api_key: str | None) -> str:
    """The key a request presents: `Authorization: Bearer KEY` (any case of the scheme), else x-api-key."""
    scheme, _, value = (authorization or "").strip().partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return x_api_key or ""


class KeyTable:
    """The accepted keys, by their SHA-256: a presented key is hashed once and its digest's first bytes find
    the one candidate in a dict, so the cost is the same for 1 key or 100,000 (a loop over them cost the
    event loop milliseconds per request, a keyless 401 too); the candidate's whole digest is then compared
    with hmac.compare_digest. Lookup time tells nothing of a key: steering it needs SHA-256 preimages."""

    def __init__(self, keys: dict[str, str]):
        self._by_prefix: dict[bytes, tuple[bytes, str]] = {}
        for key, tenant in keys.items():
            digest = _digest(key.encode())
            if digest[:_PREFIX] in self._by_prefix:  # 2**-64 for two keys: say so rather than drop one
                raise ValueError("two API keys share the first bytes of their SHA-256; replace one")
            self._by_prefix[digest[:_PREFIX]] = (digest, tenant)

    def __len__(self) -> int:
        return len(self._by_prefix)

    def tenant(self, given: str) -> str | None:
        """The tenant `given` authenticates, or None; a key that is not UTF-8 text (aiohttp hands such header
        bytes over as surrogates) matches none."""
        try:
            presented = given.encode()
        except UnicodeEncodeError:
            return None
        digest = _digest(presented)
        stored, tenant = self._by_prefix.get(digest[:_PREFIX], (b"", ""))
        return tenant if presented and hmac.compare_digest(digest, stored) else None


_PREFIX = 8


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()
