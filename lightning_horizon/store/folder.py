"""The folder of one fit's store on one rank: a subfolder of its own, created at setup and removed at teardown.

The folder a user names (``StoreConfig(path=...)``, or ``horizon-store/`` next to the checkpoints) may hold other
files and other fits' stores, at the same time or one after another: each fit and rank works in a subfolder of its
own, ``horizon-<host>-rank<R>-<random>``, and removes it at teardown, with the folders above it that the store
created (when they are empty then). A folder the store did not create is never removed.

The store's files are unlinked as soon as they are made, so a crash (SIGKILL) leaves an empty subfolder at most.
The next fit in the same folder on the same host removes such leftovers: a live fit holds a lock on its subfolder
(``flock``, released by the kernel when its process dies), and the fits of a folder take turns (a lock on the folder)
while they sweep and create theirs, so a subfolder is never seen unlocked while its fit is alive. Where the file
system has no such locks (a network file system), nothing is swept.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import socket
import tempfile
from typing import Any, Optional

from lightning_horizon.store.config import StoreConfig
from lightning_horizon.store.files import StoreSpaceError

PREFIX = "horizon-"


def store_folder(config: StoreConfig, trainer: Any) -> str:
    """The folder the store goes in: ``config.path``, else ``horizon-store/`` next to the checkpoints."""
    if config.path is not None:
        return os.fspath(config.path)
    ckpt = getattr(trainer, "checkpoint_callback", None) if trainer is not None else None
    base = getattr(ckpt, "dirpath", None) or getattr(trainer, "default_root_dir", None) or os.getcwd()
    return os.path.join(base, "horizon-store")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"


def _lock(fd: int, blocking: bool) -> Optional[bool]:
    """Lock ``fd`` exclusively: True when taken, False when another holds it, None where locks are not supported."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        return True
    except OSError as e:
        return False if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None


def _makedirs(folder: str) -> list[str]:
    """Create ``folder`` and what is missing above it; returns the folders created, outermost first."""
    missing = []
    f = os.path.abspath(folder)
    while not os.path.isdir(f):
        missing.append(f)
        parent = os.path.dirname(f)
        if parent == f:
            break
        f = parent
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise StoreSpaceError(e.errno, f"state_store: cannot create the folder {folder}: {e.strerror}") from e
    return missing[::-1]


class FitFolder:
    """This fit's subfolder of ``parent`` (:attr:`path`), locked while the fit lives; :meth:`remove` at teardown."""

    def __init__(self, parent: str, rank: int) -> None:
        self.parent = parent
        self.created = _makedirs(parent)
        self._fd = -1
        try:
            self._create(rank)
        except BaseException:
            _rmdirs(self.created[::-1])
            raise

    def _create(self, rank: int) -> None:
        parent = self.parent
        if not os.access(parent, os.W_OK | os.X_OK):
            raise StoreSpaceError(errno.EACCES, f"state_store: the folder {parent} is not writable by this process")
        try:
            turn = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:  # not readable: no turns, no sweep
            turn = -1
        try:
            # the fits of this folder take turns to sweep and create
            locks = _lock(turn, blocking=True) if turn >= 0 else None
            if locks:
                self._sweep()
            try:
                self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{_host()}-rank{rank}-", dir=parent)
            except OSError as e:
                raise StoreSpaceError(e.errno, f"state_store: cannot create a folder in {parent}: {e.strerror}") from e
            self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
            if locks:
                _lock(self._fd, blocking=False)
        finally:
            if turn >= 0:
                os.close(turn)  # the folder's turn passes on

    def _sweep(self) -> None:
        """Remove the subfolders left by fits of this host that died (unlocked: no live process holds them)."""
        mine = f"{PREFIX}{_host()}-rank"
        for name in os.listdir(self.parent):
            path = os.path.join(self.parent, name)
            if not name.startswith(mine) or not os.path.isdir(path) or os.path.islink(path):
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                continue
            try:
                if not _lock(fd, blocking=False):
                    continue
                for entry in os.scandir(path):  # a file a crash caught between its creation and its unlink
                    if entry.is_file(follow_symlinks=False):
                        os.unlink(entry.path)
                os.rmdir(path)
            except OSError:
                pass
            finally:
                os.close(fd)

    def remove(self) -> None:
        """Remove the subfolder (its files were unlinked at creation), then the folders the store created above it
        that are empty now."""
        _rmdirs([self.path, *self.created[::-1]])  # while locked: no sweep takes it meanwhile
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _rmdirs(folders: list[str]) -> None:
    """Remove ``folders`` in order while they are empty."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:
            break  # not empty (a user's files, another fit's store) or gone: it stays


__all__ = ["FitFolder", "PREFIX", "store_folder"]
