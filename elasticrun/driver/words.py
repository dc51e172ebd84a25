"""The console's words for what the registry decided: the one place they are written.

The registry (``registry.py``) returns its decisions as data: an :class:`~registry.Event` is a
:class:`Kind` with fields, and every reason (a worker's failure, a dismissal, a kill, an
aborted round, the job's end, what carries CUDA tensors) is a :class:`Reason`: a
:class:`Cause` with fields. The driver shell words them here, for the console and for the
event log's ``message``; tests read the same words. Changing a line the user reads is a change
to this file only, and a kind or cause without words fails ``tests/unit/test_words.py``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol

from elasticrun.common.events import Cause, Kind, Reason
from elasticrun.common.ranks import rank_list


class Said(Protocol):
    """What carries an event: the registry's ``Event`` (a kind and its fields)."""

    @property
    def kind(self) -> Kind: ...

    @property
    def fields(self) -> Mapping[str, Any]: ...


def event(e: Said) -> str:
    """The console line for an event of the registry."""
    return _EVENTS[e.kind](e.fields)


def reason(r: Reason) -> str:
    """The words for a reason (a clause: "exited with code 3", "the job has finished")."""
    return _REASONS[r.cause](r.fields)


def plain(fields: Mapping[str, Any]) -> dict[str, Any]:
    """An event's fields as the event log keeps them: reasons worded, the rest as it is."""
    return {k: reason(v) if isinstance(v, Reason) else v for k, v in fields.items()}


# --- helpers ---------------------------------------------------------------------------------
#: How many hosts a line names before it counts the rest: a job of a thousand hosts must not
#: write lines of ten thousand characters.
MAX_NAMED = 8

NEVER_STARTED = "never started: "
#: The same, for a host that did not answer (refused, no route, no answer): the registry tells a
#: machine that is gone or not up yet from a configuration that fails on every host by it.
UNREACHABLE = NEVER_STARTED + "unreachable: "


def never_started(why: str, unreachable: bool = False) -> str:
    """The exit detail of a worker the driver could not start (worded without an exit code)."""
    return (UNREACHABLE if unreachable else NEVER_STARTED) + why


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_NAMED])
    return shown + (f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else "")


def _hosts(hosts: Any) -> str:
    return _some(list(hosts))


def kept(kept: tuple[str, tuple[str, ...]] | None, min_np: int) -> str:
    """The status line's words for the going hosts a round keeps (``Registry.kept``): the
    warning said so once, and a user who looks later sees them still in the round."""
    if kept is None:
        return ""
    why, hosts = kept
    if why == "min_np":
        return f"; host(s) {_hosts(hosts)} still in, for --min-np {min_np}, until enough new workers are ready"
    return f"; host(s) {_hosts(hosts)} still in: their workers hold the state until new workers can take it over"


def held_out(out: Mapping[str, str], kept: tuple[str, tuple[str, ...]] | None) -> str:
    """The status line's words for hosts discovery lists that the round does not use
    (``Registry.held_out``), but those it keeps (said by :func:`kept`): a job training on 2 of
    4 listed hosts for minutes said only "2 worker(s) on 2 host(s)"."""
    shown = {h: why for h, why in out.items() if kept is None or h not in kept[1]}
    return _held({"out": shown})


def _never_enough(f: Mapping[str, Any]) -> str:
    """A fixed host list short of slots for good: what is left, what went, and what would help
    (a host that is leaving, reclaimed, is not helped by a cooldown)."""
    leaving = f.get("leaving") or []
    gone = f"blacklisted: {_hosts(f['blacklisted']) or 'none'}" + (f"; leaving: {_hosts(leaving)}" if leaving else "")
    helps = ("--blacklist-cooldown-range lets failed hosts return, " if f["blacklisted"] else "") + \
        ("a discovery script lets new hosts in, " if leaving else "")
    return (f"{f['flag']} {f['need']} can never be met again: usable hosts {_usable(f['usable'])} ({gone}); "
            f"with a fixed host list and permanent blacklisting no host can come back ({helps}a lower "
            f"{f['flag']} lets the job go on with fewer)")


