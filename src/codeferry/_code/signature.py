"""OpenSSF model signatures: a repo's ``model.sig``, checked with the ``model-signing``
package against a public key (key-based; the ``signing`` extra).

A signature says who vouches for the whole model folder (every file but the signature and
git's own, weights included), where a lock says what the code is and ``--verify-hub`` where
it came from. A lock may require one (``signature key sha256:<key id>``, ``digest.public_key_id``):
``codeferry verify`` then refuses the model unless its ``model.sig`` verifies with a key of
that id. Checked as ``model_signing``'s own ``verify key`` does, with its default hashing
(``files``, sha256 per file), symlinks followed: a hub snapshot's files link into its
``blobs``. Static: nothing executes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ExtraMissingError, ModelSignatureError
from .digest import public_key_id

__all__ = ["SIGNATURE_FILE", "SignatureCheck", "check_signature", "key_id"]

#: Where a repo carries its signature, as ``model_signing sign`` writes it by default.
SIGNATURE_FILE = "model.sig"


@dataclass(frozen=True)
class SignatureCheck:
    """A signature that verified: its file, and the id of the key it verified with."""

    signature: str
    key: str


def _model_signing() -> Any:
    try:
        import model_signing
    except ImportError as exc:
        raise ExtraMissingError(
            f"checking a model signature needs the model-signing package, which is not "
            f"installed ({exc}).", extra="signing",
            fix="pip install 'codeferry[signing]'") from exc
    return model_signing


def key_id(public_key: str | os.PathLike[str]) -> str:
    """The id of the public key in the PEM file ``public_key`` (``sha256:<hex>``)."""
    _model_signing()  # cryptography comes with it
    path = Path(public_key)
    try:
        pem = path.read_bytes()
        key = public_key_id(pem)
    except OSError as exc:
        raise ModelSignatureError(
            f"public key {path} cannot be read: {exc.strerror or exc}.", path=str(path),
            fix="pass the PEM file of the signer's public key: --public-key KEY.pem.") from None
    except ValueError as exc:
        raise ModelSignatureError(
            f"{path} is not a PEM public key ({exc}).", path=str(path),
            fix="pass the PEM file of the signer's public key (`-----BEGIN PUBLIC KEY-----`).",
        ) from None
    kind = _unsupported_kind(pem)
    if kind is not None:
        raise ModelSignatureError(
            f"the public key is {kind}; model signatures are checked with elliptic-curve keys only "
            f"(ECDSA on {', '.join(_CURVES.values())}, as `model_signing sign key` makes them).",
            path=str(path), key=key,
            fix="pass the signer's EC public key (`openssl ec -in PRIVATE.pem -pubout`); a "
            "model signed another way is checked with model_signing itself (`model_signing "
            "verify sigstore` or `verify certificate`).")
    return key


#: The curves model_signing's key-based signatures use (its ``sign_ec_key``), and their names.
_CURVES = {"secp256r1": "P-256", "secp384r1": "P-384", "secp521r1": "P-521"}


def _unsupported_kind(pem: bytes) -> str | None:
    """What kind of key ``pem`` (a public key that loads) is, when model_signing's key-based
    verifier cannot use it (it reads ``key.curve`` unchecked: an RSA key raised
    ``AttributeError``); ``None``: an EC key on a curve it supports."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, ed25519, rsa

    key = serialization.load_pem_public_key(pem)
    if isinstance(key, ec.EllipticCurvePublicKey):
        return None if key.curve.name in _CURVES else f"an EC key on curve {key.curve.name}"
    if isinstance(key, rsa.RSAPublicKey):
        return f"an RSA key ({key.key_size} bits)"
    if isinstance(key, dsa.DSAPublicKey):
        return f"a DSA key ({key.key_size} bits)"
    kinds = ((ed25519.Ed25519PublicKey, "an Ed25519 key"), (ed448.Ed448PublicKey, "an Ed448 key"))
    return next((name for cls, name in kinds if isinstance(key, cls)),
                f"a {type(key).__name__} key")


def check_signature(root: str | os.PathLike[str], public_key: str | os.PathLike[str] | None,
                    *, required: str | None = None) -> SignatureCheck:
    """Verify ``root``'s ``model.sig`` with ``public_key``; ``required``: the key id a lock
    requires (the key given must be that one). ``ModelSignatureError`` unless it verifies."""
    folder = Path(root)
    signature = folder / SIGNATURE_FILE
    if public_key is None:
        needs = f"the lock requires a signature by key {required}" if required else \
            "a key-based signature is checked with the signer's public key"
        raise ModelSignatureError(
            f"{needs}, and no public key was given.", path=str(signature), key=required,
            fix="pass --public-key KEY.pem (Python: public_key=...); codeferry checks "
            "key-based signatures (a Sigstore one: `model_signing verify sigstore`).")
    key = key_id(public_key)
    if required is not None and key != required:
        raise ModelSignatureError(
            f"the lock requires a signature by key {required}; {public_key} is key {key}.",
            path=str(public_key), signature=str(signature), key=key,
            fix="pass the public key the lock names, or review the new signer and re-lock "
            "with its key: `codeferry lock MODEL --signature --public-key KEY.pem -o FILE`.")
    if not signature.is_file():
        raise ModelSignatureError(
            f"{folder} carries no signature ({SIGNATURE_FILE})"
            + (f", and the lock requires one by key {required}." if required else "."),
            path=str(signature), key=key,
            fix="ask the model's publisher for its signature (`model_signing sign key "
            f"MODEL --private-key KEY --signature MODEL/{SIGNATURE_FILE}`), or drop --signature.")
    ms = _model_signing()
    hashing = ms.hashing.Config().set_ignored_paths(paths=[SIGNATURE_FILE]).set_allow_symlinks(True)
    config = ms.verifying.Config().use_elliptic_key_verifier(public_key=Path(public_key))
    try:
        config.set_hashing_config(hashing).verify(folder, signature)
    except Exception as exc:  # model_signing raises ValueError, and its libraries' own errors
        raise ModelSignatureError(
            f"{SIGNATURE_FILE} of {folder} does not verify with key {key}: {_why(exc)}",
            path=str(signature), signature=str(signature), key=key,
            fix="do not run this model: its files (or its signature) are not what the key's "
            "owner signed. A hub snapshot fetched for its code only lacks the weights the "
            "signature covers: download the whole repo first (`hf download REPO`).") from exc
    return SignatureCheck(str(signature), key)


def _why(exc: Exception) -> str:
    """model_signing's reason, short: the files that differ (its message spells each digest
    out as Python bytes), else its first 300 characters."""
    text = " ".join(str(exc).split())
    changed = re.findall(r"Hash mismatch for '([^']+)'", text)
    parts = [f"changed {', '.join(changed)}"] if changed else []
    for kind, what in (("Missing files", "missing"), ("Extra files found", "not signed")):
        found = re.search(kind + r" in model '[^']*': ([^\]\"]+?)(?:['\"],|['\"]\])", text)
        if found:
            parts.append(f"{what} {found[1]}")
    return "; ".join(parts) if parts else text[:300] + ("..." if len(text) > 300 else "")
