"""Training checkpoints with Orbax: the train state (params, optimizer state, step) and a JSON
record of everything else a resumed run needs (update number, data cursor, RNG seed, verifier
cache, the run's config).

Orbax writes each checkpoint to a temporary directory and renames it when complete, so a run
killed mid-save leaves no half checkpoint in the list; its temporary directory is removed when the
checkpoints are opened again. A checkpoint that is listed but cannot be read (a damaged file) is
skipped on restore, with a warning, for the newest one before it, and deleted, so that the redone
update is saved again. A save the file system refuses (a full disk, a quota, a file-size limit)
raises ``StorageError`` naming the reason and the checkpoint still intact; ``refused_writes`` does
the same for the run's other files.
"""

from __future__ import annotations

import errno
import logging
import os
import pathlib
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class CheckpointRestoreError(RuntimeError):
    pass


class StorageError(RuntimeError):
    """The file system refused a write of the run; what was saved before is intact."""


# How the write errors of Python, tensorstore (Orbax) and safetensors (Rust) name a refused write.
_REFUSED = re.compile(r"No space left on device|File too large|Disk quota exceeded")
_CODES = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


def _storage_fault(error: BaseException) -> str | None:
    """Why the file system refused a write, when ``error`` is such a refusal; else None."""
    if isinstance(error, OSError) and error.errno in _CODES:
        return os.strerror(error.errno)
    match = _REFUSED.search(str(error))
    return match.group(0) if match else None


RESUME = "free space there, then run again with --resume"


@contextmanager
def refused_writes(
    what: str,
    where: str | os.PathLike,
    then: str = f"the run's checkpoints are intact: {RESUME} to continue from the last one",
) -> Iterator[None]:
    """Turns a write the file system refuses in the block into a ``StorageError`` of one line:
    ``what`` could not be written to ``where``, the reason, and ``then`` (what is intact, what to do).
    Every other exception goes through as it is."""
    try:
        yield
    except Exception as error:
        reason = _storage_fault(error)
        if reason is None:
            raise
        # The reason is all the user needs of the writer's traceback (Orbax's is long).
        raise StorageError(f"{what} could not be written to {where} ({reason}); {then}") from None


class Checkpoints:
    def __init__(self, directory: str | os.PathLike, keep: int = 2):
        self.directory = pathlib.Path(directory).absolute()
        # cleanup_tmp_directories removes the temporary directory of a save that a killed process
        # left (in the background, from here; Orbax waits for it before its first save).
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False, cleanup_tmp_directories=True
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, update: int, state: Any, meta: dict) -> None:
        """Saves ``state`` (a pytree of arrays) and ``meta`` (JSON) as checkpoint ``update``."""
        # Listed before the save: Orbax deletes the checkpoints past ``keep`` only once a save is complete.
        kept = [step for step in self.steps() if step != update]
        intact = f"checkpoint {kept[-1]} is intact" if kept else "there is no earlier checkpoint"
        with refused_writes(f"checkpoint {update}", self.directory, f"{intact}: {RESUME}"):
            self._manager.save(
                update, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
            )
            self._manager.wait_until_finished()

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict] | None:
        """``(update, state, meta)`` of the newest readable checkpoint, or None if there is none.

        ``abstract_state`` gives shapes, dtypes and shardings (``jax.eval_shape`` of the state,
        with ``.sharding`` set). Unreadable checkpoints are reported and passed over.
        """
        steps = self.steps()
        for update in reversed(steps):
            try:
                restored = self._manager.restore(
                    update,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
                    ),
                )
                state, meta = restored["state"], restored["meta"]
                jax.block_until_ready(state)
            except Exception as err:  # damaged or partial files: fall back to an older checkpoint
                log.warning(
                    "checkpoint %d in %s is unreadable (%s: %s); trying an older one",
                    update,
                    self.directory,
                    type(err).__name__,
                    str(err).splitlines()[0][:200],
                )
                continue
            # The damaged ones after it go: Orbax skips a save whose step is not newer than the
            # latest it lists, so the redone updates would otherwise never be saved again.
            for damaged in (s for s in steps if s > update):
                self._manager.delete(damaged)
            return update, state, meta
        if steps:
            raise CheckpointRestoreError(f"no readable checkpoint in {self.directory} (tried {steps})")
        return None

    def close(self) -> None:
        self._manager.close()
