"""Byte-level language-model data: a text corpus turned once into a memory-mapped token file, then cached.

The default corpus is the Python standard library's own ``.py`` files on this machine, so nothing is downloaded
and every machine has one. Any file or directory can be named instead. Tokens are raw UTF-8 bytes (vocabulary
256): no tokenizer to train or ship, and perplexity is per byte.

The token file is built on local rank 0 only (``prepare_data``), written to a temporary name and renamed, so a
crash never leaves a half-written cache and concurrent ranks or runs never read one. Its name is a hash of what
went into it (paths, sizes, mtimes, the cap), so an edited corpus gets a new file instead of a stale one.

Split: the stream is cut into windows of ``seq_len + 1`` tokens, consecutive windows are grouped into chunks of
about 64 KiB, and a seeded permutation sends ``val_fraction`` of the chunks to validation. Chunks, not a tail
split, so validation samples the whole corpus rather than the last few packages in sorted order.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sysconfig
from pathlib import Path
from typing import Optional

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

VOCAB_SIZE = 256  # byte-level
_SEPARATOR = b"\n\n"  # between files: Python sources already end paragraphs with blank lines
_CHUNK_BYTES = 1 << 16
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lightning_horizon" / "corpora"


def corpus_files(corpus: Optional[str]) -> tuple[Path, list[Path]]:
    """The root and the sorted list of files to read. ``None`` = the standard library's ``.py`` files."""
    if corpus is None:
        root = Path(sysconfig.get_paths()["stdlib"])
    else:
        root = Path(corpus).expanduser().resolve()
        if not root.exists():
            raise ValueError(f"corpus={corpus!r}: no such file or directory (allowed: a text file, a directory, or None"
                             " for the Python standard library's sources)")
    if root.is_file():
        return root.parent, [root]
    files = sorted(_walk(root, suffix=".py" if corpus is None else ""))
    if not files:
        raise ValueError(f"corpus={str(root)!r}: the directory holds no {'.py ' if corpus is None else ''}files")
    return root, files


def _walk(root: Path, suffix: str) -> list[Path]:
    """The files under ``root`` whose names end with ``suffix``, not hidden and outside ``_SKIP_DIRS`` (symlinked
    folders are not followed). The skipped folders are never listed: the standard library's site-packages can hold
    ten times its files, and walking them cost every process a second or more before it found its cached file."""
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        for name in names:
            path = os.path.join(folder, name)
            if name.endswith(suffix) and not name.startswith(".") and name not in _SKIP_DIRS and os.path.isfile(path):
                files.append(Path(path))
    return files


def build_token_file(corpus: Optional[str], cache_dir: Path, max_bytes: int) -> tuple[Path, dict]:
    """Build (or find) the cached uint8 token file for ``corpus``; return its path and its metadata."""
    root, files = corpus_files(corpus)
    key = hashlib.sha1(f"{root}|{max_bytes}|bytes-v1".encode())
    for f in files:
        st = f.stat()
        key.update(f"{f.relative_to(root)}|{st.st_size}|{st.st_mtime_ns}".encode())
    stem = f"{root.name or 'corpus'}-{key.hexdigest()[:16]}"
    # appended, not Path.with_suffix: the standard library's folder is "python3.11", whose ".11-<key>" would be
    # taken for a suffix and replaced, so that every size and file set shared one "python3.bin"
    path, meta_path = cache_dir / f"{stem}.bin", cache_dir / f"{stem}.json"
    if path.exists() and meta_path.exists():
        return path, json.loads(meta_path.read_text())
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".bin.tmp{os.getpid()}")
    written, used = 0, 0
    with open(tmp, "wb") as out:
        for f in files:
            if written >= max_bytes:
                break
            data = f.read_bytes()
            if b"\x00" in data[:8192]:
                continue  # binary file in a user's directory: not text
            data = data[: max_bytes - written] + _SEPARATOR
            out.write(data)
            written += len(data)
            used += 1
    if written < 1 << 12:
        tmp.unlink(missing_ok=True)
        raise ValueError(f"corpus={str(root)!r}: only {written} bytes of text found; need at least 4096")
    meta = {"corpus": str(root), "files": used, "tokens": written, "vocab_size": VOCAB_SIZE, "max_bytes": max_bytes}
    os.replace(tmp, path)  # atomic: readers see the whole file or none
    meta_path.write_text(json.dumps(meta, indent=1))
    return path, meta


class WindowDataset(Dataset):
    """``(x, y)`` pairs of ``seq_len`` tokens, ``y`` shifted by one, read from the memory map on demand."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> None:
        self.tokens, self.starts, self.seq_len = tokens, starts, seq_len

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[i])
        w = torch.from_numpy(self.tokens[s : s + self.seq_len + 1].astype(np.int64))
        return w[:-1], w[1:]


class ResumableSampler(DistributedSampler):
    """torch's DistributedSampler (seeded shuffle per epoch, one slice per rank) that can start an epoch part-way.

    Resuming from a mid-epoch checkpoint must continue the epoch, not replay its first batches: the data module
    saves how many batches the epoch had consumed, and this sampler skips them in that epoch only. Lightning keeps
    a DistributedSampler it is given (it wraps anything else), so one class serves one process and many.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.skip_epoch, self.skip = -1, 0

    def __iter__(self):  # type: ignore[override]
        it = super().__iter__()
        return itertools.islice(it, self.skip, None) if self.epoch == self.skip_epoch else it


