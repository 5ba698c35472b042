"""Who belongs to a sequence-parallel group: every rank holds the group's secret, and proves it before anything it
sends is used.

The rendezvous store (torch.distributed's ``TCPStore``) and the control port accept anyone who can reach them (the
store lets any client list, read, write and delete its keys), so nothing read from them is trusted beyond what the
secret proves:

* every group has its own key, ``group_key(secret, group_id)`` (scrypt, salted with the group's random id): from a
  fresh random secret for a group whose ranks are all on this machine (handed to the local workers through a pipe
  from their parent, never the command line or the store), or, when ranks on other machines join, from the secret
  the user set on every machine (``OMNIHOOKS_SP_SECRET``, or a file named by ``OMNIHOOKS_SP_SECRET_FILE``; README),
  which must hold at least ``MIN_SECRET_BITS`` of entropy (``secret_bits``);
* the one record rank 0 writes to the store (the group) is signed (``seal``); a reader checks the signature
  (``unseal``) and ignores what fails it. Anyone who reads the store can test a guess of the secret against that
  signature offline, one scrypt per guess: the secret's entropy is what makes that hopeless;
* a control connection starts with a challenge-response (``hmac`` over both sides' random nonces): rank 0 uses no
  byte of a connection before the worker proved it holds the key, and the worker uses none before rank 0 did.

Nothing here imports ComfyUI.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import secrets
import string
from pathlib import Path
from typing import Any

from .plain import PlainDataError, bounded_json

SECRET_ENV = "OMNIHOOKS_SP_SECRET"
SECRET_FILE_ENV = "OMNIHOOKS_SP_SECRET_FILE"
#: the least entropy a secret from the user must have (``secret_bits``): 32 random hexadecimal characters
MIN_SECRET_BITS = 128
#: how a secret is made (it prints 64 random hexadecimal characters: 256 bits)
NEW_SECRET_COMMAND = "python <ComfyUI-OmniHooks folder>/nodes/sequence_parallel/worker.py --new-secret"
NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
#: scrypt's cost: about 16 MiB of memory and tens of milliseconds per key, once per group on each rank, and as much
#: for every guess of the secret tested against the group's signed record
_SCRYPT = {"n": 1 << 14, "r": 8, "p": 1}
#: the largest signed record read from the store, and how deeply its JSON may nest
RECORD_BYTES = 1 << 16
RECORD_DEPTH = 8
#: a run of this many characters that repeat the one before or step by one from it ("aaaaaa", "123456", "fedcba"),
#: or a stretch this long that occurred earlier in the secret, adds nothing to its entropy after its first character
_PATTERN_CHARS = 6
#: ``secret_bits`` reads this many characters at most (more cannot lower its estimate)
_ESTIMATED_CHARS = 1024


class TrustError(ValueError):
    """A secret that is missing or too weak, a secret file others can read, or data that failed its signature."""


def new_secret() -> bytes:
    """A random secret for a group of local ranks."""
    return secrets.token_bytes(32)


def secret_bits(text: str) -> float:
    """An estimate of ``text``'s entropy in bits, as if each of its characters were drawn at random from the smallest
    usual alphabet holding them all (hexadecimal: 16, else the union of digits 10, lower case 26, upper case 26, and
    33 for anything else), counting nothing for a character that continues a pattern (``_PATTERN_CHARS`` repeated
    or consecutive characters, or a stretch that occurred before). It cannot recognise words: a chosen phrase scores
    as if it were random, so secrets are generated (``NEW_SECRET_COMMAND``), not chosen."""
    text = text[:_ESTIMATED_CHARS]
    if not text:
        return 0.0
    if all(c in string.hexdigits for c in text):
        alphabet = 16
    else:
        classes = (string.digits, string.ascii_lowercase, string.ascii_uppercase)
        alphabet = sum(len(chars) for chars in classes if any(c in chars for c in text))
        alphabet += 33 if any(not any(c in chars for chars in classes) for c in text) else 0
    counted, i, n = 0, 0, len(text)
    while i < n:
        repeat = _PATTERN_CHARS
        while i + repeat <= n and text.find(text[i:i + repeat], 0, i + repeat - 1) != -1:
            repeat += 1
        if repeat > _PATTERN_CHARS:  # text[i:i + repeat - 1] occurred earlier: adds nothing
            i += repeat - 1
            continue
        run = text[max(0, i - _PATTERN_CHARS + 1):i + 1]
        steps = {ord(b) - ord(a) for a, b in zip(run, run[1:])}
        if not (len(run) == _PATTERN_CHARS and len(steps) == 1 and steps <= {-1, 0, 1}):
            counted += 1
        i += 1
    return counted * math.log2(alphabet)


def check_secret(text: str, where: str) -> None:
    """TrustError naming the rule when ``text`` (the secret read from ``where``) has less than ``MIN_SECRET_BITS``."""
    bits = secret_bits(text)
    if bits < MIN_SECRET_BITS:
        raise TrustError(
            f"Sequence Parallel: the group secret in {where} is too weak: about {bits:.0f} bits of entropy, and the "
            f"rule is at least {MIN_SECRET_BITS} bits (e.g. 32 or more random hexadecimal characters; repeats, runs "
            f"and sequences count nothing). Generate one with: {NEW_SECRET_COMMAND} (or python -c \"import secrets; "
            "print(secrets.token_hex(32))\") and set it on every machine")


def check_secret_file(path: Path, where: str) -> None:
    """TrustError when the secret file ``path`` can be read or written by anyone but its owner (POSIX modes)."""
    if os.name != "posix":
        return
    mode = path.stat().st_mode
    if mode & 0o077:
        raise TrustError(f"Sequence Parallel: the group secret in {where} can be read or written by others than its "
                         f"owner (mode {mode & 0o777:04o}); the rule is: readable by its owner only. Run: chmod 600 "
                         f"{path}")


def user_secret(environ: dict | None = None) -> bytes | None:
    """The secret the user set for groups with ranks on other machines: ``OMNIHOOKS_SP_SECRET``, else the content of
    the file ``OMNIHOOKS_SP_SECRET_FILE`` names (surrounding whitespace stripped; the file readable by its owner only);
    None when neither is set. TrustError when it cannot be read or is too weak (``check_secret``)."""
    environ = os.environ if environ is None else environ
    text = environ.get(SECRET_ENV)
    where = SECRET_ENV
    if text is None and environ.get(SECRET_FILE_ENV):
        path = Path(environ[SECRET_FILE_ENV]).expanduser()
        where = f"the file {path} ({SECRET_FILE_ENV})"
        try:
            check_secret_file(path, where)
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TrustError(f"Sequence Parallel: cannot read the group secret from {where}: {exc}") from None
    if text is None:
        return None
    text = text.strip()
    check_secret(text, where)
    return text.encode()


def group_key(secret: bytes, group_id: str) -> bytes:
    """The key of group ``group_id``: each group's own, even where the user's secret stays the same; scrypt of the
    secret salted with the group's id, so that each guess of the secret costs as much to test."""
    return hashlib.scrypt(secret, salt=b"omnihooks-sp group " + group_id.encode(), dklen=32, **_SCRYPT)


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
    """``seal``'s outer fields, not checked yet. TrustError when ``data`` is not sealed JSON (at most
    ``RECORD_BYTES``, nested at most ``RECORD_DEPTH`` deep)."""
    try:
        outer = bounded_json(data, RECORD_BYTES, RECORD_DEPTH, "a record in the store")
    except PlainDataError as exc:
        raise TrustError(f"not signed data of this pack ({exc})") from None
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
    try:
        body = bounded_json(outer["body"].encode(), RECORD_BYTES, RECORD_DEPTH, "a signed record's body")
    except PlainDataError as exc:
        raise TrustError(str(exc)) from None
    if not isinstance(body, dict):
        raise TrustError("not signed data of this pack")
    return body
