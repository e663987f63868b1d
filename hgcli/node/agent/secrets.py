"""Which environment variables hold secrets, shared by the controller and the node agent.

Both sides decide with the same function, so a value the launcher keeps off command lines is also
one the agent keeps out of ``agent.json`` and its own log. A value is secret by its variable's name,
by ``launch --secret-env NAME`` (the spec's ``secret`` list), and a URL's password whatever the
name (``DB_URL=postgres://u:pw@db/x`` is kept as ``postgres://u:<redacted>@db/x``).
"""
from __future__ import annotations

import re
from typing import Iterable, Mapping

# Substrings that mark a name as secret (matched case-insensitively, anywhere in the name):
# GITHUB_TOKEN, AWS_SECRET_ACCESS_KEY, DB_PASSWORD, WANDB_API_KEY, HF_AUTH...
_SECRET = re.compile(r"TOKEN|SECRET|PASSW(OR)?D|PASSPHRASE|KEY|CREDENTIAL|AUTH|COOKIE|PRIVATE", re.I)
REDACTED = "<redacted>"
# scheme://user:password@  (the password ends at the last '@' before the host: passwords may hold '@')
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^\s/:@]*:)(?P<password>[^\s/]*)@")


def is_secret_name(name: str) -> bool:
    return bool(_SECRET.search(name))


def redact_env(env: Mapping[str, str], extra_secret: Iterable[str] = ()) -> dict[str, str]:
    """``env`` with every secret value (by name, or listed in ``extra_secret``) replaced."""
    extra = set(extra_secret)
    return {k: (REDACTED if k in extra or is_secret_name(k) else redact_urls(v)) for k, v in env.items()}


def redact_urls(value: str) -> str:
    """``value`` with the password of every ``scheme://user:password@host`` replaced."""
    return _URL_PASSWORD.sub(lambda m: f"{m.group('head')}{REDACTED}@", value)
