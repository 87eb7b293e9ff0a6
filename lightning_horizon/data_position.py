"""The data position: where a fit stands in its epoch's data, kept as training state.

This room owns the training loader's place in its epoch: the sampler that walks DistributedSampler's own global
order and skips, on resume, the batches the loop already trained on (indices only: no sample is loaded); the
loader's state, saved and restored through Lightning's stateful-loader protocol (``state_dict`` /
``load_state_dict`` on the loader, written under the fit loop's ``combined_loader``); the resume into another world
size with the same global batch; and the case Lightning leaves out, a training loader made while the strategy sets
up (``trainer.estimated_stepping_batches`` in ``configure_optimizers``, e.g. for OneCycleLR), before the checkpoint
is read: Lightning would never hand it its state.

How the position is kept. DistributedSampler deals epoch ``e``'s permutation (``seed + e``) so that rank ``r`` of
``W`` takes ``perm[r::W]``: per-rank batch ``k`` of every rank together is the contiguous block
``perm[k*G:(k+1)*G]``, ``G = W * batch_size``, the same samples whatever ``W``. The state is therefore global:
the epoch and the number of batches the loop consumed in it (the loop's batch progress, never a count at the
sampler or the loader, which DataLoader workers and Lightning's fetcher run ahead of), with the global batch it was
taken in. A resume with the same global batch, on any world size, skips ``k`` batches of the new layout: the same
samples, in the same global order. With another global batch the loop still counts ``k`` batches done, so the
resume continues at sample ``k * G_new`` of the epoch instead of ``k * G_old``; a warning names both.

Under HorizonStrategy with the default ``use_distributed_sampler=True`` Lightning gives every map-style training
loader a DistributedSampler (with one process too); a user's own plain DistributedSampler is kept the same way. A
loader that is already stateful (torchdata's ``StatefulDataLoader``, a stateful IterableDataset's loader) keeps its
own state through the same protocol. With ``use_distributed_sampler=False`` a RandomSampler or SequentialSampler
(every rank walks the whole dataset) keeps its order too, the generator state each pass started from saved with the
position. Other loaders (a custom sampler or batch sampler) are left as they are: Lightning warns that they restart
their epoch.

Lightning's own pieces used here, not copied (tested on Lightning 2.6): ``_update_dataloader`` (the user's loader
rebuilt with another sampler, as Lightning injects its DistributedSampler), ``_set_sampler_epoch``, and for a loader
made during setup the fit loop's ``_load_combined_loader_states``, ``_combined_loader`` and ``_data_fetcher``.
"""

from __future__ import annotations

import functools
import itertools
from collections import deque
from typing import Any, Iterator, Optional, Union

import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler

#: the version of what a loader's position holds, and the key it travels under (which marks a state as a position)
VERSION = 1
MARK = "horizon_data_position"
#: the key, in the strategy's entry of a checkpoint, of the fit loop's loader states where one is a position
LOADER_STATES = "loader_states"


class PositionSampler(DistributedSampler):
    """DistributedSampler's own order (its ``__iter__``, unchanged), skipping the batches already trained on."""

    def __init__(self, like: DistributedSampler) -> None:
        super().__init__(like.dataset, num_replicas=like.num_replicas, rank=like.rank, shuffle=like.shuffle,
                         seed=like.seed, drop_last=like.drop_last)
        self.epoch = like.epoch
        self.position: Optional[LoaderPosition] = None
        #: (epoch, indices of this rank to skip) of a loaded state, for the pass that starts that epoch
        self._skip: Optional[tuple[int, int]] = None

    def __iter__(self) -> Iterator[int]:
        epoch, skip = self._skip if self._skip is not None else (None, 0)
        self._skip = None
        skip = skip if epoch == self.epoch else 0
        if self.position is not None:
            self.position.pass_started()
        return itertools.islice(super().__iter__(), skip, None)


