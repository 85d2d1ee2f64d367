"""The proof's power, measured: break prepared graphs on purpose, count what the proof catches.

    python3 tools/proof_power.py MODEL[,MODEL...] [--dtype float32,float16] [--sync-trials 50]
        [--war-trials 20] [--share-trials 20] [--launches 25] [--fuzz-launches 200]
        [--fuzz-budget 3.0] [--seed 0] [--json FILE]

Each model is prepared (its recording kept), then each trial breaks one thing in a
verification copy of the served phases, built from the recording over the same arena:

* ``sync``: one random cross-stream synchronization edge of the schedule removed;
* ``war``: one edge of the schedule whose only reason is a write-after-read hazard removed (the
  edge's first task reads bytes the second writes, and neither writes what the other reads);
* ``share``: two buffers whose lifetimes overlap in recorded order forced onto the same arena
  bytes (the second moved to the first's offset).

The static plan check (:func:`nimble.analysis.plan_check.check_plan`) decides first whether the
change can be exposed at all: where it still passes (another path orders every conflicting
access; the lifetimes do not overlap in the schedule), the trial is *redundant* and counted apart
with that reason.  Every *needed* trial runs the proof on the broken copy: ``--launches`` poisoned
launches alternating two input sets, as ``prepare()`` does (caught without the fuzzer), then the
fuzz launches (:mod:`nimble.engine.fuzz`: a delay-noded copy with the same change, a fresh draw
before each, at most ``--fuzz-launches``, for at most ``--fuzz-budget`` times the time
``prepare()``'s own served proof took, as ``prepare()`` gives its fuzzer; the targeted draws see
the copy's arena offsets, moved buffers included, but not the change).  Each trial the fuzzer
caught is credited to the kind of draw of the launch that failed.  Two kinds of needed trial
the static view cannot judge are marked *apart* (:func:`apart`) and their catch rate shown
beside the rest's: a removed sync whose every race is two TaskGraph writes of bytes nothing
else touches afterwards (:func:`write_write_only`: the graph cannot say whether either kernel
also reads), and two buffers sharing bytes where one task touches both (:func:`one_task`: no
order of tasks can change what that kernel does; only its own access pattern decides).
Prints one table per model and dtype, and a progress line per trial with the time so far;
seeded, so a run repeats.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

from nimble.analysis.deps import dag_from_edges, reachability
from nimble.analysis.memplan import MemPlan, MemPlanError
from nimble.analysis.plan_check import check_plan, collect_accesses
from nimble.engine.proof import FUZZ_TIME_FACTOR
from nimble.engine.proving import FUZZ_ROWS
from nimble.ir.taskgraph import BufferKind, TaskGraph

KINDS = ("sync", "war", "share")


@dataclass(frozen=True)
class Change:
    """What one trial breaks: schedule edges removed, or buffers moved to other arena offsets."""

    kind: str
    removed_edges: frozenset = frozenset()
    moved: tuple[tuple[int, int], ...] = ()  # (buffer, arena offset)
    onto: int = -1  # the buffer whose bytes the moved one now shares

    def describe(self) -> str:
        if self.kind == "share":
            return ", ".join(f"buffer {b} moved onto buffer {self.onto} (offset {o})"
                             for b, o in self.moved)
        return ", ".join(f"edge {u}->{v} removed" for u, v in sorted(self.removed_edges))


# ---- choosing and classifying changes (no GPU) ----------------------------------------------

def _ranges(graph: TaskGraph, offsets: dict[int, int], task: int) -> list[tuple]:
    """``(space, lo, hi, write)`` per access of ``task``: planned buffers in arena bytes (which
    buffers sharing bytes have in common), the others in their own buffer's bytes."""
    out = []
    for a in graph.tasks[task].accesses:
        if a.size <= 0:
            continue
        if a.buffer in offsets:
            lo = offsets[a.buffer] + a.offset
            out.append(("arena", lo, lo + a.size, a.write))
        else:
            out.append((a.buffer, a.offset, a.end, a.write))
    return out


def war_only_edges(graph: TaskGraph, edges: Sequence[tuple[int, int]],
                   plan: MemPlan) -> list[tuple[int, int]]:
    """The edges ``(u, v)`` whose only hazard is write-after-read: ``u`` reads bytes ``v``
    writes, and no byte ``u`` writes is touched by ``v`` (no read- or write-after-write)."""
    found = []
    for u, v in edges:
        war = other = False
        for space, lo, hi, write in _ranges(graph, plan.offsets, u):
            for space2, lo2, hi2, write2 in _ranges(graph, plan.offsets, v):
                if space != space2 or hi <= lo2 or hi2 <= lo:
                    continue
                if write:
                    other = True
                elif write2:
                    war = True
        if war and not other:
            found.append((u, v))
    return found