def split_windows(n_tokens: int, seq_len: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Start offsets of the train and validation windows (deterministic in ``seed``)."""
    n_windows = (n_tokens - 1) // seq_len
    per_chunk = max(1, _CHUNK_BYTES // seq_len)
    n_chunks = -(-n_windows // per_chunk)
    n_val = max(1, round(n_chunks * val_fraction)) if val_fraction > 0 else 0
    if n_chunks - n_val < 1:
        raise ValueError(f"seq_len={seq_len}: the corpus ({n_tokens} tokens) is too small for a train/val split")
    val_chunks = np.random.default_rng(seed).permutation(n_chunks)[:n_val]
    is_val = np.zeros(n_chunks, dtype=bool)
    is_val[val_chunks] = True
    chunk_of = np.arange(n_windows) // per_chunk
    starts = np.arange(n_windows, dtype=np.int64) * seq_len
    return starts[~is_val[chunk_of]], starts[is_val[chunk_of]]


class ByteCorpusDataModule(L.LightningDataModule):
    """Byte-level next-token data from a text corpus, memory-mapped and cached.

    Args:
        corpus: a text file or a directory (every file under it, sorted); ``None`` for the Python standard
            library's ``.py`` files (found via ``sysconfig.get_paths()["stdlib"]``).
        cache_dir: where the token file is kept; ``None`` for ``~/.cache/lightning_horizon/corpora``.
        max_bytes: cap on the corpus size, in bytes (= tokens); files are read in sorted order until it is reached.
        seq_len: tokens per training sequence (the model's ``block_size`` or less).
        batch_size: sequences per batch, per rank.
        val_fraction: share of the ~64 KiB chunks held out for validation, in [0, 0.5].
        seed: seed of the train/val split and of the training order (reshuffled each epoch from it).
        num_workers: DataLoader worker processes; 0 reads in the training process (the memory map makes it cheap).
    """

    def __init__(
        self,
        corpus: Optional[str] = None,
        cache_dir: Optional[str] = None,
        max_bytes: int = 32 * 2**20,
        seq_len: int = 256,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        seed: int = 1234,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        for name, value, low in (("max_bytes", max_bytes, 4096), ("seq_len", seq_len, 1), ("batch_size", batch_size, 1),
                                 ("num_workers", num_workers, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"ByteCorpusDataModule({name}={value!r}): allowed is an int >= {low}")
        if not 0.0 <= val_fraction <= 0.5:
            raise ValueError(f"ByteCorpusDataModule(val_fraction={val_fraction!r}): allowed is a number in [0, 0.5]")
        if corpus is not None and not Path(corpus).expanduser().exists():
            raise ValueError(f"ByteCorpusDataModule(corpus={corpus!r}): no such file or directory (or None for the"
                             " Python standard library's sources)")
        self.corpus, self.max_bytes, self.seq_len, self.batch_size = corpus, max_bytes, seq_len, batch_size
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.val_fraction, self.seed, self.num_workers = val_fraction, seed, num_workers
        self.vocab_size = VOCAB_SIZE
        self.meta: dict = {}
        self.train_set: Optional[WindowDataset] = None
        self.val_set: Optional[WindowDataset] = None
        self._built: Optional[tuple[Path, dict]] = None
        self._resume: dict = {}

    def prepare_data(self) -> None:
        # local rank 0 only (Lightning's contract): the one place that writes the cache
        self._built = build_token_file(self.corpus, self.cache_dir, self.max_bytes)

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        # the other ranks find the file rank 0 wrote (Lightning barriers between prepare_data and setup)
        path, self.meta = self._built or build_token_file(self.corpus, self.cache_dir, self.max_bytes)
        tokens = np.memmap(path, dtype=np.uint8, mode="r")
        train, val = split_windows(len(tokens), self.seq_len, self.val_fraction, self.seed)
        self.train_set = WindowDataset(tokens, train, self.seq_len)
        self.val_set = WindowDataset(tokens, val, self.seq_len)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer is not None else (1, 0)
        sampler = ResumableSampler(self.train_set, world, rank, self.seed)
        if self._resume:
            sampler.skip_epoch, sampler.skip = self._resume["epoch"], self._resume["batches"] * self.batch_size
        # drop_last: every step sees the same batch shape (throughput and MFU figures stay comparable)
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, drop_last=True,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def state_dict(self) -> dict:
        # saved in every checkpoint: where in which epoch the training order stands (batches per rank)
        if self.trainer is None:
            return {}
        progress = self.trainer.fit_loop.epoch_loop.batch_progress.current
        return {"epoch": self.trainer.current_epoch, "batches": progress.processed}

    def load_state_dict(self, state_dict: dict) -> None:
        self._resume = dict(state_dict)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
