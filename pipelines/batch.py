"""Many images into one folder: numbered files, a manifest, per-image seeds, resumable.

    from sparsevar.pipelines.batch import FolderRun, image_seed
    run = FolderRun("out/", settings={"model": "demo", "classes": [3, 7], "seed": 0})
    todo = run.todo([3, 7] * 8)                                 # (index, item) not on disk yet
    run.start()
    for part in (todo[k:k + 4] for k in range(0, len(todo), 4)):
        idx = [i for i, _ in part]
        out = pipe([c for _, c in part], generator=[torch.Generator().manual_seed(image_seed(0, i)) for i in idx])
        run.save(idx, out.images, [{"class": c} for _, c in part], "PNG")

(``sparsevar generate --out DIR/`` does this.)

Image ``i`` of a run is drawn from its own generator seeded by :func:`image_seed` (base seed, i), so
what lands in ``{i:05d}.png`` does not depend on the batch size or on which process drew it (a
batch draws each image's codes from that image's generator; pictures agree to float rounding).
Several processes (``accelerate launch``, or ``--num-processes``) each take every n-th batch of
what is left and append to the same manifest. A folder holds one run: ``run.json`` records its
settings and a rerun with other settings is refused naming the first that differs;
``manifest.jsonl`` gets one row per image (its item, seed, file and what the caller adds: the CLI
records the process, the image's share of the call's time and its batch's stats), appended after
the image is on disk, so an image counts as done when both its file and its row are there. Rerunning the same command skips
what is done and writes nothing for it.
"""
from __future__ import annotations

import json
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np

MANIFEST = "manifest.jsonl"
RUN_FILE = "run.json"


def image_seed(base_seed: int, index: int) -> int:
    """The seed of image ``index`` of a run with ``base_seed``: 63 bits of numpy's SeedSequence of
    (base_seed, index) — independent streams for neighbouring indices and seeds."""
    words = np.random.SeedSequence([int(base_seed), int(index)]).generate_state(2, np.uint32)
    return ((int(words[0]) << 32) | int(words[1])) & ((1 << 63) - 1)


def _index_of(line: str) -> Optional[int]:
    try:
        return int(json.loads(line)["index"])
    except (ValueError, KeyError, TypeError):
        return None