def _timed_out(f: Any) -> str:
    """A wait that ran out: for slots, or (slots enough) for workers to ask for a place."""
    head = f"timed out after {f['limit']:g} s ({f['flag']}) waiting for {f['need']} "
    if sum(s for _, s in f["usable"]) >= f["need"] and "ready" in f:
        return (head + f"ready worker(s) (had {f['ready']}: the others started did not ask for a place in time: "
                f"still starting, or preparing before their first sync); usable hosts: {_usable(f['usable'])}{_held(f)}")
    return head + f"slots; usable hosts: {_usable(f['usable'])}{_held(f)}"


def _slots(n: int) -> str:
    """"1 slot", "4 slots"."""
    return f"{n} slot" if n == 1 else f"{n} slots"


def _usable(available: Any) -> str:
    """``[(host, slots), ...]`` as "a:2, b:1" ("none" when empty)."""
    return _some([f"{h}:{s}" for h, s in available]) or "none"


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''} {'was' if n == 1 else 'were'}"


def _blacklisted(f: Mapping[str, Any]) -> str:
    seconds = f.get("seconds")
    if f.get("over"):  # said late (held while the round settled): its cooldown already ended
        return f"host {f['host']} was blacklisted for {seconds:.1f} s (that cooldown is already over)"
    when = "permanently" if seconds is None else f"for {seconds:.1f} s"
    return f"host {f['host']} blacklisted {when}" + (" (a straggler)" if f.get("straggler") else "")


def straggler(f: Mapping[str, Any]) -> str:
    """How a straggler host is named (``stragglers.Straggler.fields()``: figures in ms)."""
    against = "the other host" if f["others"] == 1 else "median of the others"
    return (f"host {f['host']} is a straggler: {f['compute_ms']:.0f} ms of compute per step against "
            f"{f['reference_ms']:.0f} ms ({against}) over the last {f['steps']} steps")


def _straggler_event(f: Mapping[str, Any]) -> str:
    action = f["action"]
    if action == "recovered":
        return f"host {f['host']} is no longer a straggler"
    if action == "evicted":
        return (f"{straggler(f)}; evicting it (--evict-stragglers): its workers leave at their next commit, "
                f"without a rollback")
    if action == "kept":
        return f"{straggler(f)}; {reason(f['kept'])}"
    return straggler(f) + (" (--evict-stragglers would move it out)" if f.get("hint") else "")


def _whitelisted(f: Mapping[str, Any]) -> str:
    if f.get("because") == "collapse":
        # Only a host already named blacklisted gets this line, so its failure came first, while
        # others still trained: saying "lost at once" would be untrue.
        return (f"host {f['host']} is let back: since it failed, every other worker has been lost too, which is "
                f"no one host's fault")
    return f"host {f['host']} is back after its blacklist cooldown"


#: Why a member's host is going (registry._why_gone), as the console says it.
_GOING = {
    "leaving": "leaving (a worker there got SIGTERM: the host is kept out until discovery stops listing it and "
               "lists it again)",
    "leaving_fixed": "leaving (a worker there got SIGTERM: no new worker starts there)",  # (-H: no discovery)
    "draining": "listed draining by discovery",
    "blacklisted": "blacklisted",
    "undiscovered": "no longer listed by discovery",
    "resized": "now listed with fewer slots",
    "unusable": "unusable",
}


def _going(f: Mapping[str, Any]) -> str:
    """``hosts`` grouped by why they are going: "a, b no longer listed by discovery; c leaving (...)"."""
    why = f.get("why") or {}
    groups: dict[str, list[str]] = {}
    for h in f["hosts"]:
        groups.setdefault(why.get(h, "unusable"), []).append(h)
    return "; ".join(f"{_hosts(hosts)} {_GOING.get(w, w)}" for w, hosts in groups.items())


def _held(f: Mapping[str, Any]) -> str:
    """"; listed but not used: ..." for hosts discovery lists that the job leaves out ("" if none)."""
    out = f.get("out") or {}
    return f"; listed but not used: {_going({'hosts': list(out), 'why': out})}" if out else ""