class ReplaySampler(Sampler[int]):
    """A RandomSampler's or SequentialSampler's own order (``use_distributed_sampler=False``: every rank walks the
    whole dataset), with the generator state each pass started from kept, so that a resume replays the pass and skips
    the batches already trained on."""

    num_replicas = 1  # every rank's stream is its own: the global batch is the per-rank one

    def __init__(self, like: Sampler) -> None:
        self.inner, self.dataset, self.epoch = like, like.data_source, 0
        self.position: Optional[LoaderPosition] = None
        self._skip: Optional[tuple[int, int]] = None
        self._replay: Optional[torch.Tensor] = None  # a loaded pass's generator state
        self.pass_state: Optional[torch.Tensor] = None  # the current pass's

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        epoch, skip = self._skip if self._skip is not None else (None, 0)
        replay, self._skip, self._replay = self._replay, None, None
        if epoch != self.epoch:
            skip, replay = 0, None
        if self.position is not None:
            self.position.pass_started()
        sampler = self.inner
        if isinstance(sampler, RandomSampler):
            generator = sampler.generator
            if generator is None:  # RandomSampler's own draw of the pass's seed from torch's generator
                generator = torch.Generator()
                if replay is None:
                    generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
                sampler = RandomSampler(sampler.data_source, sampler.replacement, sampler._num_samples,
                                        generator=generator)
            if replay is not None:
                generator.set_state(replay)
            self.pass_state = generator.get_state()
        return itertools.islice(iter(sampler), skip, None)


class LoaderPosition:
    """One training loader's position: its ``state_dict`` / ``load_state_dict`` are the loader's (Lightning's
    stateful-loader protocol), read from the fit loop's batch progress."""

    def __init__(self, loader: DataLoader, sampler: Union[PositionSampler, ReplaySampler], trainer: Any) -> None:
        self.loader, self.sampler, self.trainer = loader, sampler, trainer
        self.batch_size = loader.batch_size or 1
        #: the loop's batch index at which the current pass took its first batch (> 0 when a shorter loader of a
        #: CombinedLoader cycles), and the epoch of that pass
        self._origin, self._pass_epoch = 0, None
        self._resumed_origin: Optional[int] = None
        self._user_generator: Any = None
        #: a state was loaded (a checkpoint without one, written before the data position was kept, restarts the epoch)
        self.loaded = False

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.sampler.num_replicas

    def pass_started(self) -> None:
        """The sampler begins a pass over its epoch: a loaded state's, the epoch's first, or a cycle."""
        if self._resumed_origin is not None:
            self._origin, self._resumed_origin = self._resumed_origin, None
            self.loader.generator = self._user_generator  # the iterator that drew no seed has been made
        elif self._pass_epoch == self.sampler.epoch:
            self._origin = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        else:
            self._origin = 0
        self._pass_epoch = self.sampler.epoch

    def state_dict(self) -> dict[str, Any]:
        progress = self.trainer.fit_loop.epoch_loop.batch_progress
        done = progress.current.processed  # batches whose training step finished: the loop resumes after them
        state = {MARK: VERSION, "epoch": self.sampler.epoch, "batches": done - self._origin,
                 "loop_batches": done, "global_batch": self.global_batch, "world_size": self.sampler.num_replicas,
                 "samples": len(self.sampler.dataset)}
        if progress.is_last_batch:  # the epoch is over: the next one starts at its first batch
            state.update(epoch=self.sampler.epoch + 1, batches=0, loop_batches=0)
        elif getattr(self.sampler, "pass_state", None) is not None:
            state["generator"] = self.sampler.pass_state  # a RandomSampler's pass, replayed on resume
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get(MARK) != VERSION:
            raise ValueError(f"HorizonStrategy: the checkpoint's data position {state!r} is not one this version"
                             f" reads (version {VERSION})")
        if state["samples"] != len(self.sampler.dataset):
            rank_zero_warn(f"HorizonStrategy: the checkpoint's training data held {state['samples']} samples, this"
                           f" run's {len(self.sampler.dataset)}: the resumed epoch's order is not the saved one")
        self.loaded = True
        batches = state["batches"]
        if state["global_batch"] != self.global_batch and batches:
            rank_zero_warn(
                f"HorizonStrategy: the checkpoint's global batch was {state['global_batch']} samples"
                f" ({state['world_size']} ranks), this run's is {self.global_batch}"
                f" ({self.sampler.num_replicas} ranks x {self.batch_size}): epoch {state['epoch']} continues at"
                f" sample {batches * self.global_batch} of its order instead of {batches * state['global_batch']}"
                " (keep devices x batch_size to resume exactly)")
        self.sampler.epoch = state["epoch"]  # also for a pass that DataLoader workers start before set_epoch
        self.sampler._skip = (state["epoch"], batches * self.batch_size)
        if "generator" in state:
            self.sampler._replay = state["generator"]
        self._pass_epoch = None
        self._resumed_origin = state["loop_batches"] - batches
        self._user_generator = self.loader.generator
        if batches and self.loader.generator is None:
            # Every DataLoader iterator draws its workers' base seed from torch's global generator: the run that
            # was not interrupted drew it at the epoch's start, before the checkpoint; a mid-epoch resume must not
            # draw again (the restored generator's next draw is the next step's)
            self.loader.generator = torch.Generator()