def lifetimes(graph: TaskGraph) -> dict[int, tuple[int, int]]:
    """``buffer -> (first task, last task)`` touching it, for the intermediates and scratch."""
    spans: dict[int, tuple[int, int]] = {}
    for t in graph.tasks:
        for a in t.accesses:
            if a.size > 0 and graph.buffers[a.buffer].kind in (BufferKind.INTERMEDIATE,
                                                               BufferKind.SCRATCH):
                lo, hi = spans.get(a.buffer, (t.id, t.id))
                spans[a.buffer] = (min(lo, t.id), max(hi, t.id))
    return spans


def share_changes(graph: TaskGraph, plan: MemPlan, rng: random.Random,
                  count: int) -> list[Change]:
    """Up to ``count`` changes each moving one buffer onto another whose lifetime overlaps its
    own in recorded order (and whose offset leaves it inside the arena)."""
    live = {b: s for b, s in lifetimes(graph).items() if b in plan.offsets}
    ids = sorted(live)
    changes: list[Change] = []
    seen = set()
    for _ in range(50 * max(count, 1)):
        if len(changes) >= count or len(ids) < 2:
            break
        a, b = rng.sample(ids, 2)
        (a0, a1), (b0, b1) = live[a], live[b]
        offset = plan.offsets[a]
        if (a, b) in seen or a1 < b0 or b1 < a0 or offset == plan.offsets[b] \
                or offset + graph.buffers[b].size > plan.arena_bytes:
            continue
        seen.add((a, b))
        changes.append(Change("share", moved=((b, offset),), onto=a))
    return changes


def edge_changes(kind: str, edges: Sequence[tuple[int, int]], rng: random.Random,
                 count: int) -> list[Change]:
    """Up to ``count`` of ``edges``, drawn without repeats, each removed alone."""
    picked = rng.sample(list(edges), min(count, len(edges)))
    return [Change(kind, removed_edges=frozenset({e})) for e in picked]


def needed(graph: TaskGraph, edges: Sequence[tuple[int, int]], plan: MemPlan,
           change: Change) -> tuple[bool, str]:
    """``(needed, reason)``: whether the plan check finds the race or overlap ``change``
    makes (its message), or why the change is redundant."""
    kept = [e for e in edges if e not in change.removed_edges]
    offsets = dict(plan.offsets)
    offsets.update(change.moved)
    try:
        check_plan(graph, kept, dataclasses.replace(plan, offsets=offsets))
    except MemPlanError as e:
        return True, str(e)
    if change.kind == "share":
        return False, "the plan check passes: every access of one buffer is ordered before " \
                      "every access of the other in the schedule"
    return False, "the plan check passes: other edges order every conflicting access"


def write_write_only(graph: TaskGraph, edges: Sequence[tuple[int, int]], plan: MemPlan,
                     change: Change) -> str:
    """What a removed sync edge's races are, when each is of one kind, or ``""``.

    Non-empty when every pair of accesses the removal leaves unordered is two TaskGraph writes
    of common bytes of one buffer that no third task from the earlier of the two on accesses,
    that no graph output holds, and that no other buffer shares in the arena.  A TaskGraph write
    means read-write (a kernel's own reads of its op's output are not known), so such a race
    shows at an output only if one of the two also reads what the other wrote, which the graph
    cannot say: the category tells the removals the static view cannot judge from the others,
    and is reported beside the catch rate, not taken out of it.  Other kinds of change: ``""``.
    """
    if change.kind != "sync":
        return ""
    n = len(graph.tasks)
    kept = [e for e in edges if e not in change.removed_edges]
    before = reachability(dag_from_edges(n, edges, ordered=False))
    after = reachability(dag_from_edges(n, kept, ordered=False))

    def loose(a: int, b: int) -> bool:
        lo, hi = min(a, b), max(a, b)
        return bool((before[lo] >> hi | before[hi] >> lo) & 1) and \
            not (after[lo] >> hi | after[hi] >> lo) & 1

    by_buffer, arena = collect_accesses(graph, dict(plan.offsets))
    outputs = {(o.buffer) for o in graph.outputs}
    found = []
    for buf, accs in by_buffer.items():
        for i, (lo1, hi1, t1, w1) in enumerate(accs):
            for lo2, hi2, t2, w2 in accs[i + 1:]:
                if t1 == t2 or not (lo1 < hi2 and lo2 < hi1) or not (w1 or w2) or \
                        not loose(t1, t2):
                    continue
                if not (w1 and w2) or buf in outputs:
                    return ""
                lo, hi, first = max(lo1, lo2), min(hi1, hi2), min(t1, t2)
                if any(t not in (t1, t2) and t > first and lo3 < hi and lo < hi3
                       for lo3, hi3, t, _ in accs):
                    return ""
                found.append((t1, t2, buf, lo, hi))
    for i, (lo1, hi1, t1, b1, _) in enumerate(arena):
        for lo2, hi2, t2, b2, _ in arena[i + 1:]:
            if b1 != b2 and lo1 < hi2 and lo2 < hi1 and loose(t1, t2):
                return ""
    if not found:
        return ""
    t1, t2, buf, lo, hi = found[0]
    return (f"{len(found)} unordered pair(s), each two writes of bytes no other task touches "
            f"afterwards, e.g. tasks {t1} and {t2} on buffer {buf} bytes [{lo}, {hi})")


