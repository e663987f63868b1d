"""known_hosts lookups and atomic additions, in the forms OpenSSH itself writes."""
from __future__ import annotations

import base64
import subprocess
import threading

import pytest

from hgcli.remote import known_hosts as kh
from hgcli.remote.known_hosts import HostKey, Verdict

KEY_A = HostKey("ssh-ed25519", b"\x00\x00\x00\x0bssh-ed25519" + b"A" * 36)
KEY_B = HostKey("ssh-ed25519", b"\x00\x00\x00\x0bssh-ed25519" + b"B" * 36)
KEY_RSA = HostKey("ssh-rsa", b"\x00\x00\x00\x07ssh-rsa" + b"R" * 40)


def line(names: str, key: HostKey) -> str:
    return f"{names} {key.key_type} {base64.b64encode(key.blob).decode()}\n"


def test_host_name_form():
    assert kh.host_name("10.0.0.1", 22) == "10.0.0.1"
    assert kh.host_name("10.0.0.1", 2222) == "[10.0.0.1]:2222"


def test_verdicts(tmp_path):
    path = tmp_path / "known_hosts"
    assert kh.check(path, "h", KEY_A).verdict is Verdict.UNKNOWN        # no file at all
    path.write_text("# comment\n\n" + line("h,other", KEY_A))
    assert kh.check(path, "h", KEY_A).verdict is Verdict.KNOWN
    assert kh.check(path, "other", KEY_A).verdict is Verdict.KNOWN
    changed = kh.check(path, "h", KEY_B)
    assert changed.verdict is Verdict.CHANGED and changed.known == (KEY_A,)
    # A server offering another key type than the one on file is not "new": it is refused too.
    assert kh.check(path, "h", KEY_RSA).verdict is Verdict.CHANGED
    assert kh.check(path, "[h]:2222", KEY_A).verdict is Verdict.UNKNOWN


def test_patterns_and_negation(tmp_path):
    path = tmp_path / "known_hosts"
    path.write_text(line("*.lab,!bad.lab", KEY_A) + line("[10.0.0.?]:2222", KEY_B))
    assert kh.check(path, "gpu1.lab", KEY_A).verdict is Verdict.KNOWN
    assert kh.check(path, "bad.lab", KEY_A).verdict is Verdict.UNKNOWN
    assert kh.check(path, "[10.0.0.7]:2222", KEY_B).verdict is Verdict.KNOWN
    assert kh.check(path, "[10.0.0.17]:2222", KEY_B).verdict is Verdict.UNKNOWN


def test_revoked_and_cert_authority_lines(tmp_path):
    path = tmp_path / "known_hosts"
    path.write_text("@revoked " + line("*", KEY_B) + "@cert-authority " + line("*", KEY_A))
    assert kh.check(path, "h", KEY_B).verdict is Verdict.REVOKED
    assert kh.check(path, "h", KEY_A).verdict is Verdict.UNKNOWN


def test_hashed_names_written_by_ssh_keygen(tmp_path):
    path = tmp_path / "known_hosts"
    path.write_text(line("[gpu1]:2222", KEY_A))
    subprocess.run(["ssh-keygen", "-H", "-f", str(path)], check=True, capture_output=True)
    assert path.read_text().startswith("|1|")
    assert kh.check(path, "[gpu1]:2222", KEY_A).verdict is Verdict.KNOWN
    assert kh.check(path, "gpu1", KEY_A).verdict is Verdict.UNKNOWN


def test_broken_lines_are_skipped(tmp_path):
    path = tmp_path / "known_hosts"
    path.write_text("h ssh-ed25519 !!!notbase64\nshort line\n" + line("h", KEY_A))
    assert kh.check(path, "h", KEY_A).verdict is Verdict.KNOWN


def test_add_keeps_other_lines_and_creates_private_file(tmp_path):
    path = tmp_path / "new" / "known_hosts"
    kh.add(path, "[h]:2222", KEY_A)
    assert path.read_text() == line("[h]:2222", KEY_A)
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    kh.add(path, "[h]:2222", KEY_A)                   # already there: not duplicated
    kh.add(path, "g", KEY_B)
    assert path.read_text() == line("[h]:2222", KEY_A) + line("g", KEY_B)


def test_concurrent_adds_lose_nothing(tmp_path):
    path = tmp_path / "known_hosts"
    path.write_text("# mine\n")
    names = [f"host{i}" for i in range(24)]
    threads = [threading.Thread(target=kh.add, args=(path, n, KEY_A)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    lines = path.read_text().splitlines()
    assert lines[0] == "# mine" and sorted(lines[1:]) == sorted(line(n, KEY_A).strip() for n in names)
    assert [p.name for p in tmp_path.iterdir()] == ["known_hosts"]   # no temp files left


def test_fingerprint_matches_ssh_keygen(tmp_path):
    key = tmp_path / "k"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    kind, blob = (tmp_path / "k.pub").read_text().split()[:2]
    out = subprocess.run(["ssh-keygen", "-lf", str(tmp_path / "k.pub")], capture_output=True, text=True,
                         check=True).stdout
    assert kh.fingerprint(base64.b64decode(blob)) == out.split()[1]


@pytest.mark.parametrize("bad", ["|1|notbase64|x", "|1|"])
def test_malformed_hashed_names_do_not_match(tmp_path, bad):
    path = tmp_path / "known_hosts"
    path.write_text(line(bad, KEY_A))
    assert kh.check(path, "h", KEY_A).verdict is Verdict.UNKNOWN
