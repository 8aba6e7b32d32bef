"""The ``pip install`` line a model card gives for this plugin: one that works where the card is read.

It follows how the running copy was installed (PEP 610's ``direct_url.json``): from a package index,
the pinned version; from a Git URL, that URL at the installed commit; from a downloadable archive, its
URL; from a local folder or file, the Git remote and commit of that checkout when it has one, and
otherwise an honest placeholder with the version.
"""

from __future__ import annotations

import functools
import json
import subprocess
from importlib import metadata
from urllib.parse import unquote, urlparse

DISTRIBUTION = "mergekit-bmm"


@functools.lru_cache(maxsize=1)
def install_command() -> str:
    """One shell line (a comment after ``#`` where a reader must fill something in)."""
    try:
        distribution = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return f"pip install {DISTRIBUTION}  # not installed as a package here: install it from its source"
    version = distribution.version
    direct = distribution.read_text("direct_url.json")
    if not direct:
        return f"pip install {DISTRIBUTION}=={version}"
    return command_for(json.loads(direct), version)


def command_for(direct_url: dict, version: str) -> str:
    """The line for one ``direct_url.json`` (split out so that each case can be checked)."""
    url = direct_url.get("url", "")
    vcs = direct_url.get("vcs_info")
    if vcs:
        commit = vcs.get("commit_id") or vcs.get("requested_revision")
        return f'pip install "{DISTRIBUTION} @ {vcs.get("vcs", "git")}+{url}{"@" + commit if commit else ""}"'
    if not url.startswith("file:"):
        return f'pip install "{DISTRIBUTION} @ {url}"'
    local = unquote(urlparse(url).path)
    remote = _git_remote(local) if "dir_info" in direct_url else None
    if remote is not None:
        address, commit = remote
        return f'pip install "{DISTRIBUTION} @ git+{address}@{commit}"'
    return (
        f"pip install ./mergekit-bmm  # a checkout or wheel of {DISTRIBUTION} {version}: this merge was "
        "made with a local copy that names no public source"
    )


def _git_remote(folder: str) -> tuple[str, str] | None:
    """(remote URL, commit) of a Git checkout with an ``origin`` remote that has its commit, and no
    local changes."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", folder, *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    address, commit = git("remote", "get-url", "origin"), git("rev-parse", "HEAD")
    if not address or not commit or git("status", "--porcelain", "--untracked-files=no") != "":
        return None
    if not git("branch", "-r", "--contains", commit):  # not pushed anywhere this checkout knows of
        return None
    if address.startswith("git@") and ":" in address:  # scp-like ssh address → https, which pip reads
        host, path = address[4:].split(":", 1)
        address = f"https://{host}/{path}"
    return address, commit
