"""The local token: controls without friction on a cluster that only listens on loopback.

A manager bound to loopback with no token configured writes a random token to
``<state dir>/token`` (mode 0600, this user's) on its first start and accepts it for state
changes, shown as "local" (who paused, drained, reloaded). The CLI (``qcluster pause`` ...)
reads it when no token is configured and the manager it talks to is on this machine, so
``qcluster pause`` just works on a local cluster; the demo uses it to print a one-time
login for its admin page. A configured ``token`` / ``[tokens]`` replaces it; a public bind
still needs a configured token (qcluster.security.check_server_security).
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from qcluster.broker.embedded import check_state_dir
from qcluster.errors import ConfigError

TOKEN_FILE = "token"
#: Shown as "by" for a control set with the local token.
LOCAL_TOKEN_NAME = "local"


def token_path(state_dir: Path) -> Path:
    return Path(state_dir).resolve() / TOKEN_FILE


def ensure_local_token(state_dir: Path) -> str:
    """The local token, written first (0600) if there is none.

    Raises:
        ConfigError: the state directory cannot be written, is not this user's or others may
            write in it (they could swap the file), or the file is not this user's alone
            (one line naming it).
    """
    path = token_path(state_dir)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_directory(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot write the local token {path}: {exc.strerror or exc}") from None
    else:
        with os.fdopen(fd, "w") as file:
            file.write(secrets.token_hex(24) + "\n")
    found = read_local_token(state_dir)
    if found is None:
        raise ConfigError(f"the local token {path} is empty: remove it, a new one is written")
    return found


def read_local_token(state_dir: Path) -> str | None:
    """The local token of ``state_dir``; None when there is none.

    Raises:
        ConfigError: the file is another user's, or others may read it, or its directory is
            another user's or others may write in it (it is refused).
    """
    path = token_path(state_dir)
    try:
        _check_directory(path)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read the local token {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd) as file:
        info = os.fstat(file.fileno())
        if info.st_uid != os.getuid() or info.st_mode & 0o077 or not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"the local token {path} is not this user's alone (owner uid "
                              f"{info.st_uid}, mode {stat.filemode(info.st_mode)}): remove it, "
                              "or chmod 600 it")
        return file.read().strip() or None


def _check_directory(path: Path) -> None:
    """ConfigError unless the token's directory is this user's and no one else may write in
    it: another user could otherwise replace the file (FileNotFoundError: none yet)."""
    try:
        check_state_dir(path.parent, "the local token's directory")
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"cannot read the local token's directory {path.parent}: "
                          f"{exc.strerror or exc}") from None