_EVENTS: dict[Kind, Callable[[Mapping[str, Any]], str]] = {
    Kind.DISCOVERY_EMPTY: lambda f: ("discovery listed no hosts (empty output, or only invalid lines); keeping the "
                                     "last known hosts"),
    Kind.HOST_DRAINING: lambda f: (f"host {f['host']} is about to go (discovery lists it draining): its workers "
                                   f"leave at their next commit"),
    Kind.HOST_WHITELISTED: _whitelisted,
    Kind.HOST_ADDED: lambda f: f"host {f['host']} added ({_slots(f['slots'])})",
    Kind.HOST_REMOVED: lambda f: f"host {f['host']} removed",
    Kind.HOST_RESIZED: lambda f: f"host {f['host']} now has {_slots(f['slots'])}",
    Kind.HOSTS_MORE: lambda f: ("and in the same listing, not named: "
                                + ", ".join(f"{f[k]} more host(s) {w}" for k, w in (
                                    ("added", "added"), ("removed", "removed"), ("resized", "resized"),
                                    ("whitelisted", "back after their cooldown")) if f.get(k))),
    Kind.HOST_LEAVING: lambda f: f"host {f['host']} leaving ({f['why']})",
    Kind.HOST_BLACKLISTED: _blacklisted,
    Kind.STRAGGLER: _straggler_event,
    Kind.WORKER_SUCCEEDED: lambda f: f"{f['label']} (rank {f['rank']}) {'exited 0' if f.get('plain') else 'finished'}",
    Kind.WORKER_FAILED: lambda f: f"{f['label']} (rank {f['rank']}) {reason(f['why'])}",
    Kind.PLAIN_COMMAND: lambda f: (f"no worker called hvd.init() within --start-timeout {f['limit']:g} s: running "
                                   f"them as plain processes (each runs to its end; the job fails if one fails)"),
    Kind.ELASTIC_AFTER_ALL: lambda f: (f"{f['label']} called hvd.init() after all ({f['seconds']:.0f} s after its "
                                       f"start): the job is elastic again (a failed worker is recovered from)"),
    Kind.HANDOVER_PENDING: lambda f: (f"the workers holding the job's state are on host(s) {_going(f)}: "
                                      f"they keep training until new workers are ready to take the state over"),
    Kind.REMOVAL_HELD: lambda f: (f"host(s) {_going(f)}, but without them fewer than --min-np {f['min_np']} "
                                  f"workers are ready: they keep training until enough are"),
    Kind.HOSTS_UPDATED: lambda f: (f"{'handing the state over' if f['handover'] else 'membership changing'}"
                                   f"{' again, now' if f.get('again') else ''} from {f['from_size']} to "
                                   f"{f['to_size']} worker(s)"
                                   + (" (hosts added and removed)" if f['added'] and f['removed'] else "")),
    Kind.NP_NEVER: lambda f: (f"-np {f['np']} can never be met: a listed host failed and none can come back; "
                              f"starting with {f['reachable']} (--min-np {f['min_np']})"),
    Kind.NP_NOT_MET: lambda f: (f"discovery listed {f['reachable']} usable slot(s), not -np {f['np']}, within "
                                f"--elastic-timeout {f['limit']:g} s: starting with {f['reachable']} (--min-np "
                                f"{f['min_np']}); hosts listed later join the job"),
    Kind.NONE_REACHED: lambda f: (f"no listed host could be reached ({_some(list(f['hosts']))}): waiting up to "
                                  f"--elastic-timeout {f['limit']:g} s for discovery to list others"),
    Kind.WORKERS_LOST: lambda f: ((f"the durable copy of commit {f['commit']} is now whole: the job resumes from it, "
                                   f"not from commit {f['was']}") if f.get("was") is not None else
                                  (f"every worker is gone; waiting up to --elastic-timeout {f['limit']:g} s for "
                                   f"--min-np {f['min_np']} slots to resume from the durable copy of commit "
                                   f"{f['commit']}")),
    Kind.WAITING_FOR_SLOTS: lambda f: (f"waiting for {f['need']} ready worker(s) (have {f['ready']}; usable hosts: "
                                       f"{_usable(f['usable'])}{_held(f)}); "
                                       + (f"in {f['left_s']:.0f} s ({f['flag']}) the job starts with the slots usable "
                                          f"then if they are --min-np {f['min_np']} or more, else gives up"
                                          if f.get("min_np") is not None else
                                          f"giving up in {f['left_s']:.0f} s ({f['flag']})")),
    Kind.STATE_LOST: lambda f: (f"round {f['round']} starts without any worker that held the job's state: every "
                                f"holder is gone. The new workers start from what the script loads (its initial "
                                f"state or its own checkpoint); training since then is redone"),
    Kind.ABORT_PENDING: lambda f: (f"round {f['round']} was aborted {f['seconds']:.0f} s ago"
                                   f"{' (' + reason(f['why']) + ')' if f.get('why') is not None else ''}; still "
                                   f"waiting for "
                                   + ", ".join(f"rank {r} ({label})" for r, label in f["ranks"])
                                   + (f" and {f['more']} more" if f.get("more") else "")
                                   + " to leave it, at their next collective or commit: one stuck where no "
                                     "abort reaches holds the job (see docs/troubleshooting.md)"),
    Kind.ROUND_STALLED: lambda f: (f"round {f['round']}: {f['waiting']} rank(s) have waited {f['waited']:.0f} "
                                   f"s in a collective for "
                                   + ", ".join(f"rank {r} ({label})" for r, label in f["ranks"])
                                   + (f" and {f['more']} more" if f.get("more") else "")
                                   + (", which is" if len(f["ranks"]) == 1 and not f.get("more") else ", which are")
                                   + " in none: busy alone (evaluating, saving or loading data on one rank, a print "
                                     "blocked on a console or SSH channel nobody reads) or stuck; the round waits "
                                     "(see docs/troubleshooting.md)"),
    Kind.ROUND_DIVERGED: lambda f: (f"round {f['round']}: every rank has waited {f['waited']:.0f} "
                                    f"s in a collective, but not the same one: "
                                    + "; ".join(f"{rank_list(ranks)} in {op}" for op, ranks in f["groups"])
                                    + (f" and {f['more']} more" if f.get("more") else "")
                                    + ". The ranks' scripts took different paths (a commit or a collective on some "
                                      "ranks only, steps counted apart after join(), a process set registered with "
                                      "other ranks); each waits up to "
                                    + (" or ".join(f"{u} s" for u in f["until"]) if f.get("until")
                                       else "its --collective-timeout")
                                    + " (see docs/troubleshooting.md)"),
    Kind.ROUND_FORMED: lambda f: (f"round {f['round']}: {f['size']} worker(s) on {len(f['hosts'])} host(s)"),
    Kind.DEVICE_BACKEND: lambda f: (("CUDA tensors go over NCCL" if f["backend"] == "nccl" else "CUDA tensors go over gloo")
                                    + f" in round {f['round']} ({reason(f['why'])})"),
}


