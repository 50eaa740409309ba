"""Writing benchmark results: atomically (an interrupted run leaves no half-written file)."""
from __future__ import annotations

import csv
import io
import os
import uuid
from pathlib import Path
from typing import Callable, Optional, Sequence


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write through a temporary file in the same folder, then rename it over ``path``."""
    # a unique name (not mkstemp, whose 0600 mode the renamed file would keep); the folder's umask applies
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_csv(rows: Sequence[dict], out, log: Optional[Callable[[str], None]] = None) -> Optional[Path]:
    """Rows (dicts with the same keys) as a CSV at ``out``, its folder created; nothing when there
    are no rows (every setting failed: the log already says why)."""
    if not rows:
        return None
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0].keys()), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    atomic_write(out, lambda p: p.write_text(buf.getvalue()))
    if log is not None:
        log(f"wrote {out}")
    return out
