"""A data sampler that survives changes of world size in the middle of an epoch.

The point of elastic training is that workers may join or leave at any time without
restarting the epoch. A plain ``DistributedSampler`` cannot do that: it partitions the
whole epoch once, so after a resize every rank would start over and samples already
trained would be trained again. :class:`ElasticSampler` instead remembers which dataset
indices were processed in the current epoch and, on every :meth:`~ElasticSampler.reset`,
partitions only the indices that are left over the ranks that exist now.

Pure data plus torch: no I/O, no threads, no collectives. Synchronising the processed set
between ranks is the caller's job (the elastic ``TorchState`` handler), see
:class:`ElasticSampler`. The processed set is an :class:`~elasticrun.worker.index_set.IndexSet`
(one byte per sample) and a reset works on tensors, so that a dataset of tens of millions of
samples costs no step that holds the GIL for long (the heartbeat thread needs it).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableSet, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from elasticrun.worker import rounds
from elasticrun.worker import index_set
from elasticrun.worker.index_set import SLICE, IndexSet, Records, checked_int64, slices, to_list

log = logging.getLogger("elasticrun.worker")

#: Returns ``(rank, size)`` of the current world; called on every reset.
WorldProvider = Callable[[], tuple[int, int]]


def _ints(part: torch.Tensor, start: int) -> Iterator[int]:
    """The ints of ``part`` from ``start``, made a slice at a time (a pass over millions of
    indices never holds them all as Python ints, nor the GIL for one long ``tolist``)."""
    for ints in slices(part, start):
        yield from ints


def _world_provider() -> tuple[int, int]:
    """Default ``(rank, size)`` source: this process's current round.

    Looked up at call time, so tests may replace this module-level hook.
    """
    r = rounds.placed()  # building a sampler takes no place in the job (see rounds.defer)
    return r.rank, r.size


class ElasticSampler(Sampler[int]):
    """Shards a map-style dataset over the ranks so each sample is trained once per epoch,
    even when the set of ranks changes in the middle of the epoch.

    **How it works.** The epoch order is a permutation of ``range(len(dataset))`` drawn from
    a ``torch.Generator`` seeded with ``seed + epoch`` (or the identity when ``shuffle`` is
    false), so every rank computes the same order without communicating. :meth:`reset`
    removes the indices in :attr:`processed_indices` from that order (keeping the order)
    and gives rank ``r`` of ``n`` the slice ``remaining[r::n]``. Because every rank derives
    its partition from the same ``(epoch, processed_indices)``, the partitions are disjoint
    and together cover every remaining index, and an index recorded as processed is never
    handed out again in this epoch.

    **Equal lengths (padding / drop_last).** Collectives stay in lockstep only if every
    rank runs the same number of steps, so every rank gets the same number of indices:

    * ``drop_last=False`` (default, like ``DistributedSampler``): when the number of
      remaining indices does not divide evenly by ``num_replicas``, it is padded up to the
      next multiple by repeating remaining indices from the start (fewer than
      ``num_replicas`` extra samples). A padded index is therefore *trained twice* if both
      copies run before the next reset. Recording it twice is harmless (the processed set
      is a set), but the sample's gradient is counted twice in that epoch. No padding
      happens when the remaining count divides ``num_replicas``, e.g. in an epoch without
      mid-epoch resets over a dataset whose length divides the world size.
    * ``drop_last=True``: the tail of fewer than ``num_replicas`` indices is left out of
      the partition instead, so nothing is ever trained twice. The left-out indices stay
      unprocessed: a later reset in the same epoch may hand them out again, and those still
      left when the epoch ends are simply not trained in this epoch.

    The exactly-once guarantee is therefore: with ``drop_last=True`` (or without padding)
    no index is trained twice in an epoch, and the *committed* processed set (the one
    saved by ``commit()``) contains each index that was trained in committed work exactly
    once. Work done after the last commit is redone after a failure, and that is correct
    because the model is rolled back to the same commit.

    **Synchronising between ranks.** Each rank records only its own batches
    (:meth:`record_batch` / :meth:`record_indices`) in its local :attr:`processed_indices`.
    Before the state is saved (commit) or broadcast (sync), the caller must make the set
    the union over all ranks, then repartition::

        gathered = allgather_object(sampler.state_dict()["processed_indices"])
        for part in gathered:
            sampler.merge_processed(part)
        sampler.reset()  # or load_state_dict() of the merged, broadcast state

    Restoring (after a ``HorovodInternalError``) is ``load_state_dict(committed)``, which
    resets, so the work since the commit is repartitioned and redone. A graceful resize
    (``HostsUpdatedInterrupt``) keeps the live, merged state and just calls :meth:`reset`.
    ``reset()`` must run on every rank with the same processed set, otherwise the ranks
    disagree about what is left and an index could be assigned twice or never.

    **Epochs.** :meth:`set_epoch` clears the processed set, so call it when an epoch is
    *finished* (before the commit that ends the epoch), not at the top of the epoch loop:
    at the top, a loop resumed after a restore would wipe the restored progress.

    Typical loop::

        for batch_idx, batch in enumerate(loader):   # loader uses this sampler
            train_step(batch)
            sampler.record_batch(batch_idx, batch_size)
            if batch_idx % batches_per_commit == 0:
                state.commit()
        state.epoch += 1
        sampler.set_epoch(state.epoch)
        state.commit()
    """

    def __init__(
        self,
        dataset: Sized,
        shuffle: bool = True,
        seed: int = 0,
        *,
        drop_last: bool = False,
        world: WorldProvider | None = None,
    ) -> None:
        """Create the sampler and partition epoch 0 for the current world.

        ``world`` overrides where ``(rank, size)`` comes from (default: the current
        round of the worker runtime); it is read again on every :meth:`reset`.
        """
        super().__init__()
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self._world = world

        self.epoch: int = 0
        #: Dataset indices processed in this epoch (by this rank, plus whatever was merged): a
        #: set-like :class:`IndexSet` (a plain ``set`` assigned here is taken in at the next reset).
        self.processed_indices: MutableSet[int] = IndexSet(len(dataset))
        # What record_indices() added since the last _take_recorded(), and a count of the times
        # processed_indices was replaced (set_epoch, load_state_dict): a commit then saves what
        # is new, not the whole set again (SamplerStateHandler; seconds at millions of indices).
        self._recorded = Records(len(dataset))
        self._generation = 0
        self._followed = False  # a handler takes the records (else they are not kept twice)
        self.rank: int = 0
        self.num_replicas: int = 1
        # The epoch order minus processed indices, as of the last reset (no padding); its list
        # is made when asked for (remaining_indices).
        self._remaining = torch.empty(0, dtype=torch.int64)
        self._remaining_list: list[int] | None = None
        # This rank's partition of the remaining indices (padded or cut, see class doc); its
        # list is made when asked for (indices): a pass reads it in slices.
        self._part = torch.empty(0, dtype=torch.int64)
        self._part_list: list[int] | None = None
        # The epoch order last drawn, by (length, shuffle, seed, epoch): a restore and the sync
        # after it partition the same epoch (a permutation of 20M takes 0.7 s).
        self._order: tuple[tuple[int, bool, int, int], torch.Tensor] | None = None
        # Length of the leading part of ``indices`` that is processed: where the next pass
        # over the sampler resumes.
        self._consumed = 0
        # Position in ``indices`` where the latest pass started; batch numbers passed to
        # record_batch count from here.
        self._pass_start = 0
        self._repeat_said = -1  # the epoch whose repeated pass was last warned of
        self.reset()

    # ------------------------------------------------------------------ partitioning

    def reset(self) -> None:
        """Re-read rank and world size, and repartition the unprocessed indices.

        Call on every rank after the processed set was merged (or restored), and after
        the world changed. The next pass over the sampler starts at this rank's new
        partition.
        """
        self.rank, self.num_replicas = self._read_world()
        order = self._epoch_order()
        self._remaining = order[self._done().keep_mask(order)]
        self._remaining_list = None
        self._part = self._equalised(self._remaining)[self.rank :: self.num_replicas].contiguous()
        self._part_list = None
        self._consumed = 0
        self._pass_start = 0

    @property
    def indices(self) -> list[int]:
        """This rank's partition of ``remaining_indices`` (padded or cut, see the class doc)."""
        if self._part_list is None:
            self._part_list = to_list(self._part)
        return self._part_list

    @property
    def remaining_indices(self) -> list[int]:
        """The epoch order minus the processed indices, as of the last reset (no padding)."""
        if self._remaining_list is None:
            self._remaining_list = to_list(self._remaining)
        return self._remaining_list

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: forget the processed set, reshuffle and repartition."""
        self.epoch = int(epoch)
        self._replace_processed(IndexSet(len(self.dataset)))
        self.reset()

    def _done(self) -> IndexSet:
        """The processed set as an :class:`IndexSet` of the dataset's length; a plain set the
        script assigned to ``processed_indices`` is taken in (and replaces it)."""
        done = self.processed_indices
        n = len(self.dataset)
        if not (isinstance(done, IndexSet) and done.n == n):
            done = IndexSet(n, done)
            self.processed_indices = done
        return done

    def _read_world(self) -> tuple[int, int]:
        provider = self._world if self._world is not None else _world_provider
        rank, size = provider()
        rank, size = int(rank), int(size)
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"invalid world: rank {rank} of size {size}")
        return rank, size

    def _epoch_order(self) -> torch.Tensor:
        """The order of this epoch; the same on every rank for the same seed and epoch."""
        n = len(self.dataset)
        key = (n, bool(self.shuffle), int(self.seed), self.epoch)
        if self._order is not None and self._order[0] == key:
            return self._order[1]
        if not self.shuffle:
            order = torch.arange(n, dtype=torch.int64)
        else:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=generator)
        self._order = (key, order)
        return order

    def _equalised(self, remaining: torch.Tensor) -> torch.Tensor:
        """Pad (or cut, with drop_last) ``remaining`` to a multiple of the world size."""
        n, k = self.num_replicas, remaining.numel()
        if self.drop_last:
            return remaining[: k - k % n]
        total = -(-k // n) * n
        if total == k:
            return remaining
        if total - k <= k:  # the first few again
            return torch.cat((remaining, remaining[: total - k]))
        # Repeated from the start: fewer indices remain than there are ranks.
        return remaining.repeat(-(-total // k))[:total]

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[int]:
        """Yield this rank's indices, skipping the ones already recorded since the reset.

        So a pass restarted without a reset does not repeat processed work; batch numbers
        given to :meth:`record_batch` count from the start of this pass. A pass over an epoch
        whose every index is recorded, with no :meth:`set_epoch` since, hands out the same
        indices again, as Horovod's sampler (and torch's DistributedSampler) does: a script
        that forgets ``set_epoch`` trains on repeated data, never silently on none.
        """
        total = self._part.numel()
        if total and self._consumed >= total:
            if self._repeat_said != self.epoch:
                self._repeat_said = self.epoch
                log.warning("ElasticSampler: another pass over epoch %d, whose samples were all recorded, without "
                            "set_epoch(): the same samples again (as Horovod's sampler does); call "
                            "sampler.set_epoch(epoch) when an epoch starts", self.epoch)
            self._pass_start = 0
            return _ints(self._part, 0)
        self._pass_start = self._consumed
        return _ints(self._part, self._consumed)

    def __len__(self) -> int:
        """Number of indices of this pass: fixed when it starts, as Horovod's ``num_samples``
        is between resets (a learning-rate warmup computes ``batch_idx / len(loader)`` at every
        step: a length that shrank as batches were recorded made it run ahead)."""
        return self._part.numel() - self._pass_start

    # ------------------------------------------------------------------ recording

    @property
    def processed_num(self) -> int:
        """Samples of this epoch recorded as processed (Horovod's name): this rank's since the
        last commit, and every rank's before it (commits merge them). Horovod's counts
        ``batch_size x size`` per recorded batch; this counts the samples themselves."""
        return len(self.processed_indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """The dataset indices of batch ``batch_idx`` of the current pass on this rank.

        Right after :meth:`reset` the pass starts at the beginning of the partition, so
        this is ``indices[batch_idx * batch_size : (batch_idx + 1) * batch_size]``.
        """
        if batch_idx < 0 or batch_size < 1:
            raise ValueError(f"invalid batch {batch_idx} of size {batch_size}")
        start = self._pass_start + batch_idx * batch_size
        return self._part[start : start + batch_size].tolist()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark this rank's batch ``batch_idx`` (of the current pass) as processed."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices: Iterable[int]) -> None:
        """Mark explicit dataset indices as processed (idempotent)."""
        checked = self._checked(indices)
        self._done().put_checked(checked)
        if self._followed:
            if self._recorded.n != len(self.dataset):  # (the dataset grew: the handler compares all)
                self._recorded = Records(len(self.dataset))
                self._generation += 1
            self._recorded.add(checked)
        self._advance()

    def _replace_processed(self, processed: IndexSet) -> None:
        self.processed_indices = processed
        self._recorded = Records(len(self.dataset))
        self._generation += 1

    def _take_recorded(self) -> tuple[int, Records]:
        """(generation, what was recorded since the last call); starts the next record."""
        recorded, self._recorded = self._recorded, Records(len(self.dataset))
        self._followed = True
        return self._generation, recorded

    def merge_processed(self, other_indices: Iterable[int]) -> None:
        """Add another rank's processed indices (union). Call :meth:`reset` afterwards,
        on every rank, so the partitions reflect the merged set."""
        self.record_indices(other_indices)

    def _checked(self, indices: Iterable[int]) -> list[int] | torch.Tensor:
        """``indices`` checked to lie in the dataset: a list while they are few (a batch), an
        int64 tensor for thousands (another rank's news at a commit: a list comprehension over
        millions took seconds)."""
        n = len(self.dataset)
        if isinstance(indices, torch.Tensor) or (isinstance(indices, (list, tuple, range)) and len(indices) >= index_set.SMALL):
            return checked_int64(indices, n)
        out = [int(i) for i in indices]
        bad = [i for i in out if not 0 <= i < n]
        if bad:
            raise ValueError(f"indices out of range for a dataset of {n}: {bad[:5]}")
        return out

    def _advance(self) -> None:
        """Move past the partition's leading indices that are processed: a window at a time,
        growing (it runs at every recorded batch, and after a merge of millions)."""
        part, c, total = self._part, self._consumed, self._part.numel()
        if c >= total:
            return
        done = self._done()._view()
        window = 1024
        while c < total:
            missing = (done[part[c:c + window]] == 0).nonzero()
            if missing.numel():
                c += int(missing[0])
                break
            c += window
            window = min(window * 2, SLICE)
        self._consumed = min(c, total)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Epoch and processed indices as plain, picklable data (a sorted list of ints)."""
        return {"epoch": self.epoch, "processed_indices": self._done().sorted_list()}

    def _durable_state_dict(self) -> dict[str, Any]:
        """What a durable copy saves: the processed set as one bit per sample in a uint8 tensor,
        which the copy writes raw beside the model (a list of millions of ints was pickled in one
        call holding the GIL: seconds at 20M). :meth:`load_state_dict` reads it."""
        done = self._done()
        return {"epoch": self.epoch, "dataset_length": done.n, "processed_bits": done.packed_tensor()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Replace epoch and processed set with ``state_dict``'s, then :meth:`reset`.

        Horovod's sampler saves ``{"epoch", "processed_num"}`` instead: the first
        ``processed_num`` indices of its epoch order, which it draws with
        ``random.Random(seed + epoch)``. A checkpoint a Horovod job saved is read that way, so
        the samples it trained in that epoch are not trained again (and none is skipped)."""
        epoch = int(state_dict["epoch"])
        n = len(self.dataset)
        if "processed_indices" not in state_dict and "processed_num" in state_dict:
            processed = IndexSet(n, self._horovod_order(epoch)[:max(0, int(state_dict["processed_num"]))])
        elif "processed_indices" not in state_dict and "processed_bits" in state_dict:
            saved_n = int(state_dict["dataset_length"])
            if saved_n != n:
                raise ValueError(f"the saved sampler state is of a dataset of {saved_n} samples; this sampler's "
                                 f"dataset has {n}")
            processed = IndexSet.unpacked(n, state_dict["processed_bits"])
        else:
            processed = IndexSet(n, state_dict["processed_indices"])
        self._load(epoch, processed)

    def _load(self, epoch: int, processed: IndexSet) -> None:
        """Take ``processed`` (not copied) as epoch ``epoch``'s set and repartition."""
        self.epoch = epoch
        self._replace_processed(processed)
        self.reset()

    def _horovod_order(self, epoch: int) -> list[int]:
        """Horovod's epoch order (its ElasticSampler.reset): what a Horovod checkpoint's
        ``processed_num`` counts from."""
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    @property
    def num_samples(self) -> int:
        """Indices this rank is given between two resets (Horovod's attribute)."""
        return self._part.numel()

    @property
    def total_size(self) -> int:
        """``num_samples`` over every rank (Horovod's attribute): the remaining indices, padded."""
        return self._part.numel() * self.num_replicas