def _failures(failed: Any, ranked: bool) -> str:
    def how(why: Reason | None) -> str:
        return reason(why) if why is not None else "failed"

    if ranked:
        return "; ".join(f"rank {rank} ({label}) {how(why)}" for rank, label, why in failed)
    return "; ".join(f"{label} {how(why)}" for label, why in failed)


def _ended_early(f: Mapping[str, Any]) -> str:
    ended = f"exited 0 at step {f['steps']}" if f["steps"] >= 0 else "exited 0"
    ranks = ", ".join(map(str, f["unfinished"]))
    return (f"rank {f['rank']} {ended} while {_ranks(f['training'])} training: the job ends there, as "
            f"Horovod's does when one worker succeeds; rank(s) {ranks} did not finish training")


def _keep_slower(f: Mapping[str, Any]) -> str:
    it = "it" if f["count"] == 1 else "them"
    return (f"not evicted: without {it}, {f['left']} worker(s) at about {f['after'] * 1000:.0f} ms a step would "
            f"train fewer samples per second than {f['workers']} at {f['step'] * 1000:.0f} ms")


_REASONS: dict[Cause, Callable[[Mapping[str, Any]], str]] = {
    # (A detail that is never_started()'s is the driver's: no process ran, so no code is shown.)
    Cause.EXITED: lambda f: (str(f["detail"]) if str(f.get("detail", "")).startswith(NEVER_STARTED)
                             else f"exited with code {f['code']}" + (f": {f['detail']}" if f.get("detail") else "")),
    Cause.SCRIPT_ERROR: lambda f: f"failed: {f['error']}",
    Cause.NEVER_CONTACTED: lambda f: f"did not contact the driver within --start-timeout {f['limit']:g} s",
    Cause.STUCK_EXITING: lambda f: (f"ended its script but its process did not exit within {f['grace']:g} s "
                                    f"(stuck in the interpreter's teardown: Python waits at exit for the non-daemon "
                                    f"threads and multiprocessing children the script started); killed"),
    Cause.SILENT: lambda f: (f"sent no heartbeat for {f['silent_s']:.1f} s (--heartbeat-timeout {f['limit']:g} s); "
                             f"it is hung or unreachable"),
    Cause.NOT_IN_JOB: lambda f: "this process is not part of the job",
    Cause.JOB_FINISHED: lambda f: "the job has finished",
    Cause.NO_PLACE_ANY_MORE: lambda f: "this process has no place in the job any more",
    Cause.NO_PLACE: lambda f: f"no place for {f['label']} in the next round",
    Cause.NOT_NEEDED: lambda f: f"{f['label']} is no longer needed",
    Cause.PEER_FAILED: lambda f: "another process of the job failed",
    Cause.LEFT_AFTER_ERROR: lambda f: f"{f['label']} left round {f['round']} after an error: {f['error']}",
    Cause.MEMBER_FAILED: lambda f: f"{f['label']} {reason(f['why'])}",
    Cause.FINISHED: lambda f: f"training finished after {f['rounds']} round(s), {f['resets']} reset(s)",
    Cause.ENDED_EARLY: _ended_early,
    Cause.SIGNALLED: lambda f: f"stopped by {f['signal']}",
    Cause.ALL_EXITED_0: lambda f: f"all {f['n']} process(es) exited 0",
    Cause.PROCESSES_FAILED: lambda f: _failures(f["failed"], ranked=True),
    Cause.FAILED_AFTER_SUCCESS: lambda f: f"{_failures(f['failed'], ranked=True)}, after rank {f['first']} finished",
    Cause.ALL_FAILED: lambda f: f"all workers failed ({_failures(f['failed'], ranked=False)})",
    Cause.ALL_BLACKLISTED: lambda f: f"every host is blacklisted after failures: {_hosts(f['hosts'])}",
    Cause.RESET_LIMIT: lambda f: (f"reset limit {f['limit']} exceeded: the job needed another reset after "
                                  f"{f['resets']} (raise --reset-limit to allow more)"),
    Cause.TIMED_OUT: lambda f: _timed_out(f),
    Cause.NEVER_ENOUGH: lambda f: _never_enough(f),
    Cause.NCCL_CANNOT_RUN: lambda f: (f"--backend nccl cannot run round {f['round']}: {reason(f['why'])} (NCCL needs "
                                      f"a GPU of its own per worker; use --backend auto or gloo)"),
    Cause.CANNOT_RESUME: lambda f: (f"cannot resume: {f['error']} (start over with --fresh, or point "
                                    f"--checkpoint-dir elsewhere)"),
    Cause.KEEP_MIN_NP: lambda f: (f"not evicted: without {'it' if f['count'] == 1 else 'them'} {f['left']} "
                                  f"worker(s) would be left, fewer than --min-np {f['min_np']}"),
    Cause.KEEP_SLOWER: _keep_slower,
    Cause.GLOO_ASKED: lambda f: "--backend gloo",
    Cause.NCCL_ASKED: lambda f: "--backend nccl",
    Cause.GPU_EACH: lambda f: "one GPU per worker",
    Cause.NO_GPU: lambda f: f"{f['place']} has no GPU NCCL can use",
    Cause.SHARED_GPU: lambda f: f"{' and '.join(f['places'][:2])} would share one GPU",
}