def one_task(change: Change, reason: str) -> str:
    """For a shared-bytes trial whose overlap the plan check finds within one task (it names
    the same task on both buffers), why no order of tasks can expose it; else ``""``."""
    found = re.search(r"task (\d+) \(on buffer \d+\) does not happen-before task (\d+)",
                      reason)
    if change.kind != "share" or not found or found.group(1) != found.group(2):
        return ""
    return (f"task {found.group(1)} touches both buffers: no order of tasks changes what it "
            "does with them")


def apart(graph: TaskGraph, edges: Sequence[tuple[int, int]], plan: MemPlan,
          change: Change, reason: str) -> str:
    """Why a needed trial is counted apart (:func:`write_write_only`, :func:`one_task`), or
    ``""``."""
    return write_write_only(graph, edges, plan, change) or one_task(change, reason)


def plan_trials(graph: TaskGraph, schedule, plan: MemPlan, seed: int,
                counts: dict[str, int]) -> list[Change]:
    """The seeded trials of each kind (``counts[kind]`` of each)."""
    rng = random.Random(seed)
    edges = schedule.edges()
    trials = edge_changes("sync", schedule.sync_edges, rng, counts.get("sync", 0))
    trials += edge_changes("war", war_only_edges(graph, edges, plan), rng,
                           counts.get("war", 0))
    trials += share_changes(graph, plan, rng, counts.get("share", 0))
    return trials


# ---- running the proof on a broken copy (GPU) -----------------------------------------------

@dataclass
class Trial:
    change: Change
    needed: bool
    reason: str
    caught_plain: bool = False
    caught_fuzz: bool = False
    seconds_plain: float = 0.0
    seconds_fuzz: float = 0.0  # the whole proof with the fuzzer (plain launches included)
    message: str = ""
    caught_by: str = ""  # "plain", or the kind of draw of the fuzz launch that failed
    fuzz_launches: int = 0  # the fuzz launches run (up to the failing one)
    apart: str = ""  # why the static view cannot judge it, where it cannot (see apart)

    def as_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["change"] = {"kind": self.change.kind, "what": self.change.describe()}
        return d


def copy_builder(prepared, rec):
    """A builder of verification copies of the served phases from the recorded nodes (moved
    buffers need the recorded memset and memcpy endpoints)."""
    return dataclasses.replace(prepared.phase_builder(), nodes=[rec.nodes] * len(
        prepared.builts), nodes_relocated=False)


def options_of(prepared, change: Change):
    from nimble.engine.rebuild import PhaseOptions

    bases = None
    if change.moved:
        bases = list(prepared.bases)
        for buffer, offset in change.moved:
            bases[buffer] = prepared.arena_base + offset
    return PhaseOptions(removed_edges=change.removed_edges, bases=bases)


def poison_all(prepared) -> None:
    from nimble.engine import proof
    from nimble.engine.proving import low_word_ranges

    proof.poison(proof.poison_ranges(prepared.graph)
                 + [(prepared.arena_base, prepared.memplan.arena_bytes)]
                 + low_word_ranges(prepared), prepared.launcher.stream())


@dataclass
class Outcome:
    """What the proof did on one broken copy."""

    caught_by: str = ""  # "plain", a kind of draw, or "" (not caught)
    seconds_plain: float = 0.0
    seconds_fuzz: float = 0.0  # the whole proof with the fuzzer (plain launches included)
    fuzz_launches: int = 0
    message: str = ""


def offsets_of(prepared, change: Change) -> dict[int, int]:
    """The planned buffers' arena offsets in the copy ``change`` breaks."""
    offsets = dict(prepared.memplan.offsets)
    offsets.update(change.moved)
    return offsets