class FolderRun:
    """One run's folder: ``run.json`` (settings), ``{i:05d}.{ext}`` images, ``manifest.jsonl``.

    settings: what fixes the images (model, sampling, acceleration, base seed): JSON values. A folder
    that already holds a run with other settings raises ValueError naming the field.

    writers: encode and write the images on this many background threads (0: in :meth:`save`
    itself). Encoding a 1024² PNG takes longer on the CPU than drawing it on a GPU; with writers
    the next batch's generation overlaps the files of the last ones. Call :meth:`flush` at the end
    (:meth:`close` after an error)."""

    def __init__(self, folder, settings: dict, ext: str = "png", writers: int = 0):
        self.folder, self.settings, self.ext = Path(folder), dict(settings), ext
        self._stale: set = set()                  # manifest rows without their image (found by todo, dropped by start)
        self._pool = ThreadPoolExecutor(writers, thread_name_prefix="sparsevar-writer") if writers > 0 else None
        self._limit = 2 * writers                 # images in flight before save waits for the oldest batch
        self._pending: deque = deque()            # batches being written: (indices, rows, [(tmp, path)], futures)
        run_file = self.folder / RUN_FILE
        if run_file.is_file():
            saved = json.loads(run_file.read_text())
            for key in sorted(set(saved) | set(self.settings)):
                if saved.get(key) != self.settings.get(key):
                    raise ValueError(f"{self.folder} holds a run with {key}={saved.get(key)!r}, this one has "
                                     f"{key}={self.settings.get(key)!r}: use another folder to change the settings, "
                                     f"or rerun the same command to finish that run")

    def path(self, index: int) -> Path:
        return self.folder / f"{index:05d}.{self.ext}"

    def _row_indices(self) -> set[int]:
        manifest = self.folder / MANIFEST
        rows = set()
        if manifest.is_file():
            for line in manifest.read_text().splitlines():
                try:
                    rows.add(int(json.loads(line)["index"]))
                except (ValueError, KeyError, TypeError):
                    continue                            # a row cut short by an interrupted write
        return rows

    def done(self) -> set[int]:
        """Indices whose image file and manifest row are both there."""
        return {i for i in self._row_indices() if self.path(i).is_file()}

    def todo(self, items: Sequence[Any]) -> list[tuple[int, Any]]:
        """(index, item) of every item not done yet, in order."""
        rows = self._row_indices()
        done = {i for i in rows if self.path(i).is_file()}
        self._stale = rows - done                                  # rows whose image was lost: replaced at save
        return [(i, item) for i, item in enumerate(items) if i not in done]

    def start(self) -> None:
        """Make the folder, write ``run.json`` (once) and drop the manifest rows whose image was lost
        (found by :meth:`todo`; those images are drawn again). With several processes only the main
        one calls this, before the others write: from then on the manifest is only appended to."""
        self.folder.mkdir(parents=True, exist_ok=True)
        run_file = self.folder / RUN_FILE
        if not run_file.is_file():
            tmp = run_file.with_name(f".{RUN_FILE}.tmp")
            tmp.write_text(json.dumps(self.settings, indent=1) + "\n")
            os.replace(tmp, run_file)
        manifest = self.folder / MANIFEST
        if self._stale and manifest.is_file():
            kept = [ln for ln in manifest.read_text().splitlines(keepends=True)
                    if ln.strip() and _index_of(ln) not in self._stale]
            tmp = manifest.with_name(f".{MANIFEST}.tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, manifest)
            self._stale = set()

    def save(self, indices: Sequence[int], images: Sequence, rows: Iterable[dict], fmt: str) -> None:
        """Write the images (each under a temporary name, then renamed), then append their manifest
        rows in one write; ``rows`` are the per-image records without ``index`` / ``file``. With
        writers the images are written in the background and their rows appended once all of the
        batch's images are on disk (at a later ``save``, or at :meth:`flush`); ``save`` waits while
        more than twice as many images as writers are in flight."""
        tmps = [(self.path(i).with_name(f".{self.path(i).name}.tmp"), self.path(i)) for i in indices]
        rows = list(rows)
        if self._pool is None:
            try:
                for img, (tmp, _) in zip(images, tmps):
                    img.save(tmp, format=fmt)
            except BaseException:
                self._discard(tmps)
                raise
            self._finish(indices, rows, tmps)
            return
        futures = [self._pool.submit(img.save, tmp, format=fmt) for img, (tmp, _) in zip(images, tmps)]
        self._pending.append((list(indices), rows, tmps, futures))
        while sum(len(b[0]) for b in self._pending) > self._limit:
            self._complete_oldest()
        while self._pending and all(f.done() for f in self._pending[0][3]):
            self._complete_oldest()

    def flush(self) -> None:
        """Wait for the images in the background and append their rows."""
        while self._pending:
            self._complete_oldest()

    def close(self) -> None:
        """Stop the writers after an error or an interrupt: what is not on disk yet is dropped (no
        temporary file stays, no row is appended; a rerun draws those images again)."""
        if self._pool is None:
            return
        for *_, futures in self._pending:
            for f in futures:
                f.cancel()
        self._pool.shutdown(wait=True)
        while self._pending:
            self._discard(self._pending.popleft()[2])

    def _complete_oldest(self) -> None:
        indices, rows, tmps, futures = self._pending[0]
        try:
            for f in futures:
                f.result()
        except BaseException:
            self.close()
            raise
        self._pending.popleft()
        self._finish(indices, rows, tmps)

    @staticmethod
    def _discard(tmps) -> None:
        for tmp, _ in tmps:
            tmp.unlink(missing_ok=True)

    def _finish(self, indices, rows, tmps) -> None:
        """Rename a batch's written images into place, then append its rows in one write."""
        try:
            for tmp, p in tmps:
                os.replace(tmp, p)
        except BaseException:
            self._discard(tmps)
            raise
        lines = [json.dumps({"index": int(i), "file": self.path(i).name, **row}) + "\n" for i, row in zip(indices, rows)]
        with open(self.folder / MANIFEST, "a") as f:             # one write: appends of several processes stay whole
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())


__all__ = ["FolderRun", "image_seed", "MANIFEST", "RUN_FILE"]
