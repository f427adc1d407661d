"""A `torch.utils.data.DataLoader` read by shares, on any Keras backend.

A DataLoader's batch is the global batch, as in Keras'
`keras.distribution.distribute_dataset`. `shared_loader` rebuilds the
loader around a `RowShareBatchSampler`: the loader's own batch sampler
still draws the global batches' indices, and row `r` of `D` keeps the
`r`-th `1/D` of each, so the dataset's `__getitem__` runs only for this
row's samples. The shuffle is the first process's on every process: the
sampler's random generator is seeded with a seed drawn there.
"""

import copy

import torch
from torch.utils import data as torch_data
from torch.utils.data import DataLoader


def loader_share(loader, row, rows, training, first_process_seed):
    """`loader` rebuilt to read row `row`'s share of each global batch.

    Args:
        loader: a `DataLoader` of global batches.
        row: this process's data-parallel row.
        rows: the number of rows.
        training: whether `fit()` trains on it.
        first_process_seed: a function of this process's seed that returns
            the first process's (every process calls it, in one order).

    Returns:
        `(shared, reason)`: the rebuilt loader and `None`, or `None` and
        why the loader is read whole. A loader whose batches do not split
        over the rows is read whole for `predict()` and `evaluate()`,
        which pad such a batch (`keras_tp.runtime.padding`), and refused
        for training.
    """
    if is_shared(loader):
        return loader, None
    check_not_sampled_per_process(loader, rows)
    size = indivisible_size(loader, rows)
    if training and size is not None:
        raise indivisible_batch(size, rows)
    reason = unshareable_reason(loader, rows)
    if reason is not None:
        return None, reason
    return shared_loader(loader, row, rows, first_process_seed), None


def indivisible_batch(size, rows):
    """The error for a global batch of `size` samples over `rows` rows."""
    return ValueError(
        f"A batch of {size} samples cannot be shared evenly by "
        f"data_parallel={rows} rows: each data-parallel row reads 1/{rows} "
        "of every global batch. Give the DataLoader a batch_size that "
        f"divides by {rows}, and drop_last=True or a number of samples that "
        "the batch size divides."
    )


class RowShareBatchSampler(torch_data.Sampler):
    """Row `row`'s share of each index batch of `batch_sampler`.

    Args:
        batch_sampler: the loader's batch sampler (global batches).
        row: this process's data-parallel row.
        rows: the number of rows, `data_parallel`.
    """

    def __init__(self, batch_sampler, row, rows):
        self.batch_sampler = batch_sampler
        self.row = row
        self.rows = rows

    def __len__(self):
        return len(self.batch_sampler)

    def __iter__(self):
        for indices in self.batch_sampler:
            indices = list(indices)
            if len(indices) % self.rows:
                raise indivisible_batch(len(indices), self.rows)
            share = len(indices) // self.rows
            yield indices[self.row * share : (self.row + 1) * share]


def is_shared(loader):
    """Whether `loader` is already one row's share (`shared_loader`)."""
    return isinstance(loader.batch_sampler, RowShareBatchSampler)


def check_not_sampled_per_process(loader, rows):
    """Raises where `loader` already gives each process its own samples."""
    if isinstance(loader.sampler, torch_data.DistributedSampler):
        raise ValueError(
            "A DataLoader with a DistributedSampler was given to a model "
            f"with data_parallel={rows}: keras_tp shares each global batch "
            "between the data-parallel rows itself. Give every process the "
            "same DataLoader, without a DistributedSampler; its batch_size "
            "is the global batch."
        )


def unshareable_reason(loader, rows):
    """Why `loader` cannot be read by shares over `rows` rows, or `None`
    where it can."""
    if type(loader) is not DataLoader:
        return f"{type(loader).__name__} is not a plain DataLoader"
    if isinstance(loader.dataset, torch_data.IterableDataset):
        return "an IterableDataset has no indices to share"
    if loader.batch_sampler is None:
        return "the DataLoader does not batch (batch_size=None)"
    size = indivisible_size(loader, rows)
    if size is not None:
        return f"a batch of {size} samples does not split over {rows} rows"
    return None


def indivisible_size(loader, rows):
    """The size of a batch of `loader` that does not split over `rows`
    rows, where a `BatchSampler` tells it before the batch is read; else
    `None`."""
    batch_sampler = loader.batch_sampler
    if not isinstance(batch_sampler, torch_data.BatchSampler):
        return None
    size = batch_sampler.batch_size
    if size % rows:
        return size
    last = len(batch_sampler.sampler) % size
    if last % rows and not batch_sampler.drop_last:
        return last
    return None


def shared_loader(loader, row, rows, first_process_seed):
    """`loader` rebuilt to read row `row`'s share of each global batch.

    Args:
        loader: a `DataLoader` of global batches, which
            `unshareable_reason` accepts.
        row: this process's data-parallel row.
        rows: the number of rows, `data_parallel`.
        first_process_seed: a function of this process's seed that returns
            the first process's (every process calls it, in one order).

    Returns:
        A new `DataLoader` over the same dataset, with the same workers,
        collation and memory pinning, whose batches are this row's shares.
    """
    batch_sampler = _alike_everywhere(loader, first_process_seed)
    return DataLoader(
        loader.dataset,
        batch_sampler=RowShareBatchSampler(batch_sampler, row, rows),
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
        in_order=loader.in_order,
    )


def _alike_everywhere(loader, first_process_seed):
    """The loader's batch sampler, drawing the first process's shuffle.

    A random sampler (`shuffle=True`, or any sampler with a `generator`)
    is copied with a generator seeded by the first process, so every
    process draws the same global batches, epoch after epoch.
    """
    batch_sampler = loader.batch_sampler
    sampler = getattr(batch_sampler, "sampler", None)
    if not hasattr(sampler, "generator"):
        return batch_sampler
    if sampler.generator is None:
        # What RandomSampler draws its seed from when it has no generator.
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
    else:
        seed = int(torch.randint(2**62, (), generator=sampler.generator))
    sampler = copy.copy(sampler)
    sampler.generator = torch.Generator().manual_seed(first_process_seed(seed))
    batch_sampler = copy.copy(batch_sampler)
    batch_sampler.sampler = sampler
    return batch_sampler
