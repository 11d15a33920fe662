"""``--signature`` with a public key of a kind model_signing's key-based verifier cannot use.

model_signing reads ``key.curve`` of the key unchecked: an RSA key raised ``AttributeError:
'RSA' object has no attribute 'curve'`` from inside it, an EC key on another curve a bare
``ValueError``. Each is now ``ModelSignatureError`` naming the key file, the kinds of key
that are checked (ECDSA on P-256, P-384, P-521) and the fix; no lock is written. The model
is signed for real (an EC key, model_signing's own signing API, as ``test_signature.py``).
"""

from __future__ import annotations

from pathlib import Path

import model_signing
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

import codeferry
from codeferry import cli
from codeferry._code.signature import check_signature
from codeferry.errors import ModelSignatureError
from codeferry.testing import ModelSpec, write_model


def _public_pem(key: object, path: Path) -> Path:
    path.write_bytes(key.public_key().public_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return path


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model signed with a P-256 key, as ``model_signing sign key`` signs it."""
    root = tmp_path_factory.mktemp("signed")
    model = write_model(root / "m", ModelSpec(name="keykinds"))
    private = root / "signer.pem"
    private.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    hashing = model_signing.hashing.Config().set_ignored_paths(paths=["model.sig"])
    model_signing.signing.Config().set_hashing_config(hashing).use_elliptic_key_signer(
        private_key=private).sign(model, model / "model.sig")
    return model


KEYS = {
    "RSA": (lambda: rsa.generate_private_key(65537, 2048), "an RSA key (2048 bits)"),
    "Ed25519": (ed25519.Ed25519PrivateKey.generate, "an Ed25519 key"),
    "EC secp256k1": (lambda: ec.generate_private_key(ec.SECP256K1()),
                     "an EC key on curve secp256k1"),
}


@pytest.mark.parametrize("kind", sorted(KEYS))
def test_a_public_key_of_another_kind_is_a_typed_error(
    tmp_path: Path, signed: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    make, words = KEYS[kind]
    public = _public_pem(make(), tmp_path / "key.pub.pem")
    with pytest.raises(ModelSignatureError) as info:
        check_signature(signed, public)
    err = info.value
    assert err.path == str(public) and err.key and err.key.startswith("sha256:")
    assert words in err.message and "P-256, P-384, P-521" in err.message
    assert err.fix and "EC public key" in err.fix

    lock = tmp_path / "m.lock"
    capsys.readouterr()
    code = cli.main(["lock", str(signed), "--signature", "--public-key", str(public),
                     "-o", str(lock)])
    text = capsys.readouterr().err
    assert code == 1 and text.count("\n") == 1 and "Traceback" not in text
    assert text.startswith(f"codeferry: error: {public}: ") and words in text and "Fix:" in text
    assert not lock.exists()  # nothing written

    # verify against a lock that requires this key: the same error, before any check
    lock.write_text(codeferry.Lock.from_bundle(codeferry.resolve(signed)).dumps())
    code = cli.main(["verify", str(signed), "--lock", str(lock), "--signature",
                     "--public-key", str(public)])
    text = capsys.readouterr().err
    assert code == 1 and text.count("\n") == 1 and words in text
