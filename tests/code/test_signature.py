"""OpenSSF model signatures: ``--signature`` checks a repo's ``model.sig`` with the real
``model-signing`` package, and a lock may require one (format version 2).

Each signature is made here, with an EC key made here and model_signing's own signing API,
on a plain folder and on a hub snapshot (whose files are links into its blobs).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import model_signing
import pytest
from _helpers import ROOT
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

import codeferry
from codeferry import cli
from codeferry._code.digest import public_key_id
from codeferry.errors import LockFormatError, ModelSignatureError
from codeferry.testing import ModelSpec, write_hub_model, write_model

REPO = "acme/signy"


def _key(folder: Path, name: str) -> tuple[Path, Path]:
    """A fresh EC key pair as PEM files: (private, public)."""
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = folder / f"{name}.pem", folder / f"{name}.pub.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def _sign(model: Path, private: Path) -> Path:
    """Sign ``model`` as ``model_signing sign key`` does (the signature left out of itself)."""
    hashing = model_signing.hashing.Config().set_ignored_paths(paths=["model.sig"])
    hashing.set_allow_symlinks(True)  # a hub snapshot: its files link into its blobs
    model_signing.signing.Config().set_hashing_config(hashing).use_elliptic_key_signer(
        private_key=private).sign(model, model / "model.sig")
    return model / "model.sig"


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    folder = tmp_path_factory.mktemp("keys")
    return {name: _key(folder, name) for name in ("signer", "other")}


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_lock_requires_the_signature_and_verify_checks_it(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    model = write_model(tmp_path / "m", ModelSpec(name="signy"))
    private, public = keys["signer"]
    _sign(model, private)
    lock = tmp_path / "m.lock"
    code, _, err = _cli(capsys, "lock", str(model), "--signature", "--public-key", str(public),
                        "-o", str(lock))
    assert code == 0, err
    key = public_key_id(public.read_bytes())
    text = lock.read_text()
    assert "\ncodeferry-lock 2\n" in text and f"\nsignature key {key}\n" in text
    assert f"verifies with key {key}" in err

    code, out, err = _cli(capsys, "verify", str(model), "--lock", str(lock), "--public-key",
                          str(public))
    assert code == 0, err
    assert f"signature: {model / 'model.sig'} verifies with key {key}" in out

    # the lock requires it: verify without the key, or with another, refuses
    code, _, err = _cli(capsys, "verify", str(model), "--lock", str(lock))
    assert code == 1 and f"the lock requires a signature by key {key}" in err
    other = keys["other"][1]
    code, _, err = _cli(capsys, "verify", str(model), "--lock", str(lock), "--public-key",
                        str(other))
    assert code == 1
    assert f"is key {public_key_id(other.read_bytes())}" in err

    # a signature covers every file, not only the code: changed weights are refused
    weights = next(model.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    code, _, err = _cli(capsys, "verify", str(model), "--lock", str(lock), "--public-key",
                        str(public))
    assert code == 1
    assert "does not verify with key" in err and weights.name in err
    with pytest.raises(ModelSignatureError) as caught:
        codeferry.read_lock(lock).check_signature(codeferry.resolve(model), public)
    assert caught.value.key == key and caught.value.signature == str(model / "model.sig")


def test_a_hub_snapshot_signature_checks_through_its_links(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    snapshot = write_hub_model(tmp_path / "hub", REPO, ModelSpec(name="signy"))
    private, public = keys["signer"]
    _sign(snapshot, private)
    lock = tmp_path / "plain.lock"
    args = ("--cache-dir", str(tmp_path / "hub"))
    assert _cli(capsys, "lock", REPO, *args, "-o", str(lock))[0] == 0
    assert "\ncodeferry-lock 1\n" in lock.read_text()  # no signature required: version 1
    code, out, err = _cli(capsys, "verify", REPO, *args, "--lock", str(lock), "--signature",
                          "--public-key", str(public))
    assert code == 0, err
    assert "verifies with key" in out
    check = codeferry.read_lock(lock).check_signature(
        codeferry.resolve(REPO, cache_dir=tmp_path / "hub"), public)
    assert check.key == public_key_id(public.read_bytes())

    config = snapshot / "config.json"
    blob = config.resolve()
    blob.chmod(0o644)
    blob.write_bytes(blob.read_bytes().replace(b"{", b"{ ", 1))
    code, _, err = _cli(capsys, "verify", REPO, *args, "--lock", str(lock), "--signature",
                        "--public-key", str(public))
    assert code == 1 and "config.json" in err and "does not verify" in err


def test_a_model_without_a_signature_or_a_key(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    model = write_model(tmp_path / "m", ModelSpec(name="unsigned"))
    code, _, err = _cli(capsys, "lock", str(model), "--signature", "--public-key",
                        str(keys["signer"][1]), "-o", str(tmp_path / "x.lock"))
    assert code == 1 and "carries no signature (model.sig)" in err
    assert not (tmp_path / "x.lock").exists()
    code, _, err = _cli(capsys, "lock", str(model), "--signature")
    assert code == 1 and "no public key was given" in err and "--public-key KEY.pem" in err
    not_a_key = tmp_path / "nokey.pem"
    not_a_key.write_text("hello\n")
    code, _, err = _cli(capsys, "lock", str(model), "--signature", "--public-key", str(not_a_key))
    assert code == 1 and "is not a PEM public key" in err


def test_the_signature_record_is_version_2_only(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", ModelSpec(name="fmt"))
    text = codeferry.Lock.from_bundle(codeferry.resolve(model)).dumps()
    key = "sha256:" + "c" * 64
    signed = text.replace("codeferry-lock 1", "codeferry-lock 2").replace(
        "\nfile ", f"\nsignature key {key}\nfile ", 1)
    lock = codeferry.Lock.loads(signed)
    assert lock.signature == key and lock.dumps() == signed
    with pytest.raises(LockFormatError, match="malformed line: 'signature key"):
        codeferry.Lock.loads(signed.replace("codeferry-lock 2", "codeferry-lock 1"))
    with pytest.raises(LockFormatError, match="version 2 without a 'signature' line"):
        codeferry.Lock.loads(text.replace("codeferry-lock 1", "codeferry-lock 2"))
    with pytest.raises(LockFormatError, match="malformed line"):
        codeferry.Lock.loads(signed.replace(f"signature key {key}", "signature key main"))
    with pytest.raises(LockFormatError, match="format version '3'"):
        codeferry.Lock.loads(signed.replace("codeferry-lock 2", "codeferry-lock 3"))


def test_without_the_package_signature_fails_typed_with_the_install_command(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]]
) -> None:
    model = write_model(tmp_path / "m", ModelSpec(name="nopkg"))
    script = ("import sys; sys.modules['model_signing'] = None\n"  # as if not installed
              "from codeferry.cli import main\n"
              f"sys.exit(main(['verify', {str(model)!r}, '--lock', {str(tmp_path / 'm.lock')!r}, "
              f"'--signature', '--public-key', {str(keys['signer'][1])!r}]))\n")
    assert cli.main(["lock", str(model), "-o", str(tmp_path / "m.lock")]) == 0
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1",
                                            "PATH": "/usr/bin:/bin"})
    assert done.returncode == 1, done.stderr
    assert "needs the model-signing package" in done.stderr
    assert "pip install 'codeferry[signing]'" in done.stderr
    assert "Traceback" not in done.stderr
