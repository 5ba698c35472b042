"""Who belongs to a sequence-parallel group: every rank holds the group's secret, and proves it before anything it
sends is used.

The rendezvous store (torch.distributed's ``TCPStore``) and the control port accept anyone who can reach them, so
nothing read from them is trusted beyond what the secret proves:

* every group has its own key, ``group_key(secret, group_id)``: a fresh random secret for a group whose ranks are all
  on this machine (handed to the local workers through a pipe from their parent, never the command line or the
  store), or, when ranks on other machines join, the secret the user set on every machine
  (``OMNIHOOKS_SP_SECRET``, or a file named by ``OMNIHOOKS_SP_SECRET_FILE``; README), with the group's random id;
* what a rank writes to the store is signed (``seal``); a reader checks the signature (``unseal``) and ignores or
  refuses what fails it;
* a control connection starts with a challenge-response (``hmac`` over both sides' random nonces): rank 0 uses no
  byte of a connection before the worker proved it holds the key, and the worker uses none before rank 0 did.

Nothing here imports ComfyUI.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Any

SECRET_ENV = "OMNIHOOKS_SP_SECRET"
SECRET_FILE_ENV = "OMNIHOOKS_SP_SECRET_FILE"
#: the shortest secret accepted from the user
MIN_SECRET_CHARS = 16
NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size


class TrustError(ValueError):
    """A secret that is missing or too short, or data that failed its signature."""


def new_secret() -> bytes:
    """A random secret for a group of local ranks."""
    return secrets.token_bytes(32)


def user_secret(environ: dict | None = None) -> bytes | None:
    """The secret the user set for groups with ranks on other machines: ``OMNIHOOKS_SP_SECRET``, else the content of
    the file ``OMNIHOOKS_SP_SECRET_FILE`` names (surrounding whitespace stripped); None when neither is set."""
    environ = os.environ if environ is None else environ
    text = environ.get(SECRET_ENV)
    where = SECRET_ENV
    if text is None and environ.get(SECRET_FILE_ENV):
        where = f"the file {environ[SECRET_FILE_ENV]} ({SECRET_FILE_ENV})"
        try:
            text = Path(environ[SECRET_FILE_ENV]).expanduser().read_text(encoding="utf-8")
        except OSError as exc:
            raise TrustError(f"Sequence Parallel: cannot read the group secret from {where}: {exc}") from None
    if text is None:
        return None
    text = text.strip()
    if len(text) < MIN_SECRET_CHARS:
        raise TrustError(f"Sequence Parallel: the group secret in {where} has {len(text)} characters; use at least "
                         f"{MIN_SECRET_CHARS} (e.g. the output of: python -c \"import secrets; "
                         "print(secrets.token_hex(32))\"), the same on every machine")
    return text.encode()


def group_key(secret: bytes, group_id: str) -> bytes:
    """The key of group ``group_id``: each group's own, even where the user's secret stays the same."""
    return hmac.new(secret, b"omnihooks-sp group " + group_id.encode(), hashlib.sha256).digest()


def mac(key: bytes, purpose: str, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts`` for ``purpose`` (a proof for one purpose is no proof for another)."""
    digest = hmac.new(key, purpose.encode() + b"\0", hashlib.sha256)
    for part in parts:
        digest.update(len(part).to_bytes(8, "little") + part)
    return digest.digest()


def proves(key: bytes, purpose: str, proof: bytes, *parts: bytes) -> bool:
    return hmac.compare_digest(mac(key, purpose, *parts), bytes(proof))


def seal(key: bytes, purpose: str, body: dict, **clear: Any) -> bytes:
    """``body`` as signed JSON for the store; ``clear``: fields a reader needs before it can check (the group id)."""
    text = json.dumps(body, sort_keys=True)
    return json.dumps({**clear, "body": text, "mac": mac(key, purpose, text.encode()).hex()}).encode()


def opened(data: bytes) -> dict:
    """``seal``'s outer fields, not checked yet. TrustError when ``data`` is not sealed JSON."""
    try:
        outer = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise TrustError("not signed data of this pack") from None
    if not isinstance(outer, dict) or not isinstance(outer.get("body"), str) or not isinstance(outer.get("mac"), str):
        raise TrustError("not signed data of this pack")
    return outer


def unseal(key: bytes, purpose: str, data: bytes) -> dict:
    """The body ``seal`` signed with ``key`` for ``purpose``; TrustError when the signature fails."""
    outer = opened(data)
    try:
        proof = bytes.fromhex(outer["mac"])
    except ValueError:
        proof = b""
    if not proves(key, purpose, proof, outer["body"].encode()):
        raise TrustError("its signature does not match this group's secret")
    body = json.loads(outer["body"])
    if not isinstance(body, dict):
        raise TrustError("not signed data of this pack")
    return body
