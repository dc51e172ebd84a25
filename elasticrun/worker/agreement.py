"""What every rank submitted to a collective, and the error when they disagree (pure).

gloo and NCCL match collectives by the order they are issued in, not by what they carry:
ranks that pass different dtypes, shapes or roots to "the same" collective make gloo abort the
process, hang until the collective timeout, or return garbage. Horovod negotiates every tensor
first and raises the same error on every rank. elasticrun does the same in the cheapest way it
can (``issuing.agree``): each rank reduces a 128-bit digest of its *signature* (what must
match: the kind of collective, its name, op, dtype, shapes, root, process set) with MAX, and
its negation too, in one tiny allreduce; the ranks agree when every maximum equals the
matching minimum. Only when they do not, the full signatures are gathered to say which ranks
differed in what. The alltoall carries the digest in the exchange of split counts it makes
anyway (:func:`words`), so it pays nothing.

No torch, no I/O: signatures are plain tuples and dicts.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping, Sequence

from elasticrun.common.ranks import rank_list

__all__ = ["CollectiveMismatch", "words", "message"]


class CollectiveMismatch(RuntimeError):
    """The ranks called one collective with different arguments. Raised on every rank at the
    same call (as Horovod raises its error on every rank); nothing was exchanged, so the
    process and its group stay usable for the next collective. ``signatures``: each rank's
    (by ``ranks``), for a caller that decides who was off the script."""

    def __init__(self, text: str, signatures: Sequence[Mapping[str, Any] | None] = (),
                 ranks: Sequence[int] = ()):
        super().__init__(text)
        self.signatures = list(signatures)
        self.ranks = list(ranks)


def words(signature: Mapping[str, Any]) -> tuple[int, int]:
    """Two non-negative 62-bit integers digesting ``signature`` (the same on every rank for the
    same signature, whatever the process: no ``hash()`` salt)."""
    text = repr(sorted(signature.items())).encode()
    d = hashlib.blake2b(text, digest_size=16).digest()
    return int.from_bytes(d[:8], "little") >> 2, int.from_bytes(d[8:], "little") >> 2


def message(signatures: Sequence[Mapping[str, Any] | None], ranks: Sequence[int]) -> str:
    """One line, the same on every rank (it is made of the gathered signatures only), naming
    what differed and each rank's value of it (``None``: a rank in join(), which takes any):
    ``allreduce: the ranks called it with different arguments ...: shape (rank 0: (2, 3); rank 1: (3, 3))``."""
    given = [(r, s) for r, s in zip(ranks, signatures) if s is not None]
    kinds = {s.get("collective") for _, s in given}
    what = str(kinds.pop()) if len(kinds) == 1 else "a collective"
    keys = sorted({k for _, s in given for k in s} - {"hint"})
    if len({_show(s.get("collective")) for _, s in given}) > 1:
        keys = ["collective"]  # different collectives: their arguments differ too, and say nothing
    parts = []
    for key in keys:
        values = [s.get(key) for _, s in given]
        if any(v != values[0] for v in values):
            groups: dict[str, list[int]] = {}
            for (r, s) in given:
                groups.setdefault(_show(s.get(key)), []).append(r)
            shown = "; ".join(f"{rank_list(rs)}: {v}" for v, rs in groups.items())
            parts.append(f"{key} ({shown})")
    detail = ", ".join(parts) if parts else "their arguments (the digests differ)"
    # A signature may carry advice for the case it is typically mismatched in (said in full).
    hints = sorted({str(s["hint"]) for _, s in given if s.get("hint")})
    # The advice first: the driver's line of a failure keeps its first 500 characters.
    return (f"{what}: the ranks called it with different arguments, so it did not run: {detail}. "
            + "".join(f"{h}. " for h in hints) + "Every rank must call the same collectives, in the same order, "
            "with the same dtype, shape (or split count), root and process set")


def _show(value: Any) -> str:
    text = str(value).replace("torch.", "")
    return text if len(text) <= 80 else text[:77] + "..."