#: the samplers whose order this room keeps: Lightning's (or a user's) DistributedSampler, and with
#: ``use_distributed_sampler=False`` a RandomSampler or SequentialSampler
SAMPLERS: dict[type, type] = {DistributedSampler: PositionSampler, RandomSampler: ReplaySampler,
                              SequentialSampler: ReplaySampler}


def positioned(dataloader: object, trainer: Any) -> object:
    """The training loader Lightning will iterate: ``dataloader`` with a :class:`PositionSampler` and a position
    where its sampler is a plain DistributedSampler batched by a plain BatchSampler; otherwise ``dataloader``."""
    if (trainer is None or not trainer.training or not isinstance(dataloader, DataLoader)
            or isinstance(dataloader, _Stateful) or type(dataloader.sampler) not in SAMPLERS
            or (dataloader.batch_sampler is not None and type(dataloader.batch_sampler) is not BatchSampler)):
        return dataloader
    sampler = SAMPLERS[type(dataloader.sampler)](dataloader.sampler)
    loader = _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)
    position = LoaderPosition(loader, sampler, trainer)
    sampler.position = position
    # the loader is now stateful for Lightning (``isinstance(loader, _Stateful)``): its fit loop saves and restores it
    loader.state_dict, loader.load_state_dict = position.state_dict, position.load_state_dict
    loader.horizon_position = position
    return loader


class ConsumedState:
    """A loader that keeps its own state (torchdata's ``StatefulDataLoader``): its state counts every batch it has
    yielded, and where the training data's length is unknown (an IterableDataset) Lightning's fetcher takes one
    batch ahead of the loop, so the state saved would skip that batch on resume. This keeps the loader's state after
    each batch it yields, and hands Lightning the one after the batches the loop consumed."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self._origin = 0  # the loop's batch index of the pass's first batch
        self._states: deque[tuple[int, Any]] = deque(maxlen=4)  # (batches yielded in the pass, the state after)

    def _processed(self) -> int:
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.processed

    def wrap(self, loader: Any, iterator: Iterator[Any], state: Any) -> Iterator[Any]:
        self._origin = self._processed()
        self._states.clear()
        self._states.append((0, state(loader)))
        return self._watch(loader, iterator, state)

    def _watch(self, loader: Any, iterator: Iterator[Any], state: Any) -> Iterator[Any]:
        for n, batch in enumerate(iterator, 1):
            self._states.append((n, state(loader)))
            yield batch

    def state(self, current: Any) -> Any:
        consumed = self._processed() - self._origin
        return next((s for n, s in self._states if n == consumed), current)


@functools.cache
def _consumed_class(cls: type) -> type:
    """``cls`` (a stateful DataLoader class) whose ``state_dict`` is the one after the batches the loop consumed."""

    def __iter__(self: Any) -> Iterator[Any]:
        # the iterator is made now (a pass starts where it is asked for), its batches are watched as they come
        return self._horizon_consumed.wrap(self, cls.__iter__(self), cls.state_dict)

    def state_dict(self: Any) -> Any:
        return self._horizon_consumed.state(cls.state_dict(self))

    return type(cls.__name__, (cls,), {"__iter__": __iter__, "state_dict": state_dict, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def consumed(dataloader: object, trainer: Any) -> object:
    """A stateful training DataLoader of the user's, whose saved state is then the one after the consumed batches."""
    if isinstance(dataloader, DataLoader) and callable(getattr(type(dataloader), "state_dict", None)):
        if not hasattr(dataloader, "_horizon_consumed"):
            dataloader._horizon_consumed = ConsumedState(trainer)
            dataloader.__class__ = _consumed_class(type(dataloader))
    return dataloader


