"""Which checkpoint every rank loads: each rank verifies what it reads, one small vote decides.

Every rank reads a checkpoint from its own view of the file system -- another
host's disk, another node's cache of a shared one -- so a copy damaged on
one host is seen by the rank there alone. Loading therefore goes, for each
checkpoint from the newest:

1. every rank reads the files it needs itself and verifies them as it
   reads them (:mod:`ddpctx.checkpoint.sums`); no rank reads another
   rank's files only to verify them;
2. the ranks exchange what they found in **one 1-element collective**
   (then a gather of the :class:`Finding` s, only when some rank found
   one): a damaged or torn file on any rank makes every rank skip the
   checkpoint together and try the next older one --
   rank 0 warns naming the file and the rank that found it, and that rank
   warns too; a file refused as unsafe on any rank (pickled code) is an
   error on every rank, never a silent skip.

A sharded checkpoint's shards are read after that agreement, and what the
ranks found reading them is agreed the same way (a second vote).

The first vote also carries the files the checkpoint's manifest lists that a
rank's view lacks (:mod:`ddpctx.checkpoint.listed`): a file that **every**
rank lacks is missing from the checkpoint, which every rank then skips as
damaged, warned naming the file; one that some rank holds is no finding (the
ranks may not share a file system). This is the decision of the one-process
readers (``checkpoint_meta``, ``load_weights``, the export), which require every
listed file in the one directory they read: where the ranks share it, all
readers pick the same checkpoint.

A rank killed or interrupted while the others wait in a vote is named by
them (:mod:`ddpctx.reduce.rollcall`), not left to the transport's "Connection
closed by peer".

This module knows ranks only through a :class:`~ddpctx.utils.identity.Place`.

Example:
    >>> finding_of(Damaged("/c/a.pt", "'a.pt' is missing"))
    Finding(kind='damaged', file='/c/a.pt', message="'a.pt' is missing", lacking=())
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ddpctx.checkpoint.files import RefusedCheckpoint
from ddpctx.checkpoint.listed import missing_said
from ddpctx.checkpoint.sums import Damaged, Torn, damaged_warning, remember_damaged
from ddpctx.reduce.objects import all_gather_rare
from ddpctx.reduce.rollcall import ROLL_CALL_S, is_peer_gone, missing_ranks, who_left_text
from ddpctx.utils.identity import Place
from ddpctx.utils.warn import warn_user

T = TypeVar("T")


@dataclass(frozen=True)
class Finding:
    """What one rank found wrong reading a checkpoint: ``kind`` of ``file``, and why."""

    kind: str  # "damaged", "torn", "refused", "failed" (any other error), or "lacking"
    file: str
    message: str
    lacking: tuple[str, ...] = ()  # "lacking": the listed files this rank's view lacks


def finding_of(error: BaseException) -> Finding | None:
    """The finding an error of reading a checkpoint stands for; None for any other error."""
    if isinstance(error, Torn):
        return Finding("torn", error.file, error.reason)
    if isinstance(error, Damaged):
        return Finding("damaged", error.file, error.reason)
    if isinstance(error, RefusedCheckpoint):
        return Finding("refused", "", str(error))
    return None


def read_together(
    place: Place,
    where: Path,
    manifest: Path,
    read: Callable[[], T],
    lacking: Callable[[T], tuple[str, ...]] = lambda _: (),
) -> tuple[bool, T | None]:
    """``read()`` on every rank (its own files), then one gather: whether ``where`` is whole.

    ``lacking``: the files the manifest lists that this rank's view lacks, from what
    ``read`` returned. (True, its value) when no rank found anything, or some files
    lacking on some ranks only; (False, None) on every rank when some rank found a
    file damaged or torn, or a listed file is lacking on every rank (warned, see
    :func:`whole`).
    Refused on any rank: ``RefusedCheckpoint`` on every rank; another error on
    some rank: that error there, and a ``RuntimeError`` naming it on the others
    (never a rank left waiting in the gather).
    """
    found: Finding | None = None
    value: T | None = None
    failure: Exception | None = None
    try:
        value = read()
        if names := lacking(value):
            found = Finding("lacking", str(where), "", names)
    except (Damaged, RefusedCheckpoint) as error:
        found = finding_of(error)
    except Exception as error:
        failure = error
        found = Finding("failed", "", f"{type(error).__name__}: {error}")
    findings = agree(place, found, where)
    if failure is not None:
        raise failure
    if not whole(place, where, manifest, findings):
        return False, None
    return True, value


def agree(place: Place, mine: Finding | None, where: Path | None = None) -> dict[int, Finding]:
    """Every rank's finding, rank -> finding, for the ranks that found one.

    One 1-element collective when no rank found anything; a gather after it otherwise.
    A rank that left meanwhile (killed, interrupted) is named: :func:`lost_rank`.
    """
    if place.world_size == 1:
        return {} if mine is None else {place.rank: mine}
    try:
        everyone = all_gather_rare(mine)
    except Exception as error:
        if not is_peer_gone(error):
            raise
        raise lost_rank(place, where, error) from error
    return {rank: found for rank, found in enumerate(everyone) if found is not None}


def lost_rank(place: Place, where: Path | None, error: BaseException) -> RuntimeError:
    """The error of a vote whose peer went away, naming the rank(s) that left.

    Keeps the transport's words (they mark it as a consequence of another
    rank's failure for the reports of ``launch()`` and the pytest plugin).
    """
    missing = missing_ranks(place.rank, place.world_size)
    loading = "a checkpoint" if where is None else repr(str(where))
    if missing:
        who = who_left_text(missing)
        them = "it" if len(missing) == 1 else "they"
        said = (
            f"{who} left the job while the ranks loaded {loading}: {them} did not answer a "
            f"roll call within {ROLL_CALL_S:g} s after rank {place.rank}'s vote lost its "
            f"connection ({them} was killed, interrupted or crashed -- see {who}'s own log "
            "and exit status -- or is stuck where it cannot answer)."
        )
    else:
        said = (
            f"a rank left the job while the ranks loaded {loading} (which one could not be "
            "told: the job's store is unreachable too)."
        )
    return RuntimeError(
        f"{said} No rank loaded it; the checkpoint itself is intact: start the job again "
        f"on every rank to resume from it. The connection's error on rank {place.rank}: {error}"
    )


def whole(place: Place, where: Path, manifest: Path, findings: dict[int, Finding]) -> bool:
    """Whether ``where`` may be loaded, given every rank's ``findings`` (the same on every rank).

    Refused on any rank: :class:`RefusedCheckpoint` on every rank. Damaged or torn
    on any, or a listed file lacking on every rank: False on every rank, with a
    warning on rank 0 and on each rank that found it, naming the file and the rank.
    """
    findings = missing_everywhere(place, where, findings)
    if not findings:
        return True
    failed = sorted((rank, f) for rank, f in findings.items() if f.kind == "failed")
    if failed:
        rank, finding = failed[0]
        raise RuntimeError(
            f"rank {rank} failed to read {str(where)!r} ({finding.message}), so no rank loads "
            "it; see that rank's error."
        )
    refused = sorted((rank, f) for rank, f in findings.items() if f.kind == "refused")
    if refused:
        rank, finding = refused[0]
        said = finding.message if place.world_size == 1 else f"rank {rank}: {finding.message}"
        raise RefusedCheckpoint(said)
    if place.rank == 0:
        remember_damaged(where)  # pruning will not count it as a checkpoint that loads
    if place.rank == 0 or place.rank in findings:
        rank = place.rank if place.rank in findings else min(findings)
        warn_user(_skipped(where, manifest, findings, rank, place.world_size), RuntimeWarning)
    return False


def missing_everywhere(
    place: Place, where: Path, findings: dict[int, Finding]
) -> dict[int, Finding]:
    """``findings`` with the ranks' lacking files decided: missing when every rank lacks them.

    A file that some rank holds is no finding: the ranks may not share a file system.
    """
    lacking = [set(f.lacking) for f in findings.values() if f.kind == "lacking"]
    decided = {rank: f for rank, f in findings.items() if f.kind != "lacking"}
    if len(lacking) < place.world_size or not (gone := set.intersection(*lacking)):
        return decided
    first = where / min(gone)
    said = missing_said(gone, place.world_size)
    return {rank: Finding("damaged", str(first), said) for rank in range(place.world_size)}


def _skipped(
    where: Path, manifest: Path, findings: dict[int, Finding], rank: int, world_size: int
) -> str:
    """The warning: the finding of ``rank``, naming the ranks unless every rank found it."""
    finding = findings[rank]
    others = sorted(set(findings) - {rank})
    also = f"; rank(s) {', '.join(map(str, others))} found it too" if others else ""
    found_by = None if len(findings) == world_size else rank  # every rank: nothing to tell
    if finding.kind != "torn":
        return damaged_warning(where, finding.message, manifest, found_by, also)
    by = "" if found_by is None else f" (found by rank {found_by}, reading its copy{also})"
    return (
        f"skipping {str(where)!r}: it is torn: {finding.message}{by}; trying an older checkpoint."
    )
