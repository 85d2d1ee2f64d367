"""tools/experiments/train_gap.py: its switches and its summary lines (no GPU)."""
from __future__ import annotations

import pytest

from helpers import load_tool

tool = load_tool("experiments/train_gap")


def test_the_switches_and_their_defaults():
    args = tool.parse(["resnet50", "googlenet"])
    assert (args.models, args.batch, args.rounds, args.steps) == (["resnet50", "googlenet"], 32,
                                                                   9, 20)
    assert args.block_steps == 100 and tool.parse(["m", "--block-steps", "0"]).block_steps == 0
    assert args.ops == 0 and tool.parse(["m", "--ops", "25"]).ops == 25
    with pytest.raises(SystemExit):
        tool.parse([])


def test_the_summary_gives_medians_spreads_and_the_ratio():
    lines = tool.summary("m", {"backend": [5.0, 5.5, 6.0], "inductor": [4.0, 5.0, 4.5]},
                         {"backend": [100, 300, 200], "inductor": [90, 95, 100]})
    assert lines[0] == "m backend   ms/step 5.500 (5.000-6.000)  host µs/step 200"
    assert lines[1].startswith("m inductor  ms/step 4.500 (4.000-5.000)")
    assert lines[2] == "m backend / inductor 1.222"


def test_the_block_samples_are_reported_beside_the_rounds_where_measured():
    lines = tool.summary("m", {"backend": [5.0], "inductor": [4.0]},
                         {"backend": [200], "inductor": [100]},
                         {"backend": [150, 160, 170], "inductor": []})
    assert lines[0] == "m backend   ms/step 5.000 (5.000-5.000)  host µs/step 200 (in a block of 3: 160)"
    assert lines[1].endswith("host µs/step 100")


def test_a_third_mode_gets_its_own_ratio_to_the_step_prepared_by_hand():
    assert tool.parse(["m", "--unguarded"]).unguarded and not tool.parse(["m"]).unguarded
    lines = tool.summary("m", {"backend": [5.0], "inductor": [4.0], "unguarded": [4.4]},
                         {"backend": [2], "inductor": [1], "unguarded": [1]})
    assert lines[-2:] == ["m backend / inductor 1.250", "m unguarded / inductor 1.100"]


def test_the_parts_line_names_each_part_with_its_median():
    assert tool.parse(["m"]).parts == 0 and tool.parse(["m", "--parts", "50"]).parts == 50
    line = tool.parts_line("m", "backend", {"forward": 348.3, "forward+loss+backward": 3667.3,
                                            "optimizer step": 48.4, "zero_grad": 35.0})
    assert line == ("m backend   host µs, parts alone: forward 348, forward+loss+backward "
                    "3667, optimizer step 48, zero_grad 35")


def test_nimbles_backward_call_and_its_launch_are_timed_inside_and_restored_after(monkeypatch):
    """backward_spans times each call of TrainingStep.run_backward and, within it only, the
    backward graph's Launcher.run_flat; a launch outside a backward is not counted, and both
    methods are the originals again after the block."""
    from nimble.engine.autograd import TrainingStep
    from nimble.engine.launcher import Launcher

    launched = []
    monkeypatch.setattr(Launcher, "run_flat", lambda self, inputs: launched.append(inputs) or [])
    monkeypatch.setattr(TrainingStep, "run_backward",
                        lambda self, generation, grads: Launcher.run_flat(None, list(grads)))
    original = TrainingStep.run_backward, Launcher.run_flat
    with tool.backward_spans() as spans:
        assert TrainingStep.run_backward(None, 1, (7,)) == []
        Launcher.run_flat(None, [8])  # a forward's launch
    assert launched == [[7], [8]]
    assert len(spans["run_backward"]) == 1 and len(spans["launch"]) == 1
    assert spans["launch"][0] <= spans["run_backward"][0]
    assert (TrainingStep.run_backward, Launcher.run_flat) == original


def test_the_share_of_gradients_adopted_counts_arena_views_among_the_written_ones():
    """adopted_share: of the gradients a step's backward writes (an address per parameter,
    None where none), those whose .grad is still that memory; a copied or missing .grad is
    not adopted."""
    import torch

    arena = torch.zeros(3, 4)
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(4)]
    params[0].grad = arena[0]  # adopted
    params[1].grad = arena[1].clone()  # copied
    params[3].grad = arena[2]  # adopted
    step = type("Step", (), {})()
    step.params, step._grad_addresses = params, [
        arena[0].data_ptr(), arena[1].data_ptr(), None, arena[2].data_ptr()]
    assert tool.adopted_share({step}) == "2/3 (copied: #1 (4,) strides (1,))"
    step.param_names = ["a", "b", "c", "d"]
    assert tool.adopted_share({step}) == "2/3 (copied: b (4,) strides (1,))"
    assert tool.adopted_share(set()) is None
    line = tool.parts_line("m", "inductor", {"forward": 1.0, "gradients adopted (no copy)": "2/3"})
    assert line.endswith("forward 1, gradients adopted (no copy) 2/3")


def test_a_copied_gradient_is_named_with_its_arena_layout_beside_its_parameters():
    """Where the step has its layout (a real TrainingStep), the copied gradient's strides in
    the arena are said beside its parameter's: a transposed gradient of a square weight."""
    import torch

    from nimble.engine.autograd import TrainingStep
    from nimble.record.recorder import StepLayout

    w = torch.nn.Parameter(torch.zeros(3, 3))
    arena = torch.zeros(3, 3).t()  # the backward graph's gradient, transposed
    forward = type("Graph", (), {"outputs": [torch.zeros(2)], "return_copies": False})()
    backward = type("Graph", (), {"outputs": [arena]})()
    step = TrainingStep(forward, backward, StepLayout(1, 1, [0], [], [w], [1]), ["fc.weight"])
    w.grad = arena.clone()
    assert tool.adopted_share({step}) == (
        "0/1 (copied: fc.weight (3, 3) strides (3, 1), its gradient's (1, 3))")