def run_trial(prepared, rec, reference, change: Change, launches: int, fuzz_launches: int,
              seed: int, fuzz_budget: float) -> Outcome:
    """The proof on ``prepared``'s phases broken by ``change``: ``launches`` plain launches,
    then fuzz launches for ``fuzz_budget`` times prepare()'s served proof."""
    import torch

    from nimble.engine.fuzz import FuzzCopies
    from nimble.engine.proof import FuzzBudget
    from nimble.errors import VerificationError

    builder, options = copy_builder(prepared, rec), options_of(prepared, change)
    device = rec.static_inputs[0].device
    began = time.perf_counter()
    poison_all(prepared)
    plain = FuzzCopies(builder, prepared.launchers, device, options=options, delays=False)
    try:
        reference.launches(plain.run, launches)
    except VerificationError as e:
        torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        return Outcome("plain", seconds, seconds, 0, str(e))
    finally:
        plain.close()
    torch.cuda.synchronize()
    outcome = Outcome(seconds_plain=time.perf_counter() - began)
    fuzz_began = time.perf_counter()
    copies = FuzzCopies(builder, prepared.launchers, device, seed=seed, options=options,
                        stream_of=prepared.schedule.stream_of,
                        repoison=[(prepared.arena_base, prepared.memplan.arena_bytes)],
                        offsets=offsets_of(prepared, change),
                        rows=min(fuzz_launches, FUZZ_ROWS))
    try:
        budget = FuzzBudget(fuzz_launches, time_factor=fuzz_budget,
                            spent_seconds=time.perf_counter() - fuzz_began,
                            at_least=copies.required or 4)
        # The fuzz part gets the time prepare() gives it: a multiple of prepare's own served
        # proof (100 launches), not of this trial's shorter one.
        reference.fuzz_launches(copies, budget, prepared.seconds.get("verify_served",
                                                                     outcome.seconds_plain))
    except VerificationError as e:
        outcome.caught_by, outcome.message = copies.stats.last_kind, str(e)
    finally:
        outcome.fuzz_launches = copies.stats.launches
        copies.close()
    torch.cuda.synchronize()
    outcome.seconds_fuzz = outcome.seconds_plain + time.perf_counter() - fuzz_began
    return outcome


@dataclass
class Summary:
    model: str
    dtype: str
    trials: list[Trial] = field(default_factory=list)
    proof_seconds: dict = field(default_factory=dict)  # prepare()'s own proof, both parts
    fuzz_launches: int = 0  # the fuzz launches prepare()'s own proof ran
    verified: dict = field(default_factory=dict)  # prepare()'s graph.meta["verified"]

    def rows(self) -> list[list[str]]:
        rows = []
        for kind in KINDS:
            mine = [t for t in self.trials if t.change.kind == kind]
            need = [t for t in mine if t.needed]
            if not mine:
                continue
            mean = (lambda xs: sum(xs) / len(xs) if xs else 0.0)
            ww = [t for t in need if t.apart]
            rest = [t for t in need if not t.apart]
            rows.append([kind, str(len(mine)), str(len(mine) - len(need)), str(len(need)),
                         str(len(ww)),
                         f"{sum(t.caught_plain for t in need)}/{len(need)}",
                         f"{sum(t.caught_fuzz for t in need)}/{len(need)}",
                         f"{sum(t.caught_fuzz for t in ww)}/{len(ww)} | "
                         f"{sum(t.caught_fuzz for t in rest)}/{len(rest)}",
                         f"{mean([t.seconds_plain for t in need]):.2f}",
                         f"{mean([t.seconds_fuzz for t in need]):.2f}",
                         f"{mean([t.fuzz_launches for t in need]):.0f}",
                         by_draw_kind(need)])
        return rows