class DataPositions:
    """The strategy's side: it builds the positioned loaders (``process_dataloader``) and, where the training loader
    was made while the strategy set up (before the checkpoint was read), gives it its saved state at the start of
    training, as Lightning gives it to a loader made later."""

    def __init__(self) -> None:
        self._setting_up = False
        self._made_early = False

    def setup_begins(self) -> None:
        self._setting_up, self._made_early = True, False

    def setup_ends(self) -> None:
        self._setting_up = False

    def process(self, dataloader: object, trainer: Any) -> object:
        if trainer is None or not trainer.training:
            return dataloader
        self._made_early = self._made_early or self._setting_up
        # the epoch the loop resumes, now: DataLoader workers start the sampler's pass when the iterator is made,
        # before the loop's own set_epoch (a resumed epoch would take epoch 0's order)
        _set_sampler_epoch(dataloader, trainer.fit_loop.epoch_progress.current.processed)
        return consumed(positioned(dataloader, trainer), trainer)

    @staticmethod
    def portable(checkpoint: dict[str, Any], under: str) -> dict[str, Any]:
        """``checkpoint`` as plain Lightning resumes it too: Lightning's fit loop refuses a checkpoint with more
        loader states than its loaders have, and under another strategy a positioned loader is a plain one. The
        fit loop's list is kept whole in the strategy's own entry ``under`` (read back by :meth:`restored`), with
        only the states of loaders stateful by themselves (a ``StatefulDataLoader``) left where Lightning reads
        them."""
        fit = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        states = fit.get("combined_loader") or []
        kept = [s for s in states if not (isinstance(s, dict) and MARK in s)]
        if len(kept) == len(states):
            return checkpoint
        fit = {**fit, "combined_loader": kept}
        loops = {**checkpoint["loops"], "fit_loop": {**checkpoint["loops"]["fit_loop"], "state_dict": fit}}
        return {**checkpoint, "loops": loops, under: {**checkpoint.get(under, {}), LOADER_STATES: states}}

    @staticmethod
    def restored(checkpoint: dict[str, Any], under: str) -> dict[str, Any]:
        """The fit loop's loader states of a checkpoint :meth:`portable` wrote, back where Lightning reads them."""
        states = checkpoint.get(under, {}).pop(LOADER_STATES, None)
        if states is not None:
            checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] = states
        return checkpoint

    def train_starts(self, trainer: Any) -> None:
        """At ``on_train_start`` (the loop restored, its iterator not yet drawn from): a training loader made during
        setup by a resumed fit gets the checkpoint's loader states through the fit loop's own loading, its epoch,
        and a fresh iterator (the one made during setup predates both)."""
        made_early, self._made_early = self._made_early, False
        loop = trainer.fit_loop
        if trainer.ckpt_path is None or loop._combined_loader is None:
            return
        if made_early:
            loop._load_combined_loader_states()
            for dl in loop._combined_loader.flattened:
                _set_sampler_epoch(dl, loop.epoch_progress.current.processed)
            iter(loop._data_fetcher)
        progress = loop.epoch_loop.batch_progress
        unplaced = [dl for dl in loop._combined_loader.flattened
                    if getattr(dl, "horizon_position", None) is not None and not dl.horizon_position.loaded]
        if unplaced and progress.current.processed and not progress.is_last_batch:
            rank_zero_warn(f"HorizonStrategy: the checkpoint {trainer.ckpt_path} holds no position of the training"
                           f" data (written without it): epoch {loop.epoch_progress.current.processed} restarts at its"
                           f" first batch while the loop goes on at batch {progress.current.processed}")


__all__ = ["ConsumedState", "DataPositions", "LoaderPosition", "PositionSampler", "ReplaySampler", "SAMPLERS",
           "positioned"]
