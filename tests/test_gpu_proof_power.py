"""The proof catches a missing synchronization: googlenet fp16, needed sync edges removed one at
a time from a verification copy (tools/proof_power.py).  The race a removal opens shows when its
later task runs first: the serial orders of the broken copy (nimble.analysis.orders) each run
every task one after another, and one of them runs it first, so the order launches alone must
catch every removal.  The delays show it too: a copy with the writer held back by a delay node
must fail the proof, and the same delays on a copy with nothing removed must not (delays never
change the bytes); the targeted draws find those writers themselves, so the launches that hold
back every writer of a synchronization once catch the removals.  How often prepare's fuzzer,
within its time, finds such races is a measurement, not a test: ``tools/proof_power.py`` and
docs/findings.md.  The served graph carries no delay node and its proof records what the fuzzer
ran."""
from __future__ import annotations

import random
import re

import pytest

from helpers import load_tool, zoo_model

pytestmark = pytest.mark.gpu

EDGES = 5

#: The draws a targeted cover may take: enough for googlenet fp16's direct targets, writers
#: before a sync's source included, to be held back both ways (``python3
#: tools/experiments/fuzz_cover.py googlenet_float16`` says by which launch on the recorded
#: fixture; docs/findings.md).
COVER_ROWS = 400


def _power():
    return load_tool("proof_power")


def test_removed_sync_edges_are_caught_by_the_fuzzed_proof():
    import torch

    import nimble
    from nimble.driver import node_count
    from nimble.engine.proof import Reference

    power = _power()
    model, x = zoo_model("googlenet")
    model, x = model.half(), x.half()
    nm = nimble.Nimble(model).prepare(
        x, quiet=True, options=nimble.PrepareOptions(keep_recording=True))
    try:
        prepared, rec = nm.engine, nm.recording
        verified = nm.graph.meta["verified"]
        assert verified["fuzz"] and verified["delay_draws"] == verified["fuzz_launches"]
        # every pair of tasks the schedule leaves unordered ran later-first in a serial order
        # (the delay draws run after them as far as the budget goes)
        assert verified["draw_kinds"]["order"] == max(verified["serial_orders"]) >= 1
        assert verified["fuzz_launches"] >= verified["draw_kinds"]["order"]
        assert verified["unordered_pairs"] > 0 and verified["pairs_not_reversed"] == 0
        assert node_count(prepared.built.graph.handle) == len(prepared.graph.tasks) + len(
            prepared.gathers(0))  # no delay node in the served graph
        fresh = torch.randn_like(x)
        with torch.no_grad():
            want = model(fresh)
        torch.testing.assert_close(nm(fresh).float(), want.float(), rtol=2e-2, atol=2e-2)

        reference = Reference.record(prepared.graph, rec.replay_reference, rec.static_inputs)
        edges = prepared.schedule.edges()
        sync = list(prepared.schedule.sync_edges)
        random.Random(0).shuffle(sync)
        changes = []
        for edge in sync:
            change = power.Change("sync", removed_edges=frozenset({edge}))
            if power.needed(prepared.graph, edges, prepared.memplan, change)[0]:
                changes.append(change)
            if len(changes) == EDGES:
                break
        assert len(changes) == EDGES, "googlenet has enough sync edges the plan check needs"
        ordered = [change.describe() for change in changes
                   if _caught_by_serial_orders(power, prepared, rec, reference, change)]
        assert len(ordered) == EDGES, f"the serial orders caught only {ordered}"
        caught = [change.describe() for change in changes
                   if _caught_with_writer_late(power, prepared, rec, reference, change)]
        assert len(caught) >= EDGES - 1, f"the proof caught only {caught}"
        targeted = [change.describe() for change in changes
                    if _caught_by_targeted_cover(power, prepared, rec, reference, change)]
        assert len(targeted) >= EDGES - 1, f"the targeted draws caught only {targeted}"
        intact = power.Change("none")
        writer = _writer(power, prepared, changes[0])
        assert not _caught_with_writer_late(power, prepared, rec, reference, intact, writer)
    finally:
        nm.close()


def _writer(power, prepared, change) -> int:
    """The task whose write the removal leaves unordered (the plan check names it first)."""
    reason = power.needed(prepared.graph, prepared.schedule.edges(), prepared.memplan, change)[1]
    return int(re.search(r"tasks (\d+) and \d+", reason).group(1))


def _caught_with_writer_late(power, prepared, rec, reference, change, writer=None) -> bool:
    """Whether the proof fails a copy broken by ``change`` whose writer waits 1 ms first."""
    import numpy as np
    import torch

    from nimble import driver
    from nimble.engine.fuzz import FuzzCopies
    from nimble.errors import VerificationError

    writer = _writer(power, prepared, change) if writer is None else writer
    copies = FuzzCopies(power.copy_builder(prepared, rec), prepared.launchers,
                        rec.static_inputs[0].device, options=power.options_of(prepared, change),
                        orders=False)
    try:
        table = np.zeros(len(prepared.graph.tasks), dtype=np.uint32)
        table[writer] = 1_000_000
        driver.copy_to_device(copies.table.address, table.tobytes())
        for launch in range(4):
            power.poison_all(prepared)
            torch.cuda.synchronize()
            try:
                reference.check(f"launch {launch}", copies.run(reference.input_sets[launch % 2]),
                                launch % 2)
            except VerificationError:
                return True
        return False
    finally:
        copies.close()


def _caught_by_serial_orders(power, prepared, rec, reference, change) -> bool:
    """Whether the serial-order launches of a copy broken by ``change`` fail the proof."""
    from nimble.engine.fuzz import FuzzCopies
    from nimble.engine.proof import FuzzBudget
    from nimble.errors import VerificationError

    copies = FuzzCopies(power.copy_builder(prepared, rec), prepared.launchers,
                        rec.static_inputs[0].device, options=power.options_of(prepared, change),
                        repoison=[(prepared.arena_base, prepared.memplan.arena_bytes)], rows=0)
    try:
        assert copies.stats.pairs_left == 0 and copies.order_launchers
        power.poison_all(prepared)
        try:
            reference.fuzz_launches(copies, FuzzBudget(len(copies.order_launchers)), 0.0)
        except VerificationError:
            return copies.stats.last_kind == "order"
        return False
    finally:
        copies.close()


def _caught_by_targeted_cover(power, prepared, rec, reference, change) -> bool:
    """Whether fuzz launches of a copy broken by ``change``, as many as its targeted draws take
    to hold back every writer of a synchronization both ways, fail the proof."""
    from nimble.engine.fuzz import FuzzCopies
    from nimble.engine.proof import FuzzBudget
    from nimble.errors import VerificationError

    copies = FuzzCopies(power.copy_builder(prepared, rec), prepared.launchers,
                        rec.static_inputs[0].device, options=power.options_of(prepared, change),
                        stream_of=prepared.schedule.stream_of,
                        repoison=[(prepared.arena_base, prepared.memplan.arena_bytes)],
                        offsets=power.offsets_of(prepared, change), rows=COVER_ROWS,
                        orders=False)
    try:
        assert copies.direct_cover is not None, \
            f"{COVER_ROWS} launches cover googlenet's sync writers"
        power.poison_all(prepared)
        try:
            reference.fuzz_launches(copies, FuzzBudget(copies.direct_cover), 0.0)
        except VerificationError:
            return True
        return False
    finally:
        copies.close()