def by_draw_kind(trials: Sequence[Trial]) -> str:
    """How many of ``trials`` the fuzzer caught, per kind of the draw that caught them."""
    counts: dict[str, int] = {}
    for t in trials:
        if t.caught_fuzz and not t.caught_plain:
            counts[t.caught_by] = counts.get(t.caught_by, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "-"


HEADER = ["kind", "trials", "redundant", "needed", "apart", "caught w/o fuzz",
          "caught w/ fuzz", "w/ fuzz: apart | rest", "proof s w/o", "proof s w/",
          "fuzz launches", "fuzz catches by draw"]


def table(summary: Summary) -> str:
    rows = [HEADER] + summary.rows()
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = [f"{summary.model} {summary.dtype}: prepare()'s proof "
             + ", ".join(f"{k} {v:.2f} s" for k, v in summary.proof_seconds.items())
             + f"; {summary.fuzz_launches} fuzz launches, targets held back "
             f"{summary.verified.get('fuzz_targets_held', 0)}/"
             f"{summary.verified.get('fuzz_targets', 0)}"]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def measure(name: str, dtype: str, counts: dict[str, int], launches: int,
            fuzz_launches: int, seed: int, say=print,
            fuzz_budget: float = FUZZ_TIME_FACTOR) -> Summary:
    """Prepare ``name`` in ``dtype`` and run the trials ``counts`` asks for."""
    import torch

    import nimble
    from nimble.cli import models
    from nimble.driver.gpu import use_cudnn_benchmark
    from nimble.engine.proof import Reference

    use_cudnn_benchmark()
    model = models.create(name).cuda().eval().to(getattr(torch, dtype))
    x = models.example_input(name).to(getattr(torch, dtype))
    nm = nimble.Nimble(model).prepare(
        x, quiet=True, options=nimble.PrepareOptions(keep_recording=True))
    try:
        prepared, rec = nm.engine, nm.recording
        summary = Summary(name, dtype, proof_seconds={
            k: v for k, v in prepared.seconds.items() if k.startswith("verify")},
            fuzz_launches=prepared.graph.meta["verified"]["fuzz_launches"],
            verified=dict(prepared.graph.meta["verified"]))
        reference = Reference.record(prepared.graph, rec.replay_reference, rec.static_inputs,
                                     seed=seed)
        edges = prepared.schedule.edges()
        trials = plan_trials(prepared.graph, prepared.schedule, prepared.memplan, seed, counts)
        started = time.perf_counter()
        for i, change in enumerate(trials):
            is_needed, reason = needed(prepared.graph, edges, prepared.memplan, change)
            trial = Trial(change, is_needed, reason, apart=apart(
                prepared.graph, edges, prepared.memplan, change, reason) if is_needed else "")
            if is_needed:
                outcome = run_trial(prepared, rec, reference, change, launches, fuzz_launches,
                                    seed + i, fuzz_budget)
                trial.caught_plain = outcome.caught_by == "plain"
                trial.caught_fuzz = bool(outcome.caught_by)
                trial.caught_by, trial.message = outcome.caught_by, outcome.message
                trial.seconds_plain, trial.seconds_fuzz = outcome.seconds_plain, \
                    outcome.seconds_fuzz
                trial.fuzz_launches = outcome.fuzz_launches
            summary.trials.append(trial)
            spent = time.perf_counter() - started
            say(f"  {name} {dtype} trial {i + 1}/{len(trials)} ({change.kind}): "
                + ("redundant" if not is_needed else
                   "caught" if trial.caught_plain else
                   f"caught by the fuzzer ({trial.caught_by} draw, launch "
                   f"{trial.fuzz_launches})" if trial.caught_fuzz else
                   f"NOT caught ({trial.fuzz_launches} fuzz launches)")
                + (f" [apart: {trial.apart}]" if trial.apart else "")
                + f"  [{spent:.0f} s, about {spent / (i + 1) * (len(trials) - i - 1):.0f} s "
                  "left for this model]")
        return summary
    finally:
        nm.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models")
    parser.add_argument("--dtype", default="float32,float16")
    parser.add_argument("--sync-trials", type=int, default=50)
    parser.add_argument("--war-trials", type=int, default=20)
    parser.add_argument("--share-trials", type=int, default=20)
    parser.add_argument("--launches", type=int, default=25,
                        help="poisoned launches of each broken copy (prepare() runs 100)")
    parser.add_argument("--fuzz-launches", type=int, default=200,
                        help="fuzz launches at most after them (as prepare(); the time "
                             "--fuzz-budget gives the fuzzer also bounds them)")
    parser.add_argument("--fuzz-budget", type=float, default=FUZZ_TIME_FACTOR,
                        help="the fuzz part's time as a multiple of prepare()'s served proof "
                             "(default: prepare()'s own, nimble.engine.proof.FUZZ_TIME_FACTOR)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every trial to this file")
    args = parser.parse_args(argv)
    counts = {"sync": args.sync_trials, "war": args.war_trials, "share": args.share_trials}

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
    summaries = []
    for name in args.models.split(","):
        for dtype in args.dtype.split(","):
            say(f"{name} {dtype}: preparing")
            summary = measure(name, dtype, counts, args.launches, args.fuzz_launches,
                              args.seed, say, args.fuzz_budget)
            summaries.append(summary)
            print(table(summary), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"model": s.model, "dtype": s.dtype, "proof_seconds": s.proof_seconds,
                        "fuzz_budget": args.fuzz_budget, "verified": s.verified,
                        "trials": [t.as_json() for t in s.trials]} for s in summaries], f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
