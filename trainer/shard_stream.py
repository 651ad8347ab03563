"""The trainer's item order when the shards are streamed (``data.stream=true``) rather than loaded before step 1.

By default the trainer reads every item of its shards before the first step and draws each epoch as a permutation
of all of them (``runtime.ItemStream``). For a dataset of many shards that means downloading (and caching) all of it
first, and holding every item's metadata. Here the items come from ``ShardDataset`` as the shards are read, the way
WebDataset training is usually fed: per epoch the shard order is permuted with ``(run.seed, epoch)`` and items are
interleaved within a buffer of ``data.shuffle_buffer`` videos of the shard being read. Remote shards go through the
disk cache one at a time as they are reached, the next one downloading meanwhile (``shard_cache.ShardFetcher``).

Every rank reads the same stream and takes its share of each global batch, as with the loaded order, so the batches
do not depend on the number of ranks. The position (epoch, shard, items taken from it) is saved with each checkpoint;
a resume replays the current shard up to it (at most one shard is read twice).
"""
from __future__ import annotations

import logging

from longreel.trainer.data import ShardDataset, ShardError, local_path, resolve_shards
from longreel.trainer.preflight import InputCheckError

log = logging.getLogger("longreel.trainer")

__all__ = ["ShardItemStream", "STREAM_STATE_KIND"]

STREAM_STATE_KIND = "shard_stream"


class ShardItemStream:
    """Items in streaming order, with :class:`runtime.ItemStream`'s interface (``next_batch``, ``state_dict``,
    ``load_state_dict``).

    Args:
        urls: ``data.train_urls`` (URLs, brace patterns, local globs or a wids index).
        seed, shuffle: the order's seed and whether to permute shards and interleave items.
        shuffle_buffer: videos interleaved within a shard.
        on_error: ``"raise"`` or ``"skip"`` (bad samples and shards are skipped with a warning each).
        cache_dir: where remote shards are cached when reached (None: streamed over the network, frames in RAM).
        retries: tries again of a cache download, or without the cache of a shard's read, that failed in transport
            (``shard_cache._download``, ``remote_read.read_remote_shard``).
    """

    def __init__(self, urls: list[str], *, seed: int, shuffle: bool = True, shuffle_buffer: int = 16,
                 on_error: str = "raise", cache_dir: str | None = None, retries: int = 3):
        from longreel.trainer.shard_cache import ShardFetcher

        self.fetcher = ShardFetcher(cache_dir, retries) if cache_dir else None
        self.ds = ShardDataset(resolve_shards(list(urls)), shuffle=shuffle, seed=seed, epochs=1, rank=0,
                               world_size=1, on_error=on_error, shuffle_buffer=shuffle_buffer, fetch=self.fetcher,
                               retries=0 if cache_dir else retries)
        remote = sum(1 for spec in self.ds.shards if local_path(spec.url) is None)
        log.info("data.stream: %d shard(s) read as a stream (seed %d, shuffle %s, buffer %d videos)%s",
                 len(self.ds.shards), seed, shuffle, shuffle_buffer,
                 f"; {remote} remote shard(s) cached in {cache_dir} as they are reached" if cache_dir and remote
                 else "")
        self.epoch = 0
        self.drawn = 0  # items drawn so far: the index of the next one
        self._it = None
        self._fresh_epoch = True  # the current pass started at the epoch's first shard
        self._pass_items = 0

    def _next_item(self) -> dict:
        while True:
            if self._it is None:
                self.ds.set_epoch(self.epoch)
                self._it = iter(self.ds)
                self._pass_items = 0
            try:
                item = next(self._it)
            except ShardError as e:
                raise InputCheckError(f"{e} (data.on_error=skip skips and counts bad samples and shards)") from e
            except StopIteration:
                self._it = None
                if self._fresh_epoch and not self._pass_items:  # a whole epoch without an item: so is every next one
                    raise InputCheckError("no training items in data.train_urls (the shards hold no item, or every "
                                          f"sample was skipped: {self.ds.stats.errors[-3:]})") from None
                self.epoch += 1
                self._fresh_epoch = True
                continue
            self._pass_items += 1
            return item

    def next_batch(self, size: int) -> list[tuple[int, dict]]:
        """The next ``size`` items as ``(index in the stream, item)``; crosses epoch boundaries."""
        out = []
        for _ in range(size):
            out.append((self.drawn, self._next_item()))
            self.drawn += 1
        return out

    def state_dict(self) -> dict:
        return {"kind": STREAM_STATE_KIND, "epoch": self.epoch, "drawn": self.drawn, "dataset": self.ds.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != STREAM_STATE_KIND:
            raise InputCheckError("the checkpoint's loader state is not a streaming one (data.stream differs from the "
                                  "run that saved it)")
        try:
            self.ds.load_state_dict(state["dataset"])
        except ValueError as e:
            raise InputCheckError(f"the shard stream {e} (a resume needs the shards and seed of the run that saved "
                                  "it)") from e
        self.epoch, self.drawn = int(state["epoch"]), int(state["drawn"])
        self._it = None
        position = state["dataset"].get("positions", {}).get("0")
        self._fresh_epoch = not position or tuple(position[1:]) == (0, 0)

    def close(self) -> None:
        if self.fetcher is not None:
            self.fetcher.close()
